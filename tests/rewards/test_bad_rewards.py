"""Bad reward outputs, kind by kind, through both trainers' reward paths: the same outcome in GRPO and PPO.

Each row of the tables is one kind of reward-function output for a batch of four completions and what the contract
(`trl_stable.rewards.dense`) makes of it: the rewards the trainer trains on (NaN: "does not apply"), or the error,
naming the function and the completion. GRPO is driven through TRL's own `_calculate_rewards` (with trl_stable's
override around it) and its dense-reward hooks, PPO through the `RewardFunctions` its `train()` calls.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np
import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import PROMPTS

from trl_stable import GRPOTrainer, PPOTrainer
from trl_stable.rewards import dense_reward
from trl_stable.rewards.dense import RewardContractError, RewardTypeError
from trl_stable.testing import build_causal_lm

NAN, INF = math.nan, math.inf
IDS = [[5, 6, 7], [8, 9], [10, 11, 12], [13]]  # completion lengths 3, 2, 3, 1
FINE = [0.0, 1.0, 0.5, -2.0]


def _object_array(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


# (id, what the sequence-level function returns, expected rewards or (error class, message part))
SEQUENCE_KINDS = [
    ("floats", FINE, FINE),
    ("ints", [0, 1, 2, -3], [0.0, 1.0, 2.0, -3.0]),
    ("bools", [True, False, True, False], [1.0, 0.0, 1.0, 0.0]),
    ("tuple", tuple(FINE), FINE),
    ("generator", (v for v in FINE), FINE),
    ("numpy-array", np.array(FINE), FINE),
    ("numpy-scalars", [np.float32(0.5), np.float64(1.0), np.int64(2), np.bool_(True)], [0.5, 1.0, 2.0, 1.0]),
    ("tensor-1d", torch.tensor(FINE), FINE),
    ("tensors-0d", [torch.tensor(v) for v in FINE], FINE),
    ("none", [None, 1.0, 0.5, -2.0], [NAN, 1.0, 0.5, -2.0]),
    ("nan", [0.0, NAN, 0.5, -2.0], [0.0, NAN, 0.5, -2.0]),
    ("+inf", [0.0, 1.0, INF, -2.0], [0.0, 1.0, NAN, -2.0]),
    ("-inf", [0.0, 1.0, 0.5, -INF], [0.0, 1.0, 0.5, NAN]),
    ("float32-overflow", [1e39, 1.0, 0.5, -2.0], [NAN, 1.0, 0.5, -2.0]),
    ("inf-in-tensor", torch.tensor([INF, 1.0, 0.5, -2.0]), [NAN, 1.0, 0.5, -2.0]),
    ("all-none", [None] * 4, [NAN] * 4),
    ("string-value", [0.0, "0.5", 0.5, -2.0], (RewardTypeError, "'probe' returned '0.5' (str) for completion 1")),
    ("numpy-string", [0.0, 1.0, np.str_("0.5"), 0.0], (RewardTypeError, "'0.5' (str) for completion 2")),
    ("bytes-value", [b"1", 1.0, 0.5, 0.0], (RewardTypeError, "for completion 0, which is not a number")),
    ("complex", [0.0, 1.0, 0.5, 1j], (RewardTypeError, "complex number 1j for completion 3")),
    ("object", [0.0, object(), 0.5, 0.0], (RewardTypeError, "(object) for completion 1")),
    ("object-array", _object_array([0.0, "x", 0.5, 0.0]), (RewardTypeError, "'x' (str) for completion 1")),
    ("nested-rows", [[v] for v in FINE], (RewardTypeError, "returned a list ([0.0]) for completion 0")),
    ("tensors-1-element", [torch.tensor([v]) for v in FINE], (RewardTypeError, "shape (1,) for completion 0")),
    ("tensor-2d", torch.tensor(FINE).unsqueeze(1), (RewardTypeError, "returned a Tensor of shape (4, 1)")),
    ("bare-float", 0.5, (RewardTypeError, "'probe' returned 0.5 (float); return a list")),
    ("bare-int", 1, (RewardTypeError, "'probe' returned 1 (int); return a list")),
    ("bare-tensor", torch.tensor(0.5), (RewardTypeError, "returned a Tensor of shape ()")),
    ("string", "0.5 1.0 0.5 0.0", (RewardTypeError, "(str); return a list")),
    ("none-output", None, (RewardTypeError, "'probe' returned None (NoneType); return a list")),
    ("dict", dict(enumerate(FINE)), (RewardTypeError, "(dict); return a list")),
    ("set", {0.0, 1.0, 0.5, -2.0}, (RewardTypeError, "(set); return a list")),
    ("too-few", FINE[:3], (RewardContractError, "'probe' returned 3 values for 4 completions")),
    ("too-many", FINE + [0.0], (RewardContractError, "'probe' returned 5 values for 4 completions")),
    ("empty", [], (RewardContractError, "'probe' returned 0 values for 4 completions")),
]

ROWS = [[0.5] * len(ids) for ids in IDS]
# (id, what the dense function returns, expected rows (NaN tokens as 0) and NaN-token count, or the error)
DENSE_KINDS = [
    ("floats", ROWS, (ROWS, 0)),
    ("none-row", [None] + ROWS[1:], ([[0.0] * 3] + ROWS[1:], 0)),
    ("nan-token", [[0.5, NAN, 0.5]] + ROWS[1:], ([[0.5, 0.0, 0.5]] + ROWS[1:], 1)),
    ("+inf-token", [[0.5, INF, 0.5]] + ROWS[1:], ([[0.5, 0.0, 0.5]] + ROWS[1:], 1)),
    ("-inf-token", ROWS[:3] + [[-INF]], (ROWS[:3] + [[0.0]], 1)),
    ("none-token", ROWS[:1] + [[None, 0.5]] + ROWS[2:], (ROWS[:1] + [[0.0, 0.5]] + ROWS[2:], 1)),
    ("tensor-rows", [torch.tensor(r) for r in ROWS], (ROWS, 0)),
    ("numpy-rows", [np.array(r) for r in ROWS], (ROWS, 0)),
    ("string-token", ROWS[:1] + [["1", 0.5]] + ROWS[2:], (RewardTypeError, "'1' (str) for token 0 of completion 1")),
    (
        "nested-token",
        [[[0.5]] * 3] + ROWS[1:],
        (RewardTypeError, "returned a list ([0.5]) for token 0 of completion 0"),
    ),
    ("bare-float", 0.5, (RewardTypeError, "'dense_probe' returned 0.5 (float); return one list")),
    ("float-row", [0.5] + ROWS[1:], (RewardTypeError, "returned 0.5 (float); return a list of per-token numbers")),
    ("string-row", ["0.5 0.5 0.5"] + ROWS[1:], (RewardTypeError, "(str); return a list of per-token numbers")),
    ("tensor-2d-row", [torch.zeros(3, 1)] + ROWS[1:], (RewardTypeError, "Tensor of shape (3, 1)")),
    ("short-row", [[0.5, 0.5]] + ROWS[1:], (RewardContractError, "2 token rewards for completion 0, which has 3")),
    ("too-few-rows", ROWS[:3], (RewardContractError, "'dense_probe' returned 3 entries for 4 completions")),
]

ANSWER: dict[str, Any] = {}


def probe(completion_ids, **kwargs):
    out = ANSWER["sequence"]
    return out() if callable(out) else out


@dense_reward
def dense_probe(completion_ids, **kwargs):
    out = ANSWER.get("dense")
    return [None] * len(completion_ids) if out is None else out


@pytest.fixture(scope="module")
def trainers(tokenizer, tmp_path_factory):
    """A GRPO and a PPO trainer on the same two reward functions, built once; `ANSWER` says what they return."""
    out = tmp_path_factory.mktemp("bad_rewards")
    grpo = GRPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        [probe, dense_probe],
        # "zero": the contract's reading of the rewards is under test here, not what GRPO does with unscorable rows
        args=tiny_grpo_args(out / "grpo", nan_reward_action="zero"),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    ppo = PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        [probe, dense_probe],
        args=tiny_ppo_args(out / "ppo", mini_batch_size=4),
        processing_class=tokenizer,
    )
    return grpo, ppo


def grpo_rewards(trainer: GRPOTrainer) -> tuple[list[float], list[list[float]], float]:
    """Sequence rewards, dense rows and NaN-token count, through the GRPO trainer's reward hooks."""
    inputs = [{"prompt": p} for p in PROMPTS]
    completions = ["x" * len(ids) for ids in IDS]
    rewards_per_func = trainer._calculate_rewards(inputs, PROMPTS, completions, IDS)
    pending = trainer._start_dense_rewards(inputs, PROMPTS, completions, IDS, rewards_per_func)
    rows = trainer._collect_dense_rewards(pending)
    dense = [rows[i, : len(ids)].tolist() for i, ids in enumerate(IDS)]
    return rewards_per_func[:, 0].tolist(), dense, pending.collect().metrics["rewards/dense_probe/nan_tokens"]


