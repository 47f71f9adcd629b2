"""Position ids of padded rows from the attention mask, as the samplers number the tokens: HF `generate` and vLLM
count a left-padded row from its first real token, a plain forward from the first column (on absolute position
embeddings, GPT-2 and OPT, different log-probs).
"""

from __future__ import annotations

import torch

__all__ = ["position_ids_from_mask"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, L] numbering each row's real tokens from 0: ``(attention_mask.cumsum(-1) - 1).clamp(min=0)``,
    as HF `generate` does; padding gets 0 or repeats the last position (it is masked out anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
