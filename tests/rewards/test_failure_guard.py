"""The stop guard for reward components that fail wholesale: a dead arena judge (401, 500, garbage answers, a judge
that raises, through a real HTTP server too), a reward function that raises, a reward model that returns NaN.
Each failing step warns with the component and the cause; the run stops after the configured number in a row."""

import logging
import math

import pytest
import torch
from datasets import Dataset
from fake_openai_server import FakeOpenAIServer, status
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import SHORT_PROMPTS

from trl_stable import GRPOTrainer, PPOTrainer
from trl_stable.rewards.arena import ArenaReward, LLMJudge
from trl_stable.rewards.failure_guard import FailureGuard, RewardComponentFailure
from trl_stable.testing import build_causal_lm, build_reward_model


def test_the_guard_counts_consecutive_failures_warns_and_stops(caplog):
    guard = FailureGuard("Reward function 'f'", max_failing_steps=3, setting="reward_max_failing_steps")
    with caplog.at_level(logging.WARNING):
        guard.record(True, "raised KeyError: 'topic'")
        guard.record(False)  # a good step resets the count
        guard.record(True, "x")
        guard.record(True, "y")
    assert "Reward function 'f' failed on every completion of this step (raised KeyError: 'topic')" in caplog.text
    assert guard.consecutive == 2 and guard.failed_steps == 3
    restored = FailureGuard("Reward function 'f'", max_failing_steps=3)
    restored.load_checkpoint_state(guard.checkpoint_state())
    with pytest.raises(RewardComponentFailure, match=r"for 3 consecutive steps \(last cause: z\).*reward_max_failing"):
        guard.record(True, "z")
    with pytest.raises(RewardComponentFailure):
        restored.record(True, "z")  # resumed, it stops at the same step
    never = FailureGuard("g", max_failing_steps=None)
    for _ in range(20):
        never.record(True, "down")
    with pytest.raises(ValueError, match="max_failing_steps=0"):
        FailureGuard("g", max_failing_steps=0)


def _grpo(tmp_path, tokenizer, reward_funcs, max_steps=4, reward_processing_classes=None, **overrides):
    args = tiny_grpo_args(tmp_path, num_generations=4, max_completion_length=4, max_steps=max_steps, **overrides)
    return GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": SHORT_PROMPTS * 4}),
        processing_class=tokenizer,
        reward_processing_classes=reward_processing_classes,
    )


class Unauthorized(Exception):
    pass


def _raises_401(prompt, a, b):
    raise Unauthorized("Error code: 401 - invalid api key")


def _garbage(prompt, a, b):
    return None  # a judge answer without a verdict


JUDGES = {
    "401": (_raises_401, "Unauthorized: Error code: 401"),
    "garbage": (_garbage, "gave no verdict"),
    "batch_500": (LLMJudge(lambda prompts: 1 / 0), "ZeroDivisionError"),
}


@pytest.mark.parametrize("kind", JUDGES)
def test_a_dead_arena_judge_stops_grpo_naming_the_judge_and_the_cause(tmp_path, tokenizer, kind, caplog):
    judge, cause = JUDGES[kind]
    arena = ArenaReward(judge, max_failing_steps=2)
    trainer = _grpo(tmp_path, tokenizer, arena)
    with caplog.at_level(logging.WARNING), pytest.raises(RewardComponentFailure) as err:
        trainer.train()
    message = str(err.value)
    assert "The arena judge of reward function 'arena_round_robin'" in message and cause in message
    assert "for 2 consecutive steps" in message and "ArenaReward(max_failing_steps=...)" in message
    assert trainer.state.global_step == 1  # the first failing step trained (on constant rewards), the second stopped
    assert "failed on every completion of this step" in caplog.text


def test_a_judge_behind_a_real_server_answering_401_or_500_stops_the_run(tmp_path, tokenizer):
    openai = pytest.importorskip("openai")
    for code in (401, 500):
        with FakeOpenAIServer() as server:
            server.script(*[status(code) for _ in range(200)])
            client = openai.OpenAI(base_url=server.base_url, api_key="sk-test-dummy", max_retries=0)

            def chat(messages, client=client):
                answer = client.chat.completions.create(model="judge", messages=messages)
                return answer.choices[0].message.content

            arena = ArenaReward(LLMJudge.from_chat(chat, max_workers=2), max_failing_steps=2)
            trainer = _grpo(tmp_path / str(code), tokenizer, arena)
            with pytest.raises(
                RewardComponentFailure, match=rf"every judge request failed, e\.g\. \w+: Error code: {code}"
            ):
                trainer.train()
            assert server.served.get(f"status_{code}", 0) > 0


def test_a_judge_that_recovers_does_not_stop_the_run(tmp_path, tokenizer):
    calls = {"n": 0}

    def flaky(prompt, a, b):
        calls["n"] += 1
        if calls["n"] <= 12:  # the whole first step (4 completions: 6 pairs, both orders)
            raise Unauthorized("Error code: 500")
        return float(len(a) > len(b))

    arena = ArenaReward(flaky, max_failing_steps=2)
    trainer = _grpo(tmp_path, tokenizer, arena, max_steps=3)
    trainer.train()
    assert trainer.state.global_step == 3 and arena.guard.failed_steps == 1 and arena.guard.consecutive == 0


def test_a_reward_function_that_keeps_raising_stops_both_trainers(tmp_path, tokenizer, caplog):
    def broken(completions, **kwargs):
        raise KeyError("topic")

    trainer = _grpo(tmp_path / "grpo", tokenizer, broken, reward_max_failing_steps=2)
    with caplog.at_level(logging.WARNING), pytest.raises(RewardComponentFailure) as err:
        trainer.train()
    assert "Reward function 'broken' failed on every completion for 2 consecutive steps" in str(err.value)
    assert "raised KeyError: 'topic'" in str(err.value)
    assert trainer.state.global_step == 1

    args = tiny_ppo_args(
        tmp_path / "ppo", mini_batch_size=4, max_new_tokens=4, max_steps=4, reward_max_failing_steps=2,
        nan_reward_action="zero",
    )  # fmt: skip
    ppo = PPOTrainer(
        build_causal_lm("gpt2", tokenizer, seed=0),
        reward_funcs=broken,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": SHORT_PROMPTS * 4}),
    )
    with pytest.raises(RewardComponentFailure, match=r"'broken' failed on every completion for 2.*KeyError"):
        ppo.train()
    assert ppo.state.global_step == 1


def test_a_reward_model_returning_nan_stops_the_run_and_a_transient_error_does_not(tmp_path, tokenizer):
    model = build_reward_model("gpt2", tokenizer, seed=0)
    model.register_forward_hook(lambda module, args, out: out.__class__(logits=torch.full_like(out.logits, math.nan)))
    trainer = _grpo(tmp_path / "rm", tokenizer, model, reward_processing_classes=tokenizer, reward_max_failing_steps=2)
    with pytest.raises(RewardComponentFailure, match=r"returned None/NaN or an out-of-range value for every"):
        trainer.train()

    steps = {"n": 0}

    def flaky(completions, **kwargs):
        steps["n"] += 1
        if steps["n"] == 1:
            raise ConnectionError("reward service down")
        return [float(len(c)) for c in completions]

    trainer = _grpo(tmp_path / "flaky", tokenizer, flaky, max_steps=3, reward_max_failing_steps=2)
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.reward_guards["flaky"].failed_steps == 1
    assert trainer._stable_state()["shared"]["reward_guards"]["flaky"] == {"consecutive": 0, "failed_steps": 1}
