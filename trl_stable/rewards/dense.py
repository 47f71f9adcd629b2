"""The reward-function contract shared by the GRPO and PPO trainers: sequence rewards, dense rewards (functions
marked with `dense_reward`, one list per completion, an optional ``prefetch``), NaN/None/inf and `max_abs_reward`:
docs/critic_rewards.md, "Reward-function contract (GRPO and PPO)".
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trl_stable.rewards.failure_guard import FailureGuard, RewardComponentFailure

logger = logging.getLogger(__name__)

DENSE_ATTR = "dense"


class RewardContractError(ValueError):
    """A reward function's output breaks the contract (a wrong count, or a value that is not a number)."""


class RewardTypeError(RewardContractError, TypeError):
    """A reward function returned something that is not a number (or a list of them) where the contract wants one."""


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


# float32's largest finite value: the trainers compute rewards in float32, where anything larger is infinite.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# The largest reward magnitude the trainers take by default: far above any score of a reward model, a classifier or a
# rule, and far enough below float32's 3.4e38 that the sums, squares (stds, value losses) and gradients of rewards
# this large stay finite.
DEFAULT_MAX_ABS_REWARD = 1e6


def reward_number(value: Any, subject: str, where: str) -> float:
    """`value` as a float under the contract's number rule; None -> NaN, beyond float32's range -> +-inf. A value
    that is not a real number raises `RewardTypeError` naming `subject` ("Reward function 'f'") and `where`."""
    if value is None:
        return math.nan
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0 or isinstance(value, np.generic):
        value = value.item()  # NumPy scalars, np.bool_ included (not a numbers.Real); a complex one is a complex
    if isinstance(value, complex):
        raise RewardTypeError(f"{subject} returned the complex number {value!r} for {where}; return a real number.")
    if not isinstance(value, numbers.Real):
        raise RewardTypeError(
            f"{subject} returned {_describe(value)} for {where}, which is not a number; return a float (or None where "
            "it does not apply)."
        )
    return _float32_range(float(value))


def _describe(value: Any) -> str:
    """A returned value as an error message names it."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"a {type(value).__name__} of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} ({value!r:.60})"
    return f"{value!r:.60} ({type(value).__name__})"


def _float32_range(number: float) -> float:
    return math.copysign(math.inf, number) if abs(number) > _FLOAT32_MAX else number


def _as_list(values: Any, subject: str, expected: str) -> list[Any]:
    """A reward output's entries as a list: a list, tuple, generator or 1-D tensor / array; anything else raises."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        bad = values.ndim != 1
    else:
        bad = isinstance(values, (str, bytes, Mapping, Set)) or not isinstance(values, Iterable)
    if bad:
        raise RewardTypeError(f"{subject} returned {_describe(values)}; return {expected}.")
    return list(values)


def reward_numbers(values: Any, subject: str, where: Callable[[int], str], expected: str) -> list[float]:
    """The entries of `values` (a list, tuple, generator or 1-D tensor / array) as floats under `reward_number`;
    `where(i)` names entry i, `expected` what `subject` should return when `values` is no such container."""
    real_tensor = isinstance(values, torch.Tensor) and values.ndim == 1 and not values.dtype.is_complex
    if real_tensor or isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "biuf":
        return [_float32_range(float(v)) for v in values.tolist()]  # one device sync, not one per entry
    return [reward_number(v, subject, where(i)) for i, v in enumerate(_as_list(values, subject, expected))]


def _warn_out_of_range(subject: str, where: list[str], values: list[float], limit: float | None) -> None:
    bound = "infinite" if limit is None else f"beyond max_abs_reward={limit:g} (or infinite)"
    logger.warning(
        f"{subject} returned {values[0]:g} for {where[0]}"
        + (f" (and {len(where) - 1} more such value(s))" if len(where) > 1 else "")
        + f": a reward {bound} is treated as NaN (does not apply), as it would overflow the trainer's float32 "
        "arithmetic (advantages, value loss, gradients). Return a smaller value (rescale the reward), None/NaN where "
        "the function does not apply, or raise max_abs_reward."
    )


def sequence_reward_values(values: Any, num_completions: int, name: str, subject: str | None = None) -> torch.Tensor:
    """One sequence-level reward function's output as float64 [N] under `reward_number` (the bound is applied
    later, to every function's values at once: `bound_rewards`). A value that is not a number raises
    `RewardTypeError`, a count other than `num_completions` `RewardContractError`, both naming the function."""
    subject = subject or f"Reward function '{name}'"
    out = reward_numbers(
        values, subject, lambda i: f"completion {i}", "a list with one number (or None) per completion"
    )
    if len(out) != num_completions:
        raise RewardContractError(
            f"{subject} returned {len(out)} values for {num_completions} completions; return exactly one value "
            "(or None) per completion."
        )
    return torch.tensor(out, dtype=torch.float64)


