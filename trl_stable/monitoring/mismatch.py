"""Training-inference mismatch statistics: the sampler's log-probs against the trainer's, on the same tokens.

Pure torch, for GRPO, PPO and custom loops. A mean |diff| hides the spread, so the ratio's extremes, the share of
tokens outside a band and the sequence perplexity ratio are reported next to it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from trl_stable.monitoring.metric_names import (
    BEHAVIOUR_WEIGHT_MAX,
    BEHAVIOUR_WEIGHT_MEAN,
    BEHAVIOUR_WEIGHT_MIN,
    CLAMPED_TOKEN_FRAC,
    MASKED_SEQ_FRAC,
    MASKED_TOKEN_FRAC,
    token_filter_metric,
)


@dataclass(frozen=True)
class MismatchStats:
    """Summary of the sampler/trainer disagreement over the masked tokens of a batch.

    All values are Python floats so they can go straight into a trainer's metrics. Token statistics are over the
    tokens where both log-probs are finite; `nonfinite_frac` is the share of masked tokens left out for that reason.
    `ppl_ratio_*` are over sequences with at least one such token. With no usable token every statistic is 0.0
    (ratios 1.0), so a log line never carries NaN.
    """

    abs_diff_mean: float
    abs_diff_max: float
    ratio_min: float
    ratio_mean: float
    ratio_max: float
    ratio_outside_band: float
    ppl_ratio_mean: float
    ppl_ratio_min: float
    ppl_ratio_max: float
    nonfinite_frac: float
    num_tokens: int

    def as_metrics(self, prefix: str = "mismatch/") -> dict[str, float]:
        """Flatten into TRL-style metric names, e.g. `mismatch/logp_abs_diff/mean`."""

        def metric(n: str) -> str:  # abs_diff_mean -> logp_abs_diff/mean, ratio_outside_band -> ratio/outside_band
            return re.sub(r"^abs_diff", "logp_abs_diff", re.sub(r"_(mean|max|min|outside_band)$", r"/\1", n))

        return {prefix + metric(f.name): getattr(self, f.name) for f in fields(self) if f.name != "num_tokens"}

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def mismatch_stats(
    sampler_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    band: tuple[float, float] = (0.9, 1.1),
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> MismatchStats:
    r"""Compare the sampler's per-token log-probs with the trainer's on the same tokens.

    With $d_t = \log\pi_{\text{train}}(y_t) - \log\pi_{\text{sampler}}(y_t)$ over the masked tokens:

    - `abs_diff_mean` $= \text{mean}_t |d_t|$, `abs_diff_max` $= \max_t |d_t|$ (the `mismatch` alarm: above 0.01);
    - the token ratio $w_t = e^{d_t} = \pi_{\text{train}} / \pi_{\text{sampler}}$ (the behaviour weight of the
      decoupled loss, AReaL; IcePop, arXiv 2510.18855, masks on it): min, mean, max and the share outside `band`;
    - the sequence perplexity ratio $\text{PPL}_{\text{train}} / \text{PPL}_{\text{sampler}}
      = \exp(-\text{mean}_t d_t)$ per sequence: mean, min and max over sequences.

    Args:
        sampler_logps (`torch.Tensor` of shape `(B, T)`):
            Log-probs of the sampled tokens under the sampler (vLLM, HF `generate`), i.e. the behaviour policy.
        trainer_logps (`torch.Tensor` of shape `(B, T)`):
            Log-probs of the same tokens recomputed by the training engine at the rollout weights.
        mask (`torch.Tensor` of shape `(B, T)`, *optional*):
            1 for completion tokens to compare; all ones when `None`.
        band (`tuple[float, float]`, defaults to `(0.9, 1.1)`):
            Healthy interval for the token ratio; `ratio_outside_band` is the share of tokens outside it.
        gather (`Callable`, *optional*):
            Multi-process runs: maps this process's statistics row `(1, K)` to all processes' rows `(P, K)`, e.g.
            `accelerator.gather`; the result then covers every process's tokens (same on each process).

    Returns:
        [`MismatchStats`]
    """
    if sampler_logps.shape != trainer_logps.shape:
        raise ValueError(
            f"sampler_logps {tuple(sampler_logps.shape)} and trainer_logps {tuple(trainer_logps.shape)} must have "
            "the same shape: pass the log-probs of the same completion tokens from both engines."
        )
    if sampler_logps.dim() != 2:
        raise ValueError(f"log-probs must be (batch, tokens), got shape {tuple(sampler_logps.shape)}.")
    low, high = band
    if not 0 < low < high:
        raise ValueError(f"band must satisfy 0 < low < high, got {band}.")
    if mask is None:
        mask = torch.ones_like(sampler_logps, dtype=torch.bool)
    elif mask.shape != sampler_logps.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match the log-probs {tuple(sampler_logps.shape)}.")

    # float64: a 0.01 difference is below bf16's resolution, and exp(d) of a wild token must not overflow.
    diff = trainer_logps.detach().double() - sampler_logps.detach().double()
    mask = mask.bool()
    valid = mask & torch.isfinite(diff)
    d = diff[valid]
    abs_d, ratio = d.abs(), torch.exp(d)
    tokens_per_seq = valid.sum(dim=1)
    has_tokens = tokens_per_seq > 0
    seq_sum = torch.where(valid, diff, torch.zeros_like(diff)).sum(dim=1)
    ppl_ratio = torch.exp(-seq_sum[has_tokens] / tokens_per_seq[has_tokens])

    def top(x, empty):
        return x.max() if x.numel() else diff.new_tensor(empty)

    # sufficient statistics, combinable across processes: sums, then maxima (a minimum as the maximum of -x)
    out_of_band = (ratio < low) | (ratio > high)
    sums = [mask.sum(), valid.sum(), abs_d.sum(), ratio.sum(), out_of_band.sum(), has_tokens.sum(), ppl_ratio.sum()]
    tops = [top(abs_d, 0.0), top(ratio, 0.0), top(ppl_ratio, 0.0), top(-ratio, -math.inf), top(-ppl_ratio, -math.inf)]
    row = torch.stack([v.double() for v in sums + tops]).unsqueeze(0)
    rows = (row if gather is None else gather(row).reshape(-1, row.numel())).double()
    masked, tokens, sum_abs, sum_ratio, outside, seqs, sum_ppl = rows[:, : len(sums)].sum(dim=0).tolist()
    max_abs, max_ratio, max_ppl, min_ratio, min_ppl = rows[:, len(sums) :].max(dim=0).values.tolist()
    min_ratio, min_ppl = -min_ratio, -min_ppl
    nonfinite_frac = (masked - tokens) / masked if masked else 0.0
    if tokens == 0:
        return MismatchStats(0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, float(nonfinite_frac), 0)
    token_stats = (sum_abs / tokens, max_abs, min_ratio, sum_ratio / tokens, max_ratio, outside / tokens)
    return MismatchStats(*token_stats, sum_ppl / seqs, min_ppl, max_ppl, float(nonfinite_frac), int(tokens))


def behaviour_filter_metrics(
    mask: torch.Tensor,
    raw_weight: torch.Tensor,
    weight: torch.Tensor,
    keep: torch.Tensor | None,
    filter_name: str | None,
    *,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """The decoupled loss's behaviour weight and what its IcePop / KPop filter did, over every process's tokens
    (`gather`: ``accelerator.gather``; None for one process), under the names of `trl_stable.monitoring.metric_names`:
    the mean / max / min over the tokens of `mask` of `raw_weight` (before the filter), and with a filter the share
    of tokens (and sequences) its keep-mask `keep` masked, or with a clamp (`keep` None) the share of tokens whose
    `weight` it changed."""
    gather = gather or (lambda x: x)
    maskb = mask.bool()
    has_tokens = maskb.any(dim=1)
    masked_out = maskb & ~keep if keep is not None else torch.zeros_like(maskb)
    clamped = maskb & ~torch.isclose(weight, raw_weight) if keep is None else torch.zeros_like(maskb)
    weights = raw_weight.float()
    counts = (maskb, masked_out, has_tokens & masked_out.any(dim=1), has_tokens, clamped)
    sums = torch.stack([torch.where(maskb, weights, 0.0).sum(), *(c.sum().float() for c in counts)])
    extremes = torch.stack(
        [torch.where(maskb, weights, -math.inf).max(), -torch.where(maskb, weights, math.inf).min()]
    )
    totals = gather(sums.unsqueeze(0)).view(-1, sums.numel()).sum(dim=0)
    extremes = gather(extremes.unsqueeze(0)).view(-1, 2).max(dim=0).values
    tokens, seqs = totals[1].clamp(min=1), totals[4].clamp(min=1)
    has_any = bool(totals[1] > 0)
    metrics = {
        BEHAVIOUR_WEIGHT_MEAN: (totals[0] / tokens).item() if has_any else 1.0,
        BEHAVIOUR_WEIGHT_MAX: extremes[0].item() if has_any else 1.0,
        BEHAVIOUR_WEIGHT_MIN: -extremes[1].item() if has_any else 1.0,
    }
    if filter_name is not None and keep is not None:
        metrics[token_filter_metric(filter_name, MASKED_TOKEN_FRAC)] = (totals[2] / tokens).item()
        metrics[token_filter_metric(filter_name, MASKED_SEQ_FRAC)] = (totals[3] / seqs).item()
    elif filter_name is not None:
        metrics[token_filter_metric(filter_name, CLAMPED_TOKEN_FRAC)] = (totals[5] / tokens).item()
    return metrics
