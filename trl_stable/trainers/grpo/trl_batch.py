"""GRPO's reading and re-shaping of `trl.GRPOTrainer`'s batch dict, each piece the TRL logic it mirrors (listed in
`trl_stable.integration.mirrored.MIRRORED`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import trl
from trl.trainer.utils import pad

from trl_stable.integration.trl_members import GRPO_PADDING, LOGPS_PARAMS
from trl_stable.moe.hook import ROUTED_EXPERTS_KEY
from trl_stable.moe.layout import repad_routing


def multimodal_forward_keys() -> tuple[str, ...]:
    """The batch keys TRL forwards to the policy besides ids and masks (pixel_values, ...), read from the signature
    of `trl.GRPOTrainer._get_per_token_logps_and_entropies`, so a new TRL input is followed."""
    signature = inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies)
    return tuple(name for name in signature.parameters if name not in ("self", *LOGPS_PARAMS))


def forward_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """The multimodal forward inputs present in a GRPO batch, for `_get_per_token_logps_and_entropies`."""
    return {key: batch[key] for key in multimodal_forward_keys() if key in batch}


def tokenizer_of(trainer: Any) -> Any:
    """TRL's tokenizer (the processor's tokenizer for a VLM)."""
    return trainer._tokenizer


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """[B, T] the tokens TRL's loss trains on: ``completion_mask``, times ``tool_mask`` when the batch has one (the
    channel trl_stable removes samples and tokens from the loss through)."""
    mask = batch["completion_mask"]
    return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]


def num_items_in_batch(batch: dict[str, Any], accelerator: Any) -> torch.Tensor:
    """TRL's token normaliser of the dapo / cispo / vespo losses: the loss-mask tokens of every process's batch. A
    collective (a gather): call it on every process or on none."""
    return accelerator.gather(loss_mask(batch).sum()).sum()


def process_slice(accelerator: Any, num_local: int) -> slice:
    """This process's rows of a batch gathered over processes (each process holds `num_local` rows, in order)."""
    return slice(accelerator.process_index * num_local, (accelerator.process_index + 1) * num_local)


def num_rows(batch: dict[str, Any]) -> int:
    return batch["completion_ids"].size(0)


def select_rows(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The batch restricted to `rows` ([B] bool or indices): every batch-first tensor indexed, the rest kept."""
    size = num_rows(batch)
    rows = rows.to(batch["completion_ids"].device)
    return {
        key: value[rows] if torch.is_tensor(value) and value.dim() > 0 and value.size(0) == size else value
        for key, value in batch.items()
    }


def concat_rows(parts: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Batches concatenated along rows, each [B, T] key padded with TRL's `pad` as TRL pads it (`GRPO_PADDING`;
    other 2-D keys on the right with 0), the MoE routing re-padded like the ids, scalars the first part's."""
    parts = [dict(part) for part in parts if num_rows(part) > 0]
    if any("tool_mask" in part for part in parts):  # only batches that dropped something carry one
        for part in parts:
            part.setdefault("tool_mask", torch.ones_like(part["completion_mask"]))
    merged = dict(parts[0])
    for key, value in parts[0].items():
        if not torch.is_tensor(value) or value.dim() == 0:
            continue
        values = [part[key] for part in parts]
        if key == ROUTED_EXPERTS_KEY:
            widths = [part["prompt_ids"].size(1) for part in parts]
            total = max(widths) + max(part["completion_ids"].size(1) for part in parts)
            merged[key] = torch.cat([repad_routing(v, w, max(widths), total) for v, w in zip(values, widths)], dim=0)
        elif value.dim() == 2:
            side, fill = GRPO_PADDING.get(key, ("right", 0))
            fill = pad_token_id if fill == "pad_token_id" else fill
            merged[key] = pad([row for v in values for row in v], padding_value=fill, padding_side=side)
        else:
            merged[key] = torch.cat(values, dim=0)
    return merged
