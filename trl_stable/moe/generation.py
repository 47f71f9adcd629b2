"""R3 with HF generate: the sampler's routing recorded while it generates (prefill rows, then one row per decode step;
the last generated token is never fed back, so its row is -1)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trl_stable.moe.layout import NO_ROUTING
from trl_stable.moe.replay import RoutingReplay


def generate_with_routing(
    model: nn.Module, replay: RoutingReplay, *, input_ids: torch.Tensor, **generate_kwargs: Any
) -> tuple[Any, torch.Tensor]:
    """``model.generate`` while recording routing: ``(generate output, routing [B, S_out, L, k])`` in generate's own
    layout. Beam search, which reorders its cache between steps and so would scramble the rows, is refused.

    `replay` is the RoutingReplay hooking `model` (its previous routing is replaced), `input_ids` [B, P] the
    left-padded prompts, `generate_kwargs` go to ``generate``.
    """
    config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    num_beams = generate_kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1)
    if num_beams != 1:
        raise ValueError(
            f"generate_with_routing supports sampling and greedy decoding only, got num_beams={num_beams}."
        )
    if generate_kwargs.get("use_cache") is False:
        raise ValueError("generate_with_routing needs use_cache=True (one routing row per decode step).")
    with torch.no_grad(), replay.record():
        output = model.generate(input_ids=input_ids, **generate_kwargs)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    routing = replay.export(dim="sequence")
    if routing.shape[0] != sequences.shape[0]:
        raise RuntimeError(
            f"generate fed {routing.shape[0]} rows per step but returned {sequences.shape[0]} sequences; "
            f"this generation mode is not supported by routing replay."
        )
    missing = sequences.shape[1] - routing.shape[1]
    if missing < 0:
        raise RuntimeError(f"generate recorded {routing.shape[1]} positions for {sequences.shape[1]} tokens.")
    return output, torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, missing), value=NO_ROUTING)
