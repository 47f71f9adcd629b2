"""Routing replay for HuggingFace MoE models (R2 / R3): record each router's experts, replay them in training passes
(docs/routing_replay.md)."""

from trl_stable.moe.adapters import ADAPTERS, SUPPORTED_ROUTERS, RouterAdapter
from trl_stable.moe.generation import generate_with_routing
from trl_stable.moe.layout import NO_ROUTING, mask_routing, pad_routing, repad_routing, unpad_routing
from trl_stable.moe.replay import RoutingReplay

__all__ = [
    "ADAPTERS",
    "NO_ROUTING",
    "SUPPORTED_ROUTERS",
    "RouterAdapter",
    "RoutingReplay",
    "generate_with_routing",
    "mask_routing",
    "pad_routing",
    "repad_routing",
    "unpad_routing",
]
