"""Layout helpers for routing tensors [B, S, num_layers, k] (-1: the router keeps its own choice): samplers and the
trainer pad differently, so the helpers go through the unpadded per-sequence form every layout agrees on."""

from __future__ import annotations

from collections.abc import Sequence

import torch

NO_ROUTING = -1


def mask_routing(routing: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`routing` [B, S, L, k] with the rows of padding tokens (``attention_mask == 0``) set to -1, so metrics count
    real tokens only."""
    if routing.shape[:2] != attention_mask.shape:
        raise ValueError(
            f"routing is {tuple(routing.shape[:2])} in [B, S] but attention_mask is {tuple(attention_mask.shape)}."
        )
    keep = attention_mask.to(device=routing.device).bool()[:, :, None, None]
    return routing.masked_fill(~keep, NO_ROUTING)


def unpad_routing(routing: torch.Tensor, starts: Sequence[int], lengths: Sequence[int]) -> list[torch.Tensor]:
    """Per-sequence routing: ``routing[i, starts[i] : starts[i] + lengths[i]]`` ([n_i, L, k]), shorter if the
    tensor ends first (e.g. a sequence's last generated token was never fed to the model)."""
    if not (len(starts) == len(lengths) == routing.shape[0]):
        raise ValueError(f"need one start and one length per row: {routing.shape[0]} rows, {len(starts)} starts.")
    return [routing[i, int(s) : int(s) + int(n)] for i, (s, n) in enumerate(zip(starts, lengths, strict=True))]


def pad_routing(
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    prompt_width: int,
    total_width: int,
    num_layers: int | None = None,
    top_k: int | None = None,
) -> torch.Tensor:
    """Place per-sequence routing into the trainer layout: prompts left-padded to `prompt_width`, completions
    right-padded up to `total_width`; everything not covered is -1.

    Sequence i occupies positions ``[prompt_width - prompt_lengths[i], prompt_width - prompt_lengths[i] + n_i)``,
    truncated at `total_width`. Accepts tensors or arrays (vLLM's ``routed_experts``) of shape [n_i, L, k].
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} routing sequences but {len(prompt_lengths)} prompt lengths.")
    tensors = [torch.as_tensor(s) for s in sequences]
    shaped = [t for t in tensors if t.numel()]
    if num_layers is None or top_k is None:
        if not shaped:
            raise ValueError("every routing sequence is empty: pass num_layers and top_k.")
        num_layers, top_k = int(shaped[0].shape[1]), int(shaped[0].shape[2])
    device = shaped[0].device if shaped else None
    out = torch.full((len(tensors), total_width, num_layers, top_k), NO_ROUTING, dtype=torch.int32, device=device)
    for i, (rows, prompt_len) in enumerate(zip(tensors, prompt_lengths, strict=True)):
        if rows.numel() == 0:
            continue
        if rows.dim() != 3 or rows.shape[1:] != (num_layers, top_k):
            raise ValueError(
                f"routing sequence {i} has shape {tuple(rows.shape)}, expected [n, {num_layers}, {top_k}]."
            )
        start = prompt_width - int(prompt_len)
        if start < 0:
            raise ValueError(f"prompt {i} has {prompt_len} tokens, more than prompt_width={prompt_width}.")
        n = max(0, min(rows.shape[0], total_width - start))
        out[i, start : start + n] = rows[:n].to(device=out.device, dtype=out.dtype)
    return out


def repad_routing(
    routing: torch.Tensor, prompt_width: int, new_prompt_width: int, new_total_width: int
) -> torch.Tensor:
    """Re-pad a trainer-layout routing tensor [B, prompt_width + T, L, k] to a wider prompt (left, -1) and a wider
    completion (right, -1): what re-padding ``prompt_ids`` left and ``completion_ids`` right does to the tokens."""
    left = new_prompt_width - prompt_width
    right = new_total_width - new_prompt_width - (routing.shape[1] - prompt_width)
    if left < 0 or right < 0:
        raise ValueError(
            f"repad_routing only widens: prompt {prompt_width} -> {new_prompt_width}, total {routing.shape[1]} -> "
            f"{new_total_width}."
        )
    return torch.nn.functional.pad(routing, (0, 0, 0, 0, left, right), value=NO_ROUTING)
