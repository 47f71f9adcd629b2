"""RELC's flags where their meaning differs from the field they set, or where they configure nothing here.

- `RelcPPOConfig`: `trl_stable.PPOConfig` plus RELC's PPOConfig fields that have no meaning here (accepted,
  recorded in run_args.json, named in one warning by `warn_ignored_relc_flags`);
- `relc_length_range`: RELC's length flags exclude their upper bound (its `LengthSampler`), PPOConfig's include it;
- `relc_toxicity_values`: RELC's toxicity `--positive_reward_value` is the reward of every token outside a toxic span.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from trl_stable import PPOConfig

logger = logging.getLogger(__name__)

# RELC flags that configure nothing here, with why: accepted (RELC's commands pass them), recorded in run_args.json,
# and named in one warning by `warn_ignored_relc_flags`.
RELC_IGNORED_FLAGS = {
    "tracker_project_name": (
        "RELC's accelerate tracker project; transformers' report_to integrations name their project themselves "
        "(wandb: set the WANDB_PROJECT environment variable)"
    ),
}


@dataclass
class RelcPPOConfig(PPOConfig):
    """`trl_stable.PPOConfig` plus the RELC PPOConfig fields that have no meaning here (accepted and ignored)."""

    tracker_project_name: str | None = None
    """Ignored (RELC's wandb project name; set WANDB_PROJECT instead). Recorded in run_args.json."""


def relc_length_range(min_length: int | None, max_length: int | None, ppo) -> dict[str, int | None]:
    """`min_new_tokens` / `max_new_tokens` for RELC's length flags: RELC drew each length from its
    `LengthSampler(min, max)`, i.e. `range(min, max)`, which excludes `max`; PPOConfig's range includes both ends.
    A bound not given keeps `ppo`'s value."""
    if min_length is None and max_length is None:
        return {}
    low = ppo.min_new_tokens if min_length is None else min_length
    high = ppo.max_new_tokens if max_length is None else max_length - 1
    if low is not None and high < low:
        raise ValueError(
            f"RELC's length range [{low}, {max_length}) is empty (its upper bound is excluded); "
            "give a maximum above the minimum."
        )
    return {"min_new_tokens": low, "max_new_tokens": high}


def ignored_relc_flags(args: Any, prefix: str = "") -> dict[str, Any]:
    """{flag path: value} of the `RELC_IGNORED_FLAGS` fields set in `args` (nested dataclasses included)."""
    found = {}
    for f in fields(args):
        value = getattr(args, f.name)
        if is_dataclass(value):
            found.update(ignored_relc_flags(value, f"{prefix}{f.name}."))
        elif f.name in RELC_IGNORED_FLAGS and value is not None:
            found[f"{prefix}{f.name}"] = value
    return found


def warn_ignored_relc_flags(args: Any) -> None:
    """One warning naming every RELC flag of the run that configures nothing here, and why (once per run: on the
    main process only, where `accelerate launch` sets RANK)."""
    found = ignored_relc_flags(args)
    if not found or os.environ.get("RANK", "0") != "0":
        return
    reasons = "; ".join(
        f"--{path} {value!r}: {RELC_IGNORED_FLAGS[path.rsplit('.', 1)[-1]]}" for path, value in found.items()
    )
    warnings.warn(f"Ignored RELC flags (recorded in run_args.json, no effect on the run): {reasons}.", stacklevel=2)


def relc_toxicity_values(config):
    """RELC's toxicity meaning of ``--positive_reward_value``: the toxicity critic names only toxic spans, so RELC's
    positive value is the reward of every token *outside* them (its `.sh`: +0.1), our `outside_span_reward_value`
    (`trl_stable.compat.relc_critic.relc_token_reward_values`)."""
    from trl_stable.compat.relc_critic import relc_token_reward_values

    if config.outside_span_reward_value != 0.0:
        raise ValueError(
            f"--positive_reward_value {config.positive_reward_value} (RELC's reward outside toxic spans) and "
            f"--outside_span_reward_value {config.outside_span_reward_value} name the same reward for toxicity; "
            "pass one of them."
        )
    values = (config.positive_reward_value, config.negative_reward_value)
    pos, neg, outside = relc_token_reward_values("toxicity", *values)
    logger.info(f"toxicity: --positive_reward_value {outside} is RELC's reward of every token outside a toxic span")
    return replace(config, positive_reward_value=pos, negative_reward_value=neg, outside_span_reward_value=outside)
