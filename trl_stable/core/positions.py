"""Position ids of padded rows, derived from the attention mask as the samplers number the tokens.

HF `generate` numbers a left-padded row's tokens from its first real token (`position_ids = attention_mask.cumsum(-1)
- 1`), and vLLM sees no padding at all; a forward without `position_ids` numbers them from the first column instead.
On a model with absolute position embeddings (GPT-2, OPT) the two numberings give different log-probs for the same
tokens, on rotary models (Llama, Qwen) the same ones up to float rounding.
"""

from __future__ import annotations

import torch

__all__ = ["position_ids_from_mask"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, L] of the tokens of `attention_mask` [B, L]: each row's real tokens numbered 0, 1, ... .

    ``(attention_mask.cumsum(-1) - 1).clamp(min=0)``. On the real tokens of a left-padded row this is what HF
    `generate` feeds the model; padding positions get 0 (left) or repeat the last position (right), which changes no
    real token's output: padding is masked out of attention and of the loss.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
