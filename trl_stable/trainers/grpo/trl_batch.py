"""GRPO's reading of `trl.GRPOTrainer`'s batch dict: the multimodal forward inputs TRL passes on to the policy, and
the tokenizer whose pad id fills its ids (see `trl_stable.integration.trl_members`: GRPO_BATCH_KEYS, LOGPS_PARAMS)."""

from __future__ import annotations

import inspect
from typing import Any

import trl

from trl_stable.integration.trl_members import LOGPS_PARAMS

__all__ = ["forward_kwargs", "multimodal_forward_keys", "tokenizer_of"]

# Parameters of `_get_per_token_logps_and_entropies` that are not multimodal forward inputs.
_LOGPS_CORE_PARAMS = ("self", *LOGPS_PARAMS)


def multimodal_forward_keys() -> tuple[str, ...]:
    """The batch keys TRL forwards to the policy besides ids and masks (pixel_values, image_grid_thw, ...).

    Read from the signature of `trl.GRPOTrainer._get_per_token_logps_and_entropies`, TRL's own list, rather than
    copied, so a TRL release that adds a multimodal input is followed automatically.
    """
    signature = inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies)
    return tuple(name for name in signature.parameters if name not in _LOGPS_CORE_PARAMS)


def forward_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """The multimodal forward inputs present in a GRPO batch, for `_get_per_token_logps_and_entropies`."""
    return {key: batch[key] for key in multimodal_forward_keys() if key in batch}


def tokenizer_of(trainer: Any) -> Any:
    """TRL's tokenizer (the processor's tokenizer for a VLM)."""
    return trainer._tokenizer