def bound_rewards(
    rewards_per_func: torch.Tensor, names: Sequence[str], limit: float | None = DEFAULT_MAX_ABS_REWARD
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's bound on sequence rewards [N, K] (reward models' logits included) in both trainers: entries
    beyond +-`limit` (None: only +-inf) become NaN, with a warning per function naming the completions; also returns
    the count per function [K] (``rewards/<name>/out_of_range``)."""
    bad = torch.isinf(rewards_per_func)
    if limit is not None:
        bad |= rewards_per_func.abs() > limit
    counts = bad.sum(dim=0)
    if not bool(bad.any()):
        return rewards_per_func, counts
    for col in bad.any(dim=0).nonzero().flatten().tolist():
        rows = bad[:, col].nonzero().flatten().tolist()
        values = rewards_per_func[rows, col].tolist()
        _warn_out_of_range(f"Reward function '{names[col]}'", [f"completion {r}" for r in rows], values, limit)
    return rewards_per_func.masked_fill(bad, math.nan), counts


def failure_cause(err: BaseException) -> str:
    """How a reward component's failure is named in warnings and errors: the exception's type and message."""
    return f"raised {type(err).__name__}: {str(err)[:200]}"


def checked_sequence_reward(
    func: Callable[..., Any],
    name: str,
    errors: list[Exception],
    is_async: bool,
    failures: dict[str, str] | None = None,
) -> Callable[..., Any]:
    """`func` (called with TRL's keywords, async when `is_async`) with its output put through `sequence_reward_values`.

    A contract error (or `RewardComponentFailure`) is appended to `errors` and the output is None for every completion,
    so the caller still reaches its gather; it raises ``errors[0]`` after it on every process. Any other
    exception is a failed call with `failures` (its completions unscored, ``failures[name]`` the cause, counted by the
    caller's `FailureGuard`), and propagates with ``failures=None``."""

    def check(out: Any, prompts: Sequence[Any]) -> list[float | None]:
        try:
            return sequence_reward_values(out, len(prompts), name).tolist()
        except RewardContractError as err:
            errors.append(err)
            return [None] * len(prompts)

    def failed(err: Exception, prompts: Sequence[Any]) -> list[float | None]:
        if isinstance(err, (RewardContractError, RewardComponentFailure)):
            errors.append(err)
        elif failures is None:
            raise err
        else:
            failures.setdefault(name, failure_cause(err))
            logger.warning(f"Reward function '{name}' {failures[name]}; its completions are unscored.", exc_info=err)
        return [None] * len(prompts)

    async def checked_async(**kwargs: Any) -> list[float | None]:
        try:
            out = await func(**kwargs)
        except Exception as err:  # noqa: BLE001 - a failed call: counted by the caller's guard
            return failed(err, kwargs["prompts"])
        return check(out, kwargs["prompts"])

    def checked(**kwargs: Any) -> list[float | None]:
        try:
            out = func(**kwargs)
        except Exception as err:  # noqa: BLE001 - a failed call: counted by the caller's guard
            return failed(err, kwargs["prompts"])
        return check(out, kwargs["prompts"])

    return checked_async if is_async else checked


def record_reward_failures(
    guards: Mapping[str, FailureGuard],
    failed: Mapping[str, bool],
    causes: Mapping[str, str],
    default_cause: str = "returned None/NaN or an out-of-range value for every completion",
) -> None:
    """Record one step's outcome in each guard: `failed[name]` (decided on every process's completions, so every
    process stops at the same step), with this process's cause when it has one; raises `RewardComponentFailure` at a
    guard's limit."""
    for name, guard in guards.items():
        guard.record(bool(failed.get(name, False)), causes.get(name, default_cause))


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


def _dense_row(row: Any, length: int, subject: str, where: str, limit: float | None) -> list[float]:
    """One completion's per-token rewards as floats; None, NaN and out-of-range tokens -> NaN (warned)."""
    out = reward_numbers(row, subject, lambda t: f"token {t} of {where}", f"a list of per-token numbers for {where}")
    if len(out) != length:
        raise RewardContractError(
            f"{subject} returned {len(out)} token rewards for {where}, which has {length} tokens; align the "
            "per-token rewards to the completion's token ids."
        )
    bad = [t for t, v in enumerate(out) if math.isinf(v) or (limit is not None and abs(v) > limit)]
    if bad:
        _warn_out_of_range(subject, [f"token {t} of {where}" for t in bad], [out[t] for t in bad], limit)
        for t in bad:
            out[t] = math.nan
    return out


def validate_dense_rewards(
    rewards: Any,
    completion_lengths: Sequence[int],
    name: str = "reward function",
    limit: float | None = DEFAULT_MAX_ABS_REWARD,
) -> list[list[float]]:
    """Check a dense reward function's output and return it as lists of floats: None rows -> zeros; None, NaN and
    out-of-range tokens (beyond +-`limit`, +-inf) -> NaN, which `collect_dense_rewards` counts and uses as 0. Raises
    `RewardTypeError` / `RewardContractError` naming `name` and the completion."""
    subject = f"Dense {name}"
    rows = _as_list(rewards, subject, "one list (or None) per completion")
    if len(rows) != len(completion_lengths):
        raise RewardContractError(
            f"{subject} returned {len(rows)} entries for {len(completion_lengths)} completions; "
            "return exactly one list (or None) per completion."
        )
    return [
        [0.0] * length if row is None else _dense_row(row, length, subject, f"completion {i}", limit)
        for i, (row, length) in enumerate(zip(rows, completion_lengths))
    ]


@dataclass
class DenseRewards:
    """The weighted sum of a batch's dense rewards and what the contract did to get it.

    Attributes:
        rows: Per completion, one float per completion token: the weighted sum over the dense functions (NaN -> 0).
        metrics: ``rewards/<name>/token_mean`` (the function's own unweighted mean per completion token),
            ``rewards/<name>/sum_mean`` (its mean per-completion sum) and ``rewards/<name>/nan_tokens``.
        failures: Per function whose call raised on this process, the cause (its rows are None: no dense reward).
    """

    rows: list[list[float]]
    metrics: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    def as_tensor(self, width: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """[B, width] float32, right-padded with zeros (width: the longest completion)."""
        width = max((len(r) for r in self.rows), default=0) if width is None else width
        out = torch.zeros(len(self.rows), width)
        for i, row in enumerate(self.rows):
            out[i, : min(len(row), width)] = torch.tensor(row[:width], dtype=torch.float32)
        return out.to(device) if device is not None else out


def collect_dense_rewards(
    funcs: Sequence[Callable[..., Any]],
    names: Sequence[str],
    weights: Sequence[float],
    completion_lengths: Sequence[int],
    call: Callable[..., Any],
    handles: Sequence[Any] | None = None,
    limit: float | None = DEFAULT_MAX_ABS_REWARD,
) -> DenseRewards:
    """Call every dense reward function through the trainer's `call(func)` (``call(func, prefetched=h)`` with its
    `prefetch` handle in `handles`) and sum their weighted rows under the contract; a function that raises gives no
    dense reward this step (its cause in `DenseRewards.failures`). `limit` is `max_abs_reward`."""
    total = [[0.0] * n for n in completion_lengths]
    metrics: dict[str, float] = {}
    failures: dict[str, str] = {}
    num_tokens = max(sum(completion_lengths), 1)
    handles = list(handles) if handles is not None else [None] * len(funcs)
    for func, name, weight, handle in zip(funcs, names, weights, handles, strict=True):
        try:
            out = call(func) if handle is None else call(func, prefetched=handle)
        except (RewardContractError, RewardComponentFailure):
            raise
        except Exception as err:  # noqa: BLE001 - a failed call: no dense reward this step, counted by the guard
            failures[name] = failure_cause(err)
            logger.warning(
                f"Dense reward function '{name}' {failures[name]}: no dense reward this step.", exc_info=err
            )
            out = None
        rows = validate_dense_rewards(out, completion_lengths, name=f"reward function '{name}'", limit=limit)
        nan_tokens = sum(value != value for row in rows for value in row)  # NaN: does not apply at this token
        sums = [sum(value for value in row if value == value) for row in rows]
        total = [[a + float(weight) * v if v == v else a for a, v in zip(acc, row)] for acc, row in zip(total, rows)]
        if nan_tokens:
            logger.warning(
                f"Dense reward function '{name}' returned {nan_tokens} NaN/None/infinite token reward(s); used 0."
            )
        metrics[f"rewards/{name}/nan_tokens"] = float(nan_tokens)
        metrics[f"rewards/{name}/token_mean"] = sum(sums) / num_tokens
        metrics[f"rewards/{name}/sum_mean"] = sum(sums) / max(len(sums), 1)
    return DenseRewards(total, metrics, failures)


@dataclass
class PendingDenseRewards:
    """A batch's prefetched dense rewards, not yet collected (`start_dense_rewards`); `collect` calls the functions
    once."""

    funcs: Sequence[Callable[..., Any]]
    names: Sequence[str]
    weights: Sequence[float]
    completion_lengths: Sequence[int]
    call: Callable[..., Any]
    handles: Sequence[Any] | None = None  # per function, what its prefetch returned
    limit: float | None = DEFAULT_MAX_ABS_REWARD
    _result: DenseRewards | None = field(default=None, repr=False)

    def collect(self) -> DenseRewards:
        """Call every dense function (collecting what its `prefetch` started) and sum the rows under the contract."""
        if self._result is None:
            self._result = collect_dense_rewards(
                self.funcs, self.names, self.weights, self.completion_lengths, self.call, self.handles, self.limit
            )
        return self._result


def start_dense_rewards(
    funcs: Sequence[Callable[..., Any]],
    names: Sequence[str],
    weights: Sequence[float],
    completion_lengths: Sequence[int],
    call: Callable[..., Any],
    prefetch: Callable[[Callable[..., Any]], Any],
    limit: float | None = DEFAULT_MAX_ABS_REWARD,
) -> PendingDenseRewards:
    """Prefetch every dense function that has a `prefetch` through the trainer's `prefetch(func)` (its handle is
    later passed as ``prefetched=``); the other arguments are those of `collect_dense_rewards`."""
    handles = [prefetch(func) if has_prefetch(func) else None for func in funcs]
    return PendingDenseRewards(list(funcs), list(names), list(weights), list(completion_lengths), call, handles, limit)
