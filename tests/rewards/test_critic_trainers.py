"""Tiny-kit GRPO and PPO runs train with the critic's intrinsic reward, from each backend (lexicon, OpenAI-compatible
loopback server, local transformers critic); the per-token rewards the trainers use are the ones the critic gave."""

import math

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import env_reward

from trl_stable import GRPOTrainer, PPOTrainer
from trl_stable.rewards import CriticIntrinsicReward, CriticRewardConfig
from trl_stable.testing import build_causal_lm

try:
    from fake_openai_server import FakeOpenAIServer, status
except ImportError:
    from tests.rewards.fake_openai_server import FakeOpenAIServer, status

PROMPTS = ["The movie was", "I think the", "A great story", "We saw a"]
DUMMY_KEY = "sk-test-DUMMY-trainers-77aa"


class Recording(CriticIntrinsicReward):
    """Keeps every call's env_rewards and returned per-token rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, env_rewards=None, **kwargs):
        rows = super().__call__(prompts, completions, completion_ids, env_rewards=env_rewards, **kwargs)
        self.calls.append({"env": list(env_rewards), "ids": [list(c) for c in completion_ids], "rows": rows})
        return rows


def last_word_answer(prompt):
    """A critic that names the last word of the text as a positive span (it is in the completion, mostly)."""
    text = prompt.rsplit("Review:", 1)[-1].split()
    return "Identified Positive Text Span:\n[Span 1]: " + (text[-1] if text else "None identified")


def intrinsic(backend, tokenizer, server=None, model=None):
    cfg = dict(use_intrinsic_reward=True, intrinsic_reward_threshold=math.inf, positive_reward_value=0.5)
    if backend == "openai":
        cfg.update(critic_backend="openai", critic_base_url=server.base_url, critic_model="tiny", critic_timeout=5.0)
    elif backend == "transformers":
        cfg.update(critic_backend="transformers", critic_max_tokens=4)
    fn = Recording(CriticRewardConfig(**cfg), tokenizer, critic_model=model)
    if backend == "openai":
        fn.backend.backoff_base = 0.01
    return fn


@pytest.fixture
def backend_env(request, tokenizer, monkeypatch):
    """(intrinsic reward function, server or None) for the backend named by the test parameter."""
    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    if request.param == "openai":
        with FakeOpenAIServer(answer=last_word_answer) as server:
            server.script(status(500), status(429, retry_after=0))  # faults mid-training are retried
            yield intrinsic("openai", tokenizer, server=server), server
    elif request.param == "transformers":
        # self-critique: the policy that is being trained is the critic
        yield intrinsic("transformers", tokenizer, model=build_causal_lm("qwen2", tokenizer, seed=0)), None
    else:
        yield intrinsic("lexicon", tokenizer), None


def policy(fn, tokenizer):
    """The model to train: for the transformers backend, the critic itself (self-critique)."""
    return fn.backend.model if fn.backend.name == "transformers" else build_causal_lm("qwen2", tokenizer, seed=0)


def check_calls(fn, tokenizer, backend):
    assert fn.calls, "the trainer never called the intrinsic reward"
    for call in fn.calls:
        assert all(math.isfinite(e) for e in call["env"])  # the environment reward came along
        for ids, row in zip(call["ids"], call["rows"]):
            assert row is None or len(row) == len(ids)
    m = fn.metrics()
    assert m["critic/critiqued"] == sum(len(c["ids"]) for c in fn.calls)  # threshold inf: everything critiqued
    assert m["critic/failures"] == 0
    if backend == "openai":
        assert m["critic/retries"] == 2
        rewarded = sum(v != 0 for c in fn.calls for row in c["rows"] if row for v in row)
        assert rewarded > 0  # the scripted critic names a word of each completion


@pytest.mark.parametrize("backend_env", ["lexicon", "openai", "transformers"], indirect=True)
def test_grpo_trains_with_intrinsic_reward(backend_env, tokenizer, tmp_path):
    fn, server = backend_env
    backend = fn.backend.name

    class Spy(GRPOTrainer):
        dense_seen = []

        def _postprocess_generation(self, output, record):
            out = super()._postprocess_generation(output, record)  # collects the prefetched dense rewards
            if record.dense_rewards is not None:
                self.dense_seen.append(record.dense_rewards.clone())
            return out

    args = tiny_grpo_args(tmp_path, max_steps=2, learning_rate=1e-3, seed=0)
    trainer = Spy(
        model=policy(fn, tokenizer),
        reward_funcs=[env_reward, fn],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(math.isfinite(h["loss"]) for h in logs)
    check_calls(fn, tokenizer, backend)
    # the trainer's dense rewards are exactly the critic's rows (weight 1), padded
    assert len(trainer.dense_seen) == len(fn.calls)
    for dense, call in zip(trainer.dense_seen, fn.calls):
        for i, row in enumerate(call["rows"]):
            row = row or [0.0] * len(call["ids"][i])
            assert torch.allclose(dense[i, : len(row)], torch.tensor(row, dtype=dense.dtype))
            assert not dense[i, len(row) :].any()
    assert any("critic/critiqued_fraction" in h for h in trainer.state.log_history)
    if backend == "transformers":
        assert trainer.accelerator.unwrap_model(trainer.model) is fn.backend.model  # critiqued by itself
    fn.close()


@pytest.mark.parametrize("backend_env", ["lexicon", "openai", "transformers"], indirect=True)
def test_ppo_trains_with_intrinsic_reward(backend_env, tokenizer, tmp_path):
    fn, server = backend_env
    backend = fn.backend.name
    args = tiny_ppo_args(
        tmp_path, max_new_tokens=6, min_new_tokens=2, max_steps=2, init_kl_coef=0.0, adap_kl_ctrl=False
    )
    trainer = PPOTrainer(
        policy(fn, tokenizer),
        reward_funcs=[env_reward, fn],
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
    )
    out = trainer.train()
    assert out.global_step == 2
    check_calls(fn, tokenizer, backend)
    logs = [h for h in trainer.state.log_history if "loss/total" in h]  # the steps (not Trainer's summary)
    assert len(logs) == 2
    for log, call in zip(logs, fn.calls):
        # dense/reward_mean is the mean over samples of the summed per-token dense rewards: the critic's
        expected = sum(sum(r) if r else 0.0 for r in call["rows"]) / len(call["rows"])
        assert log["dense/reward_mean"] == pytest.approx(expected, abs=1e-6)
        assert log["critic/critiqued_fraction"] == 1.0  # the critic's per-step metrics reach the PPO logs
    fn.close()
