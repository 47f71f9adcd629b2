"""Per-family router adapters: which router classes routing replay supports, and each family's gating at fixed
experts (docs/routing_replay.md). Every supported router returns ``(router_logits, top_k_weights, top_k_index)``;
replay keeps the logits (and their gradient), swaps the index for the recorded experts and recomputes the weights
with the family's normalisation, written line for line after its ``forward`` so that replaying the experts the
router would have picked reproduces its output exactly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def _renormalize(weights: torch.Tensor, router_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`weights / weights.sum(-1)`, the families' renormalisation over the k experts, safe where the sum is 0.

    A router always renormalises over its own top-k, whose probabilities cannot all be 0. Replayed experts can be
    ones a drifted router now gives fp32 probabilities that underflow to 0 (logit gaps of ~100), and 0 / 0 would
    put NaN in the forward and in every gradient. There the weights take their exact value, the softmax of the
    replayed experts' logits; every other row is the family's division, unchanged to the bit.
    """
    total = weights.sum(dim=-1, keepdim=True)
    underflow = total == 0
    renormalized = weights / torch.where(underflow, torch.ones_like(total), total)
    exact = torch.nn.functional.softmax(router_logits.float().gather(1, index), dim=-1).to(weights.dtype)
    return torch.where(underflow, exact, renormalized)


def _softmax_topk_gate(router: nn.Module, router_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE / Qwen3-MoE / OLMoE gating at fixed experts.

    w = softmax(logits)[index], renormalised to sum 1 over the k experts when ``norm_topk_prob``, cast back to the
    logits' dtype (as ``Qwen2MoeTopKRouter.forward`` does).
    """
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    weights = probs.gather(1, index)
    if router.norm_topk_prob:
        weights = _renormalize(weights, router_logits, index)
    return weights.to(router_logits.dtype)


def _mixtral_gate(router: nn.Module, router_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Mixtral gating at fixed experts: w = softmax(logits in fp32)[index], always renormalised, kept in fp32."""
    probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    weights = probs.gather(1, index)
    return _renormalize(weights, router_logits, index)


def _deepseek_v3_gate(router: nn.Module, router_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 gating at fixed experts (arXiv 2412.19437, eq. 12-15).

    Scores s = sigmoid(logits); the correction bias only steers the *selection*, so the weights come from the
    unbiased scores: w = s[index], divided by (sum w + 1e-20) when ``norm_topk_prob``, times
    ``routed_scaling_factor``.
    """
    scores = router_logits.sigmoid()
    weights = scores.gather(1, index)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


@dataclass(frozen=True)
class RouterAdapter:
    """How routing replay drives one router class.

    Args:
        family: transformers model type the router belongs to.
        module: Module path of the modeling file that defines the router.
        class_name: Router class name (matched by identity after import, never by name guessing).
        gate: ``gate(router, router_logits, index) -> weights [N, k]``, the family's gating at fixed experts.
        jitter_attribute: Attribute of the parent MoE block holding training-time input jitter, if any.
    """

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


_MODELS = "transformers.models"
ADAPTERS: tuple[RouterAdapter, ...] = (
    RouterAdapter("qwen2_moe", f"{_MODELS}.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter", _softmax_topk_gate),
    RouterAdapter("qwen3_moe", f"{_MODELS}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", _softmax_topk_gate),
    RouterAdapter(
        "mixtral", f"{_MODELS}.mixtral.modeling_mixtral", "MixtralTopKRouter", _mixtral_gate, "jitter_noise"
    ),
    RouterAdapter("olmoe", f"{_MODELS}.olmoe.modeling_olmoe", "OlmoeTopKRouter", _softmax_topk_gate),
    RouterAdapter(
        "deepseek_v3", f"{_MODELS}.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter", _deepseek_v3_gate
    ),
)

SUPPORTED_ROUTERS: tuple[str, ...] = tuple(adapter.class_name for adapter in ADAPTERS)

# Class-name fragments of MoE routing modules. Used only to tell "an MoE model we do not support" from "not an MoE
# model" in the error message; detection of supported routers is by class identity.
_MOE_HINTS = ("router", "topkgate", "sparsemoe", "moeblock", "moegate")


def adapter_for(module: nn.Module) -> RouterAdapter | None:
    """The adapter whose router class is exactly ``type(module)``, or None."""
    for adapter in ADAPTERS:
        cls = adapter.load_class()
        if cls is not None and type(module) is cls:
            return adapter
    return None


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
