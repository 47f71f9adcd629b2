"""Per-family router adapters: the supported router classes and each family's gating at fixed experts, written after
its ``forward`` so that replaying the router's own experts reproduces its output exactly (docs/routing_replay.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn


def _renormalize(weights: torch.Tensor, router_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`weights / weights.sum(-1)`, except where the sum underflows to 0 (replayed experts a drifted router now gives
    ~0 probability): there the exact softmax of the replayed experts' logits, instead of NaN from 0 / 0."""
    total = weights.sum(dim=-1, keepdim=True)
    underflow = total == 0
    renormalized = weights / torch.where(underflow, torch.ones_like(total), total)
    exact = torch.nn.functional.softmax(router_logits.float().gather(1, index), dim=-1).to(weights.dtype)
    return torch.where(underflow, exact, renormalized)


def _softmax_gate(router: nn.Module, router_logits: torch.Tensor, index: torch.Tensor, mixtral: bool = False):
    """Qwen2-MoE / Qwen3-MoE / OLMoE / Mixtral gating at fixed experts: w = softmax(logits in fp32)[index],
    renormalised over the k experts when ``norm_topk_prob`` and cast back to the logits' dtype; Mixtral always
    renormalises and keeps fp32."""
    weights = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1).gather(1, index)
    if mixtral or router.norm_topk_prob:
        weights = _renormalize(weights, router_logits, index)
    return weights if mixtral else weights.to(router_logits.dtype)


def _deepseek_v3_gate(router: nn.Module, router_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 gating at fixed experts (arXiv 2412.19437, eq. 12-15): the correction bias only steers selection,
    so w = sigmoid(logits)[index], divided by (sum w + 1e-20) when ``norm_topk_prob``, times
    ``routed_scaling_factor``."""
    weights = router_logits.sigmoid().gather(1, index)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


@dataclass(frozen=True)
class RouterAdapter:
    """How routing replay drives one router class: the transformers model type (`family`), the modeling module and
    router class (matched by identity after import), ``gate(router, router_logits, index) -> weights [N, k]`` and the
    MoE block's attribute holding training-time input jitter, if any."""

    family: str
    module: str
    class_name: str
    gate: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    jitter_attribute: str | None = None

    def load_class(self) -> type[nn.Module] | None:
        """The router class, or None when this transformers install lacks the family."""
        try:
            return getattr(importlib.import_module(self.module), self.class_name)
        except (ImportError, AttributeError):
            return None


ADAPTERS: tuple[RouterAdapter, ...] = tuple(
    RouterAdapter(family, f"transformers.models.{family}.modeling_{family}", class_name, gate, jitter)
    for family, class_name, gate, jitter in (
        ("qwen2_moe", "Qwen2MoeTopKRouter", _softmax_gate, None),
        ("qwen3_moe", "Qwen3MoeTopKRouter", _softmax_gate, None),
        ("mixtral", "MixtralTopKRouter", partial(_softmax_gate, mixtral=True), "jitter_noise"),
        ("olmoe", "OlmoeTopKRouter", _softmax_gate, None),
        ("deepseek_v3", "DeepseekV3TopkRouter", _deepseek_v3_gate, None),
    )
)
SUPPORTED_ROUTERS: tuple[str, ...] = tuple(adapter.class_name for adapter in ADAPTERS)

# Class-name fragments of MoE modules, only to tell an unsupported MoE model from a dense one in the error message.
_MOE_HINTS = ("router", "topkgate", "sparsemoe", "moeblock", "moegate")


def adapter_for(module: nn.Module) -> RouterAdapter | None:
    """The adapter whose router class is exactly ``type(module)``, or None."""
    return next((adapter for adapter in ADAPTERS if type(module) is adapter.load_class()), None)


def unsupported_error(model: nn.Module) -> ValueError:
    """The error raised for a model without any supported router, naming what was found and what is supported."""
    suspects = sorted(
        {type(m).__name__ for m in model.modules() if any(h in type(m).__name__.lower() for h in _MOE_HINTS)}
    )
    found = (
        f"It has MoE-like modules of unsupported classes: {', '.join(suspects)}."
        if suspects
        else "It has no MoE router at all (a dense model needs no routing replay)."
    )
    supported = ", ".join(f"{a.class_name} ({a.family})" for a in ADAPTERS)
    return ValueError(
        f"RoutingReplay found no supported MoE router in {type(model).__name__}. {found} Supported router classes "
        f"(transformers 5.x): {supported}. Fix: use one of these model families, or set routing_replay='off'."
    )
