"""What GRPO needs to know about the forward passes `trl.GRPOTrainer` runs: which one computes the KL reference, and
the model TRL's log-prob pass calls, given position ids from the attention mask (see
`trl_stable.integration.trl_members`: LOGPS_FORWARD_SNIPPETS, REF_ADAPTER_NAME)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from trl_stable.core.positions import position_ids_from_mask
from trl_stable.integration.trl_members import REF_ADAPTER_NAME


class _MaskPositionIds:
    """A model whose every call gets ``position_ids`` from its ``attention_mask``; attributes read the model's."""

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
            kwargs["position_ids"] = position_ids_from_mask(kwargs["attention_mask"])
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def with_mask_position_ids(trainer: Any, model: torch.nn.Module) -> Any:
    """`model` for `trl.GRPOTrainer._get_per_token_logps_and_entropies`, numbering each row from its first real token.

    TRL's pass gives the model no position ids, so a left-padded row is numbered from its first (padding) column,
    while HF `generate` numbers it from the attention mask (and vLLM sees no padding); see
    `trl_stable.core.positions`. The returned callable adds `position_ids_from_mask(attention_mask)` to each call.
    A model whose forward takes no `position_ids` is returned unchanged, as `generate` then passes none either.
    """
    inner = trainer.accelerator.unwrap_model(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT forwards **kwargs
    if "position_ids" not in inspect.signature(inner.forward).parameters:
        return model
    return _MaskPositionIds(model)


def is_reference_pass(trainer: Any, model: torch.nn.Module) -> bool:
    """Whether a forward of `model` computes the KL reference, judged from the model's own state.

    The reference is `trainer.ref_model`, or for a PEFT policy the same model with its adapters disabled (a new
    adapter: peft's ``disable_adapter()``) or with TRL's reference adapter (`REF_ADAPTER_NAME`) active.
    """
    if model is getattr(trainer, "ref_model", None):
        return True
    unwrapped = trainer.accelerator.unwrap_model(model)
    if not hasattr(unwrapped, "peft_config"):
        return False
    if getattr(unwrapped, "active_adapter", None) == REF_ADAPTER_NAME:
        return True
    from peft.tuners.tuners_utils import BaseTunerLayer  # peft is optional: only a PEFT policy gets here

    return any(module.disable_adapters for module in unwrapped.modules() if isinstance(module, BaseTunerLayer))