def ppo_rewards(trainer: PPOTrainer) -> tuple[list[float], list[list[float]], float]:
    """The same through the `RewardFunctions` PPO's `train()` scores each batch with."""
    rows = [{"prompt": p} for p in PROMPTS]
    result = trainer.rewards(rows, PROMPTS, [torch.tensor(ids) for ids in IDS], trainer.state)
    return result.scores.tolist(), result.dense.rows, result.metrics["rewards/dense_probe/nan_tokens"]


def outcome(score, trainer):
    try:
        return score(trainer)
    except RewardContractError as err:
        return err


def same(actual: list[float], expected: list[float]) -> bool:
    return len(actual) == len(expected) and all(
        (math.isnan(a) and math.isnan(e)) or a == pytest.approx(e, abs=1e-6) for a, e in zip(actual, expected)
    )


def check(result, expected) -> None:
    if isinstance(expected, tuple) and isinstance(expected[0], type):
        error, message = expected
        assert isinstance(result, error), f"expected {error.__name__}, got {result!r}"
        assert message in str(result), str(result)
    else:
        assert not isinstance(result, Exception), f"unexpected error {result!r}"
        assert same(result, expected), (result, expected)


@pytest.mark.parametrize("kind, answer, expected", SEQUENCE_KINDS, ids=[k[0] for k in SEQUENCE_KINDS])
def test_sequence_reward_kind(trainers, kind, answer, expected):
    results = []
    for trainer, score in zip(trainers, (grpo_rewards, ppo_rewards)):
        # a generator is consumed by the first call: each trainer gets its own
        ANSWER.update(sequence=(lambda: (v for v in FINE)) if kind == "generator" else answer, dense=None)
        result = outcome(score, trainer)
        results.append(result if isinstance(result, Exception) else result[0])
    for result in results:
        check(result, expected)
    if isinstance(results[0], Exception):  # the same error, word for word, in both trainers
        assert type(results[0]) is type(results[1]) and str(results[0]) == str(results[1])


