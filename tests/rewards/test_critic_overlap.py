"""The dense-reward prefetch protocol in both trainers: `prefetch` runs right after the sequence rewards, the function
itself only after the rollout forward passes (PPO) / TRL's scoring round (GRPO), and the numbers do not change.

Order of events only, never wall-clock time."""

import math

import pytest
import torch
import trl
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import env_reward

from trl_stable import GRPOTrainer, PPOTrainer
from trl_stable.rewards import CriticIntrinsicReward, CriticRewardConfig
from trl_stable.rewards.dense import RewardContractError, has_prefetch
from trl_stable.testing import build_causal_lm

try:
    from fake_openai_server import FakeOpenAIServer
except ImportError:
    from tests.rewards.fake_openai_server import FakeOpenAIServer

PROMPTS = ["The movie was", "I think the", "A great story", "We saw a"]


class DenseFn:
    """A dense reward function logging its calls into a shared event list; `prefetch` optional."""

    dense = True

    def __init__(self, events, name="dense_fn"):
        self.events = events
        self.__name__ = name
        self.prefetched, self.called = [], []

    def __call__(self, prompts, completions, completion_ids, env_rewards=None, **kwargs):
        self.events.append("call")
        self.called.append({"ids": [list(c) for c in completion_ids], "env": list(env_rewards)})
        # depends on the ids and the environment reward, so a mismatch between prefetch and call would show
        return [[0.01 * (t % 7) + 0.1 * e for t in ids] for ids, e in zip(completion_ids, env_rewards)]


class PrefetchingDenseFn(DenseFn):
    def prefetch(self, prompts, completions, completion_ids, env_rewards=None, **kwargs):
        self.events.append("prefetch")
        self.prefetched.append({"ids": [list(c) for c in completion_ids], "env": list(env_rewards)})


def ppo_trainer(tokenizer, tmp_path, fn, max_steps=2):
    args = tiny_ppo_args(tmp_path, max_new_tokens=6, min_new_tokens=2, max_steps=max_steps, seed=1)
    return PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=[env_reward, fn],
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
    )


def spy_rollout_pass(trainer, events):
    real = trainer.rollout_pass

    def rollout_pass(batch):
        events.append("rollout_pass")  # the policy / value / reference forwards
        return real(batch)

    trainer.rollout_pass = rollout_pass


NO_SPAN = "Identified Positive Text Span:\n[Span 1]: None identified"


def loopback_critic(server, tokenizer):
    """The critic's intrinsic reward on every sample, asking the loopback `server`."""
    cfg = CriticRewardConfig(
        use_intrinsic_reward=True, intrinsic_reward_threshold=math.inf, critic_backend="openai",
        critic_base_url=server.base_url, critic_model="tiny", critic_timeout=5.0,
    )  # fmt: skip
    return CriticIntrinsicReward(cfg, tokenizer)


