"""The reward-function contract shared by the GRPO and PPO trainers: sequence rewards, dense rewards, NaN/None/inf.

Sequence-level reward functions have TRL's signature, ``f(prompts, completions, completion_ids, **columns)``, and
return one value per completion. A dense reward function has the same signature, is marked with `dense_reward`, and
returns per-token rewards:

    @dense_reward
    def my_reward(prompts, completions, completion_ids, env_rewards=None, **kwargs) -> list[list[float] | None]:
        ...

Both trainers call dense functions *after* the sequence-level ones and pass ``env_rewards``: per completion, the
weighted sum of the sequence-level rewards (so a critic can, e.g., only critique samples whose environment reward is
low).

**Prefetch (optional).** Answers that take long to come back (an LLM critic behind an API) can overlap the trainer's
own work. A dense function MAY have a method

    def prefetch(self, prompts, completions, completion_ids, env_rewards=None, **kwargs) -> Any: ...

that starts the work and returns at once, with a handle to it (or None). Both trainers call it, with keyword
arguments, right after the sequence-level rewards (so ``env_rewards`` is final) and with the same arguments as the
later call; they call the function itself only when the token rewards are needed, after their rollout forward passes
(PPO: policy, value and reference; GRPO: after TRL's scoring round, see `trl_stable.trainers.grpo`), adding
``prefetched=<the handle>`` when the prefetch returned one. The call must return what it would have returned without
the prefetch: the prefetch changes when the work is done, never the numbers. Functions without `prefetch` are simply
called at that later point. `CriticIntrinsicReward.prefetch` sends the critic requests and returns them; the later
call collects them, so every request is made and counted once.

The one rule for what a value means, in both trainers:

| value | sequence reward (one per completion) | dense reward (one per token) |
|---|---|---|
| finite float | the reward | the token's reward |
| None | "does not apply" (TRL's meaning): left out of the weighted sum | a None *row*: no dense reward, zeros |
| NaN | the same as None | "does not apply" at this token: 0, counted in ``rewards/<name>/nan_tokens`` |
| +-inf | error (`ValueError` naming the function and the completion) | error, likewise |

A contract error raises `RewardContractError` (a `ValueError`) on every process at once (`raise_on_every_process`),
since a reward function runs on one process's completions only.

`PPOTrainer.step` takes final per-token rewards and scores rather than reward-function output: there a NaN marks a
sample without a reward (RELC-era loops put the environment score inside the token rewards, so a NaN is a failed
score, not a token the reward does not apply to) and the sample is dropped; +-inf raises, as everywhere.

A completion to which *no* sequence-level function applies (every value None/NaN) has no reward: both trainers
drop it from the loss with a warning and count it (GRPO's ``nan_reward_action="zero"`` keeps TRL's advantage 0
instead). An infinite reward is never meaningful and would turn every advantage of the batch into NaN or +-3e38, so
it stops the run at its source rather than several steps later inside `generate`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

DENSE_ATTR = "dense"

__all__ = [
    "DenseRewards",
    "PendingDenseRewards",
    "RewardContractError",
    "check_finite_rewards",
    "call_on_every_process",
    "collect_dense_rewards",
    "dense_reward",
    "is_dense_reward",
    "has_prefetch",
    "raise_on_every_process",
    "sequence_reward_values",
    "start_dense_rewards",
    "validate_dense_rewards",
    "weighted_reward_sum",
]


class RewardContractError(ValueError):
    """A reward function's output breaks the contract above (wrong count or type, an infinite value)."""


def raise_on_every_process(error: Exception | None, accelerator: Any) -> None:
    """Raise on every process when any process found `error`, so none is left waiting in a collective.

    A reward function runs on each process's own completions, so a broken answer is seen by one process only; if
    that process raised alone, the others would block in the next gather (NCCL) or die of a lost peer (gloo).

    Args:
        error: This process's error, or None.
        accelerator: The trainer's `accelerate.Accelerator` (its ``reduce`` and ``device``); a collective: every
            process must call this.
    """
    flag = torch.tensor(float(error is not None), device=accelerator.device)
    if accelerator.reduce(flag, reduction="sum").item() > 0:
        if error is not None:
            raise error
        raise RewardContractError(
            "A reward function broke the reward contract on another process (an infinite value, or a wrong count or "
            "type); that process's error names the function."
        )