@pytest.mark.parametrize("kind, answer, expected", DENSE_KINDS, ids=[k[0] for k in DENSE_KINDS])
def test_dense_reward_kind(trainers, kind, answer, expected):
    results = []
    for trainer, score in zip(trainers, (grpo_rewards, ppo_rewards)):
        ANSWER.update(sequence=FINE, dense=answer)
        results.append(outcome(score, trainer))
    if isinstance(expected[0], type):
        for result in results:
            check(result, expected)
        assert str(results[0]) == str(results[1])
        return
    rows, nan_tokens = expected
    for result in results:
        assert not isinstance(result, Exception), f"unexpected error {result!r}"
        _, dense, count = result
        assert all(same(row, want) for row, want in zip(dense, rows, strict=True)), (dense, rows)
        assert count == nan_tokens


def test_async_reward_functions_get_the_same_contract(tokenizer, tmp_path):
    """TRL awaits async reward functions on its own loop: the contract wraps them as they are (still async), once,
    when the trainer is built; `reward_funcs` then holds the wrapper, which unwraps to the user's function."""

    async def async_probe(completion_ids, **kwargs):
        return [INF, "0.5", 0.0, 0.0] if ANSWER.get("broken") else [INF, 1.0, 0.5, -2.0]

    grpo = GRPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        async_probe,
        args=tiny_grpo_args(tmp_path, nan_reward_action="zero"),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )  # fmt: skip
    try:
        rewards = grpo._calculate_rewards([{"prompt": p} for p in PROMPTS], PROMPTS, ["x"] * 4, IDS)
        assert same(rewards[:, 0].tolist(), [NAN, 1.0, 0.5, -2.0])
        ANSWER["broken"] = True
        with pytest.raises(RewardTypeError, match="'async_probe' returned '0.5' \\(str\\) for completion 1"):
            grpo._calculate_rewards([{"prompt": p} for p in PROMPTS], PROMPTS, ["x"] * 4, IDS)
        ANSWER["broken"] = False  # the error was this call's: the next call starts clean
        rewards = grpo._calculate_rewards([{"prompt": p} for p in PROMPTS], PROMPTS, ["x"] * 4, IDS)
        assert same(rewards[:, 0].tolist(), [NAN, 1.0, 0.5, -2.0])
    finally:
        ANSWER.pop("broken")
    (checked,) = grpo.reward_funcs
    assert inspect.iscoroutinefunction(checked) and inspect.unwrap(checked) is async_probe
    assert checked.__name__ == "async_probe" and grpo.reward_func_names == ["async_probe"]