def numeric_logs(history):
    timed = ("time/", "step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
    return [{k: v for k, v in h.items() if not k.startswith(timed)} for h in history]


def test_ppo_prefetches_before_the_rollout_pass_and_calls_after(tokenizer, tmp_path):
    events = []
    fn = PrefetchingDenseFn(events)
    trainer = ppo_trainer(tokenizer, tmp_path, fn)
    spy_rollout_pass(trainer, events)
    trainer.train()
    assert events == ["prefetch", "rollout_pass", "call"] * 2
    assert fn.prefetched == fn.called  # the same completions and environment rewards in both
    assert all(math.isfinite(e) for c in fn.called for e in c["env"])


def test_ppo_calls_a_function_without_prefetch_after_the_rollout_pass(tokenizer, tmp_path):
    events = []
    fn = DenseFn(events)
    assert not has_prefetch(fn)
    trainer = ppo_trainer(tokenizer, tmp_path, fn)
    spy_rollout_pass(trainer, events)
    trainer.train()
    assert events == ["rollout_pass", "call"] * 2


def test_ppo_numbers_do_not_depend_on_prefetch(tokenizer, tmp_path):
    runs = {}
    for cls in (DenseFn, PrefetchingDenseFn):
        fn = cls([])
        trainer = ppo_trainer(tokenizer, tmp_path / cls.__name__, fn)
        trainer.train()
        runs[cls.__name__] = (numeric_logs(trainer.state.log_history), fn.called)
    (logs_a, calls_a), (logs_b, calls_b) = runs["DenseFn"], runs["PrefetchingDenseFn"]
    assert calls_a == calls_b
    assert logs_a == logs_b
    # the dense metrics collected after the forwards still reach the step's logs
    expected = [
        sum(sum(0.01 * (t % 7) + 0.1 * e for t in ids) for ids, e in zip(c["ids"], c["env"])) / 4 for c in calls_a
    ]
    steps = [h for h in logs_a if "loss/total" in h]  # not Trainer's end-of-training summary
    assert [h["rewards/dense_fn/sum_mean"] for h in steps] == pytest.approx(expected)


def test_ppo_step_takes_deferred_token_rewards(tokenizer, tmp_path):
    trainer = ppo_trainer(tokenizer, tmp_path, DenseFn([]))
    events = []
    spy_rollout_pass(trainer, events)
    queries = [torch.tensor(tokenizer(p)["input_ids"]) for p in PROMPTS]
    responses = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10]), torch.tensor([11, 12])]
    rows = [[0.1] * len(r) for r in responses]

    def deferred():
        events.append("resolved")
        return rows

    stats = trainer.step(queries, responses, deferred, scores=[1.0, 0.0, 0.5, 0.2])
    assert events == ["rollout_pass", "resolved"]
    assert stats["dense/reward_mean"] == pytest.approx(sum(sum(r) for r in rows) / 4)

    def broken():
        return [["0.1"] * len(r) for r in responses]

    with pytest.raises(RewardContractError, match="'0.1' \\(str\\) for token 0 of sample 0"):
        trainer.step(queries, responses, broken)
    with pytest.raises(ValueError, match="token_rewards\\[1\\] has 3 entries"):
        trainer.step(queries, responses, lambda: [[0.0] * 3] * 4)