def call_on_every_process(accelerator: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, where a `RewardContractError` raised on any one process is raised on every process
    (`raise_on_every_process`); a collective: every process must call this."""
    error = result = None
    try:
        result = fn(*args)
    except RewardContractError as err:
        error = err
    raise_on_every_process(error, accelerator)
    return result


def dense_reward(func: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `func` as a dense (per-token) reward function; returns `func` itself."""
    setattr(func, DENSE_ATTR, True)
    return func


def is_dense_reward(func: Any) -> bool:
    """Whether `func` was declared a dense reward function (with `dense_reward` or ``func.dense = True``)."""
    return bool(getattr(func, DENSE_ATTR, False))


def has_prefetch(func: Any) -> bool:
    """Whether dense reward function `func` can start its work early (a callable ``prefetch`` attribute)."""
    return callable(getattr(func, "prefetch", None))


def _as_float(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise RewardContractError(
            f"{name} returned {value!r} for {where}; return a float (or None where it does not apply)."
        )
    return float(value)


def sequence_reward_values(values: Sequence[Any], num_completions: int, name: str) -> torch.Tensor:
    """One sequence-level reward function's output as float64 [N], None -> NaN ("does not apply").

    Raises:
        ValueError: naming `name` when the count is wrong, a value is not a number, or a value is +-inf.
    """
    if len(values) != num_completions:
        raise RewardContractError(
            f"Reward function '{name}' returned {len(values)} values for {num_completions} completions; return "
            "exactly one value (or None) per completion."
        )
    where = f"Reward function '{name}'"
    out = [math.nan if v is None else _as_float(v, where, f"completion {i}") for i, v in enumerate(values)]
    tensor = torch.tensor(out, dtype=torch.float64)
    check_finite_rewards(tensor.unsqueeze(1), [name])
    return tensor


def check_finite_rewards(rewards_per_func: torch.Tensor, names: Sequence[str]) -> None:
    """Raise ValueError naming the function and completion of the first +-inf entry of `rewards_per_func` [N, K]."""
    infinite = torch.isinf(rewards_per_func)
    if bool(infinite.any()):
        row, col = (int(i) for i in infinite.nonzero()[0])
        raise RewardContractError(
            f"Reward function '{names[col]}' returned {rewards_per_func[row, col].item()} for completion {row}: an "
            "infinite reward turns every advantage of the batch into NaN. Return a finite value, or None/NaN where "
            "the function does not apply."
        )


def weighted_reward_sum(rewards_per_func: torch.Tensor, weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Weighted sum over the reward functions, TRL's aggregation: NaN entries (does not apply) are skipped; a row
    that no function applies to stays NaN.

    $r_i = \\sum_{k:\\ r_{ik} \\ne \\mathrm{NaN}} w_k r_{ik}$, NaN if every $r_{ik}$ is NaN.

    Args:
        rewards_per_func: [N, K] rewards, NaN where a function does not apply.
        weights: [K] weights.
    """
    weights = torch.as_tensor(weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    return torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.full_like(rewards, math.nan), rewards)


def validate_dense_rewards(
    rewards: Sequence[Sequence[float] | None], completion_lengths: Sequence[int], name: str = "reward function"
) -> list[list[float]]:
    """Check a dense reward function's output and return it as lists of floats (None rows -> zeros; NaN kept).

    Raises:
        ValueError: naming `name` when the number of entries, a per-token length or a value's type does not match,
            or a token reward is +-inf, so the bug is found at its source rather than deep inside the loss.
    """
    if isinstance(rewards, (str, bytes)) or not isinstance(rewards, Sequence):
        raise RewardContractError(
            f"Dense {name} returned {type(rewards).__name__}; return one list (or None) per completion."
        )
    if len(rewards) != len(completion_lengths):
        raise RewardContractError(
            f"Dense {name} returned {len(rewards)} entries for {len(completion_lengths)} completions; "
            "return exactly one list (or None) per completion."
        )
    out = []
    for i, (row, length) in enumerate(zip(rewards, completion_lengths)):
        if row is None:
            out.append([0.0] * length)
            continue
        if torch.is_tensor(row):
            row = row.reshape(-1).tolist()
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise RewardContractError(
                f"Dense {name} returned {type(row).__name__} for completion {i}; return a list of per-token floats."
            )
        row = [_as_float(v, f"Dense {name}", f"completion {i}") for v in row]
        if len(row) != length:
            raise RewardContractError(
                f"Dense {name} returned {len(row)} token rewards for completion {i}, which has {length} tokens; "
                "align the per-token rewards to `completion_ids[i]`."
            )
        bad = next((t for t, v in enumerate(row) if math.isinf(v)), None)
        if bad is not None:
            raise RewardContractError(
                f"Dense {name} returned {row[bad]} at token {bad} of completion {i}; return finite token rewards "
                "(NaN where a token's reward does not apply)."
            )
        out.append(row)
    return out


@dataclass
class DenseRewards:
    """The weighted sum of a batch's dense rewards and what the contract did to get it.

    Attributes:
        rows: Per completion, one float per completion token: the weighted sum over the dense functions (NaN -> 0).
        metrics: ``rewards/<name>/token_mean`` (the function's own unweighted mean per completion token),
            ``rewards/<name>/sum_mean`` (its mean per-completion sum) and ``rewards/<name>/nan_tokens``.
    """

    rows: list[list[float]]
    metrics: dict[str, float] = field(default_factory=dict)

    def as_tensor(self, width: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """[B, width] float32, right-padded with zeros (width: the longest completion)."""
        width = max((len(r) for r in self.rows), default=0) if width is None else width
        out = torch.zeros(len(self.rows), width)
        for i, row in enumerate(self.rows):
            n = min(len(row), width)
            out[i, :n] = torch.tensor(row[:n], dtype=torch.float32)
        return out.to(device) if device is not None else out


def collect_dense_rewards(
    funcs: Sequence[Callable[..., Any]],
    names: Sequence[str],
    weights: Sequence[float],
    completion_lengths: Sequence[int],
    call: Callable[..., Any],
    handles: Sequence[Any] | None = None,
) -> DenseRewards:
    """Call every dense reward function through `call(func)` and sum their rows under the contract above.

    The trainer owns `call` (which keyword arguments a function gets, and how an async one is awaited); this
    function owns what the answers mean, so the two trainers cannot drift apart.

    Args:
        funcs, names, weights: The dense reward functions, their names and weights (same order).
        completion_lengths: Tokens per completion.
        call: Invokes one function on the batch and returns its raw output; ``call(func, prefetched=h)`` adds the
            keyword argument.
        handles: Per function, what its `prefetch` returned (None: not prefetched, called without ``prefetched``).
    """
    total = [[0.0] * n for n in completion_lengths]
    metrics: dict[str, float] = {}
    num_tokens = max(sum(completion_lengths), 1)
    handles = list(handles) if handles is not None else [None] * len(funcs)
    for func, name, weight, handle in zip(funcs, names, weights, handles, strict=True):
        out = call(func) if handle is None else call(func, prefetched=handle)
        rows = validate_dense_rewards(out, completion_lengths, name=f"reward function '{name}'")
        nan_tokens = 0
        sums = []
        for acc, row in zip(total, rows):
            row_sum = 0.0
            for t, value in enumerate(row):
                if value != value:  # NaN: does not apply at this token
                    nan_tokens += 1
                    continue
                acc[t] += float(weight) * value
                row_sum += value
            sums.append(row_sum)
        if nan_tokens:
            logger.warning(f"Dense reward function '{name}' returned {nan_tokens} NaN token reward(s); used 0.")
        metrics[f"rewards/{name}/nan_tokens"] = float(nan_tokens)
        metrics[f"rewards/{name}/token_mean"] = sum(sums) / num_tokens
        metrics[f"rewards/{name}/sum_mean"] = sum(sums) / max(len(sums), 1)
    return DenseRewards(total, metrics)


@dataclass
class PendingDenseRewards:
    """A batch's dense rewards whose functions were prefetched but not yet called; `collect` calls them.

    Built by `start_dense_rewards`; the trainer keeps it across its forward passes and collects when the token
    rewards are needed. `collect` is idempotent (the functions are called once).
    """

    funcs: Sequence[Callable[..., Any]]
    names: Sequence[str]
    weights: Sequence[float]
    completion_lengths: Sequence[int]
    call: Callable[..., Any]
    handles: Sequence[Any] | None = None  # per function, what its prefetch returned
    _result: DenseRewards | None = field(default=None, repr=False)

    def collect(self) -> DenseRewards:
        """Call every dense function (collecting what its `prefetch` started) and sum the rows under the contract."""
        if self._result is None:
            self._result = collect_dense_rewards(
                self.funcs, self.names, self.weights, self.completion_lengths, self.call, self.handles
            )
        return self._result


def start_dense_rewards(
    funcs: Sequence[Callable[..., Any]],
    names: Sequence[str],
    weights: Sequence[float],
    completion_lengths: Sequence[int],
    call: Callable[..., Any],
    prefetch: Callable[[Callable[..., Any]], Any],
) -> PendingDenseRewards:
    """Prefetch every dense function that has a `prefetch` (through the trainer's `prefetch(func)`, which passes the
    same arguments as `call(func)` will) and return the pending rewards, to `collect` later.

    Args:
        funcs, names, weights, completion_lengths, call: As for `collect_dense_rewards`.
        prefetch: Invokes ``func.prefetch`` on the batch and returns its handle, handed back to the function's call
            as ``prefetched=``.
    """
    handles = [prefetch(func) if has_prefetch(func) else None for func in funcs]
    return PendingDenseRewards(list(funcs), list(names), list(weights), list(completion_lengths), call, handles)
