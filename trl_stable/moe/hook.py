"""Routing replay as a hook object the trainers call at named points of their step (docs/routing_replay.md, "Custom
loops"): nothing is wrapped behind the trainer's back. The routing tensor travels in the batch under
``ROUTED_EXPERTS_KEY`` ([B, S, num_moe_layers, k], -1 on padding), so shuffles and splits keep it aligned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trl_stable.moe.layout import mask_routing, pad_routing, unpad_routing
from trl_stable.moe.replay import RoutingReplay

ROUTING_REPLAY_MODES: tuple[str, ...] = ("off", "R2", "R3")
ROUTED_EXPERTS_KEY = "routed_experts"
ROUTING_REPLAY_HELP = (
    "MoE routing replay. 'off': routers route freely. 'R2': record each router's top-k experts in the old-logprob "
    "pass and replay them in the update passes (removes routing drift between the rollout weights and the update). "
    "'R3': record the experts chosen by the sampler (HF generate, or vLLM `routed_experts` returned by a "
    "rollout_func) and replay them in the old-logprob pass and the updates (also removes the sampler/trainer routing "
    "mismatch). Gate weights are recomputed from the current router, so routers keep training. Supported: "
    "Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3. Metrics: routing/agreement, routing/replayed_frac."
)


def check_routing_replay_mode(value: str, field: str = "routing_replay") -> None:
    """Raise ValueError unless `value` is one of `ROUTING_REPLAY_MODES` (case-sensitive, as written in configs)."""
    if value not in ROUTING_REPLAY_MODES:
        raise ValueError(f"{field} must be one of {', '.join(repr(m) for m in ROUTING_REPLAY_MODES)}, got {value!r}.")


def batch_routing(sequences: Sequence[Any], attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Per-sequence sampler routing placed in a trainer batch: prompts left-padded to `prompt_width`, completions
    right-padded to ``attention_mask.shape[1]``, padding rows -1."""
    prompt_lengths = attention_mask[:, :prompt_width].sum(dim=1).tolist()
    routing = pad_routing(sequences, prompt_lengths, prompt_width, attention_mask.shape[1])
    return mask_routing(routing.to(attention_mask.device), attention_mask)


@dataclass
class SampledRouting:
    """What `RoutingHook.sampling` recorded around one ``generate`` call (empty unless R3): the sequence-joined export
    [B, fed tokens, layers, k] and the width of the left-padded prompt batch the prefill saw."""

    routing: torch.Tensor | None = None
    prompt_width: int = 0

    def per_sequence(self, prompt_lengths: Sequence[int], completion_lengths: Sequence[int]) -> list[torch.Tensor]:
        """Routing of each sequence, [p_i + c_i, layers, k] (one row shorter when its last token was never fed)."""
        if self.routing is None:
            raise ValueError("No sampler routing was recorded (routing_replay is not 'R3').")
        starts = [self.prompt_width - int(p) for p in prompt_lengths]
        lengths = [int(p) + int(c) for p, c in zip(prompt_lengths, completion_lengths, strict=True)]
        return unpad_routing(self.routing, starts, lengths)


@dataclass
class RolloutRouting:
    """The routing of one old-logprob pass: recorded there (R2) or replayed there (R3); None when off."""

    routing: torch.Tensor | None = None


class RoutingHook:
    """The routing-replay points of a trainer's step; with `mode` "off" each is a no-op, so a trainer calls them all.

    Args:
        model: The policy (a transformers MoE model, or a wrapper such as a PEFT model); unused when `mode` is "off".
        mode: "off", "R2" or "R3".
    """

    def __init__(self, model: nn.Module | None, mode: str = "off"):
        check_routing_replay_mode(mode)
        self.mode = mode
        self.replay: RoutingReplay | None = None if mode == "off" else RoutingReplay(model)

    @property
    def active(self) -> bool:
        return self.replay is not None

    @contextlib.contextmanager
    def sampling(self) -> Iterator[SampledRouting]:
        """Around one HF ``generate`` call: under R3 record the routing of the prefill and every decode step."""
        sampled = SampledRouting()
        with self.replay.record() if self.mode == "R3" else contextlib.nullcontext():
            yield sampled
        if self.mode == "R3":
            sampled.routing = self.replay.export(dim="sequence")
            sampled.prompt_width = self.replay.recorded_shapes[0][1]
            self.replay.clear()

    @contextlib.contextmanager
    def rollout_pass(
        self, attention_mask: torch.Tensor, routing: torch.Tensor | None = None
    ) -> Iterator[RolloutRouting]:
        """Around the no-grad old-logprob pass on a fresh batch: R2 records its routing, R3 replays the sampler's
        `routing` (required); after the block ``.routing`` holds the batch's routing for the updates."""
        if self.mode == "R3" and routing is None:
            raise ValueError("routing_replay='R3': the rollout pass needs the sampler's routing; none was given.")
        out = RolloutRouting()
        if self.mode == "off":
            context = contextlib.nullcontext()
        else:
            context = self.replay.replay(routing) if self.mode == "R3" else self.replay.record()
        with context:
            yield out
        if self.mode == "R3":
            out.routing = routing
        elif self.mode == "R2":
            out.routing = mask_routing(self.replay.export(dim="batch"), attention_mask)
            self.replay.clear()

    @contextlib.contextmanager
    def update_pass(self, routing: torch.Tensor | None) -> Iterator[None]:
        """Around an update forward: replay `routing` (the batch's ``ROUTED_EXPERTS_KEY`` entry) when there is one."""
        with contextlib.nullcontext() if self.replay is None or routing is None else self.replay.replay(routing):
            yield

    def take_metrics(self, prefix: str = "routing/", accelerator: Any | None = None) -> dict[str, float]:
        """The agreement metrics of the replayed passes since the last call, under `prefix`; then reset them.

        With `accelerator`, over every process's tokens (a collective: every process calls it).
        """
        if self.replay is None:
            return {}
        metrics = self.replay.metrics(prefix=prefix, accelerator=accelerator)
        self.replay.reset_metrics()
        return metrics
