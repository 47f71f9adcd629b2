"""PPO's reward functions for `train()` and `evaluate()`, called with TRL's signature under the reward contract of
`trl_stable.rewards.dense`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification
from trl.trainer.utils import get_callable_name

from trl_stable.core.masked_stats import Reduce
from trl_stable.core.normalization import gdpo_scores
from trl_stable.integration.hf_names import model_name_of
from trl_stable.integration.reward_calls import call_reward_func, reward_event_loop
from trl_stable.monitoring.reduction import Stat, dense_reward_stats, logged_metric_stat
from trl_stable.rewards.dense import (
    DEFAULT_MAX_ABS_REWARD,
    DenseRewards,
    PendingDenseRewards,
    RewardContractError,
    bound_rewards,
    failure_cause,
    is_dense_reward,
    sequence_reward_values,
    start_dense_rewards,
    weighted_reward_sum,
)
from trl_stable.rewards.failure_guard import RewardComponentFailure
from trl_stable.rewards.reward_models import prepare_reward_model, reward_model_scores

logger = logging.getLogger(__name__)


@dataclass
class PendingRewards:
    """A batch's rewards, the sequence-level part computed and the dense functions prefetched, called by `result`
    (`train()` defers `token_rewards` to `step`, so a critic's latency hides behind the forwards): `scores` [N]
    float64 (the weighted sequence-level sum, NaN where none applies), `dense` (once collected), their `metrics` (this
    process's values) and `stats` (`Stat` shares)."""

    scores: torch.Tensor | None
    pending_dense: PendingDenseRewards | None
    metrics: dict[str, float]
    stats: dict[str, Stat] = field(default_factory=dict)
    rewards_per_func: torch.Tensor | None = None  # [N, K] sequence-level rewards, NaN where one does not apply
    weights: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # of the K sequence-level functions
    failures: dict[str, str] = field(default_factory=dict)  # the functions whose call raised, and why
    dense: DenseRewards | None = field(default=None, init=False)

    def normalize_then_sum(self, reduce_sum: Reduce | None = None) -> None:
        """Replace `scores` by GDPO's (`trl_stable.core.gdpo_scores`), a collective with `reduce_sum`; the dense
        functions, whose requests are already out, keep the raw weighted sum as their ``env_rewards``."""
        if self.rewards_per_func is not None:
            self.scores = gdpo_scores(self.rewards_per_func, self.weights, reduce_sum=reduce_sum)

    @property
    def per_func(self) -> dict[str, torch.Tensor]:
        """Each sequence-level function's rewards [N], by name (none without sequence-level functions)."""
        return {name: self.rewards_per_func[:, k] for k, name in enumerate(self.names)}

    def result(self) -> PendingRewards:
        """Collect the dense rewards (once); returns itself."""
        if self.dense is None and self.pending_dense is not None:
            self.dense = self.pending_dense.collect()
            # what the dense functions logged with `log_metric` (e.g. the critic's critic/*), then their metrics
            self.stats.update(
                {name: logged_metric_stat(name, [v]) for name, v in self.metrics.items() if name not in self.stats}
            )
            self.stats.update(dense_reward_stats(self.dense.metrics, self.pending_dense.completion_lengths))
            self.metrics.update(self.dense.metrics)
        return self

    def token_rewards(self) -> list[list[float]] | None:
        """The per-token dense rows for `step` (None without dense functions); collects them."""
        dense = self.result().dense
        return dense.rows if dense is not None else None


def _as_list(value: Any, default: list[Any]) -> list[Any]:
    """`default` for None, a list or tuple as a list, anything else as a one-entry list."""
    if value is None:
        return default
    return list(value) if isinstance(value, (list, tuple)) else [value]


class RewardFunctions:
    """Reward functions (`PPOTrainer`'s `reward_funcs`) with their weights, tokenizers (None entries: loaded by the
    model's name, as TRL's GRPO does) and the largest reward magnitude taken (`max_abs_reward`)."""

    def __init__(
        self,
        reward_funcs: Any | Sequence[Any] | None,
        weights: Sequence[float] | None,
        processing_classes: Any | Sequence[Any] | None,
        policy_tokenizer: Any,
        limit: float | None = DEFAULT_MAX_ABS_REWARD,
    ):
        funcs = [
            AutoModelForSequenceClassification.from_pretrained(f, num_labels=1) if isinstance(f, str) else f
            for f in _as_list(reward_funcs, [])
        ]
        for func in funcs:
            if not (isinstance(func, nn.Module) or callable(func)):
                raise ValueError(f"A reward function must be a callable, an nn.Module or a model name; got {func!r}.")
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions: one each.")
        self.funcs = funcs
        self.names = [
            model_name_of(f) or type(f).__name__ if isinstance(f, nn.Module) else get_callable_name(f) for f in funcs
        ]
        self.weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        processing_classes = _as_list(processing_classes, [None] * len(funcs))
        if len(processing_classes) != len(funcs):
            raise ValueError("reward_processing_classes must have one entry per reward function.")
        self.processing_classes = [
            prepare_reward_model(func, proc, policy_tokenizer) if isinstance(func, nn.Module) else proc
            for func, proc in zip(funcs, processing_classes)
        ]
        self.tokenizer = policy_tokenizer
        self.limit = limit  # the contract's bound on reward magnitudes (`max_abs_reward`)
        self.loop = reward_event_loop(funcs)  # async reward functions run here, as on TRL's reward loop in GRPO

    def __len__(self) -> int:
        return len(self.funcs)

    @property
    def dense_names(self) -> list[str]:
        return [name for name, func in zip(self.names, self.funcs) if is_dense_reward(func)]

    def to(self, device: torch.device) -> RewardFunctions:
        for func in self.funcs:
            if isinstance(func, nn.Module):
                func.to(device).eval().requires_grad_(False)
        return self

    def __call__(
        self, rows: list[dict], prompts: list[Any], responses: list[torch.Tensor], trainer_state: Any
    ) -> PendingRewards:
        """Score one batch: sequence-level functions first, then the dense ones with ``env_rewards``."""
        return self.start(rows, prompts, responses, trainer_state).result()

    def start(
        self, rows: list[dict], prompts: list[Any], responses: list[torch.Tensor], trainer_state: Any
    ) -> PendingRewards:
        """Score the sequence-level functions and prefetch the dense ones (`trl_stable.rewards.dense`'s prefetch
        protocol); the dense functions are called by `PendingRewards.result`."""
        completion_ids = [r.tolist() for r in responses]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "input_ids")}
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        metrics: dict[str, float] = {}
        stats: dict[str, Stat] = {}
        n = len(responses)

        sequence = [i for i, f in enumerate(self.funcs) if not is_dense_reward(f)]
        names, weights = [self.names[i] for i in sequence], [self.weights[i] for i in sequence]
        scores = rewards_per_func = None
        failures: dict[str, str] = {}  # the functions whose call raised here, and why: their completions unscored
        if sequence:
            columns_out = []
            for i in sequence:
                func, name = self.funcs[i], self.names[i]
                try:
                    if isinstance(func, nn.Module):
                        values = reward_model_scores(func, self.processing_classes[i], prompts, completions)
                        values = values.double().cpu()
                    else:
                        out = call_reward_func(func, self.loop, trainer_state=trainer_state, **kwargs)
                        values = sequence_reward_values(out, n, name)
                except (RewardContractError, RewardComponentFailure):
                    raise
                except Exception as err:  # noqa: BLE001 - a failed call: counted by the trainer's guard
                    failures[name] = failure_cause(err)
                    logger.warning(f"Reward function '{name}' {failures[name]}; its completions are unscored.")
                    values = torch.full((n,), float("nan"), dtype=torch.float64)
                columns_out.append(values)
            # the contract's bound on every function's values (reward models' logits included), before the sum
            rewards_per_func, out_of_range = bound_rewards(torch.stack(columns_out, dim=1), names, self.limit)
            for name, values, count in zip(names, rewards_per_func.unbind(1), out_of_range):
                finite = values[~torch.isnan(values)]
                metrics[f"rewards/{name}/mean"] = finite.mean().item() if len(finite) else float("nan")
                # over the samples it scored on every process, when `PPOTrainer.step` logs it
                stats[f"rewards/{name}/mean"] = Stat.mean(values, ~torch.isnan(values), empty=float("nan"))
                stats[f"rewards/{name}/out_of_range"] = Stat.total(count)
            scores = weighted_reward_sum(rewards_per_func, weights)

        dense_idx = [i for i, f in enumerate(self.funcs) if is_dense_reward(f)]
        dense = None
        if dense_idx:
            env = scores.tolist() if scores is not None else [0.0] * n
            # log_metric: TRL's hook (e.g. the critic's critic/* per-step metrics)
            dense_kwargs = dict(env_rewards=env, trainer_state=trainer_state, log_metric=metrics.__setitem__, **kwargs)
            picked = [[values[i] for i in dense_idx] for values in (self.funcs, self.names, self.weights)]
            dense = start_dense_rewards(
                *picked,
                [len(r) for r in responses],
                call=lambda func, **extra: call_reward_func(func, self.loop, **dense_kwargs, **extra),
                # the same arguments as the later call: the prompt a critic sends must be the one it answers
                prefetch=lambda func: call_reward_func(func.prefetch, self.loop, **dense_kwargs),
                limit=self.limit,
            )
        return PendingRewards(scores, dense, metrics, stats, rewards_per_func, weights, names, failures)