def test_ppo_critic_requests_are_sent_once_and_joined(tokenizer, tmp_path, monkeypatch):
    """With the loopback critic, the prefetched requests are the only ones the server sees: the later call joins them
    (in flight or answered) instead of asking again."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-DUMMY-overlap-11bb")
    with FakeOpenAIServer(answer=lambda prompt: NO_SPAN) as server:
        fn = loopback_critic(server, tokenizer)
        events = []
        real_prefetch = fn.prefetch
        fn.prefetch = lambda **kw: (events.append("prefetch"), real_prefetch(**kw))[1]
        trainer = ppo_trainer(tokenizer, tmp_path, fn)
        spy_rollout_pass(trainer, events)
        trainer.train()
        fn.close()
        prompts = [r.prompt for r in server.received]
    assert events == ["prefetch", "rollout_pass"] * 2
    assert len(prompts) == 8 and len(set(prompts)) == len(prompts)  # 2 steps x 4 samples, each asked once
    m = fn.metrics()
    assert m["critic/critiqued"] == 8 and m["critic/failures"] == 0
    # counted once: the call collected the prefetched requests instead of asking (and counting) them again
    counts = [m[f"critic/{k}"] for k in ("requests", "successes", "deduplicated", "cache_hits")]
    assert counts == [8, 8, 0, 0]


# ---------------------------------------------------------------------------------------------------------- GRPO
def grpo_trainer(tokenizer, tmp_path, fn, events=None):
    args = tiny_grpo_args(
        tmp_path, max_steps=2, learning_rate=1e-3, seed=0,
        num_iterations=2,  # TRL then runs its no-grad old-logprob pass inside _generate_and_score_completions
    )  # fmt: skip

    class Spy(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *a, **kw):
            if events is not None and self._rollout is not None and not torch.is_grad_enabled():
                events.append("old_logprob_pass")
            return super()._get_per_token_logps_and_entropies(*a, **kw)

    return Spy(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=[env_reward, fn],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )


def test_grpo_prefetches_right_after_generation_and_calls_after_trls_round(tokenizer, tmp_path, monkeypatch):
    events = []
    real_round = trl.GRPOTrainer._generate_and_score_completions

    def round_(self, inputs):
        out = real_round(self, inputs)
        events.append("trl_round_done")  # TRL's scoring round, with its forward passes, has returned
        return out

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", round_)
    fn = PrefetchingDenseFn(events)
    trainer = grpo_trainer(tokenizer, tmp_path, fn, events)
    trainer.train()
    # TRL runs its old-logprob pass before its _calculate_rewards call; the rewards are scored (and the dense
    # functions prefetched) in _generate instead, so the critic's latency overlaps that pass
    rounds = ["prefetch", "old_logprob_pass", "trl_round_done", "call"]
    assert events == rounds * (len(events) // len(rounds)) and len(events) >= len(rounds)
    assert fn.prefetched == fn.called


def test_grpo_numbers_do_not_depend_on_prefetch(tokenizer, tmp_path):
    runs = {}
    for cls in (DenseFn, PrefetchingDenseFn):
        fn = cls([])
        trainer = grpo_trainer(tokenizer, tmp_path / cls.__name__, fn)
        trainer.train()
        runs[cls.__name__] = (numeric_logs(trainer.state.log_history), fn.called)
    assert runs["DenseFn"] == runs["PrefetchingDenseFn"]
    logs = [h for h in runs["DenseFn"][0] if "rewards/dense_fn/sum_mean" in h]
    assert logs and all(math.isfinite(h["rewards/dense_fn/sum_mean"]) for h in logs)


def test_grpo_deferred_contract_error_names_the_function(tokenizer, tmp_path):
    class Broken(PrefetchingDenseFn):
        def __call__(self, prompts, completions, completion_ids, **kwargs):
            return [["0.1"] * len(c) for c in completion_ids]

    events = []
    trainer = grpo_trainer(tokenizer, tmp_path, Broken(events, name="broken_fn"))
    with pytest.raises(RewardContractError, match="broken_fn"):
        trainer.train()
    assert events[:1] == ["prefetch"]


class HandleDenseFn(DenseFn):
    """Its prefetch returns a handle; the protocol hands it back to the call as ``prefetched=``."""

    def prefetch(self, prompts, completions, completion_ids, env_rewards=None, **kwargs):
        self.events.append("prefetch")
        return {"ids": [list(c) for c in completion_ids], "env": list(env_rewards)}

    def __call__(self, prompts, completions, completion_ids, env_rewards=None, prefetched=None, **kwargs):
        self.prefetched.append(prefetched)
        return super().__call__(prompts, completions, completion_ids, env_rewards=env_rewards, **kwargs)


@pytest.mark.parametrize("trainer_kind", ["ppo", "grpo"])
def test_the_prefetch_handle_reaches_the_call(tokenizer, tmp_path, trainer_kind):
    fn = HandleDenseFn([])
    make = ppo_trainer if trainer_kind == "ppo" else grpo_trainer
    make(tokenizer, tmp_path, fn).train()
    assert fn.called and fn.prefetched == fn.called  # each call got its own batch's handle


def test_grpo_critic_requests_are_sent_and_counted_once(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-DUMMY-overlap-22cc")
    with FakeOpenAIServer(answer=lambda prompt: NO_SPAN) as server:
        fn = loopback_critic(server, tokenizer)
        grpo_trainer(tokenizer, tmp_path, fn).train()
        fn.close()
        sent = len(server.received)
    m = fn.metrics()
    # every critiqued sample asked once (a completion sampled twice in a group joins the first one's request)
    assert m["critic/critiqued"] > 0 and sent + m["critic/deduplicated"] == m["critic/critiqued"]
    counts = [m[f"critic/{k}"] for k in ("requests", "failures", "cache_hits")]
    assert counts == [m["critic/critiqued"], 0, 0]
