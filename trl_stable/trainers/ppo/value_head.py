"""A scalar value head for PPO's critic, and its save/load helpers."""

from __future__ import annotations

import math
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHead(nn.Module):
    """Linear map from a hidden state to a scalar value: V(s_t) = w . h_t + b.

    Args:
        hidden_size: Width of the hidden states it reads (the backbone's `hidden_size`).
        dropout: Dropout on the hidden state before the projection.
        bias: Whether the projection has a bias (False for a reused bias-free `score` head of a classifier).

    The weight starts at N(0, 1/(hidden_size + 1)) and the bias at 0, so initial values are O(1) whatever the width.
    """

    def __init__(self, hidden_size: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.summary = nn.Linear(self.hidden_size, 1, bias=bias)
        nn.init.normal_(self.summary.weight, std=1.0 / math.sqrt(self.hidden_size + 1))
        if bias:
            nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] values (float32)."""
        hidden_states = hidden_states.to(self.summary.weight.dtype)
        return self.summary(self.dropout(hidden_states)).squeeze(-1).float()

    def save_pretrained(
        self, save_directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None
    ) -> str:
        """Write the head to `save_directory/value_head.safetensors`; returns the file path. `state_dict`: the
        weights to write instead of the module's own (the gathered full weights under ZeRO-3 / FSDP)."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(os.fspath(save_directory), VALUE_HEAD_FILE)
        source = self.state_dict() if state_dict is None else state_dict
        state = {k: v.detach().contiguous().cpu() for k, v in source.items()}
        save_file(state, path, metadata={"hidden_size": str(self.hidden_size)})
        return path

    @classmethod
    def from_pretrained(cls, save_directory: str | os.PathLike) -> ValueHead:
        """Load a head written by `save_pretrained`."""
        path = os.path.join(os.fspath(save_directory), VALUE_HEAD_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No {VALUE_HEAD_FILE} in {save_directory}; save it with `save_model` first.")
        with safe_open(path, framework="pt") as f:
            hidden_size = int(f.metadata()["hidden_size"])
        state = load_file(path)
        head = cls(hidden_size, bias="summary.bias" in state)  # a reused classifier `score` head may have no bias
        head.load_state_dict(state)
        return head
