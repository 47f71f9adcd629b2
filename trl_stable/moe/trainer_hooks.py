"""Routing replay in the trainers: the ``routing_replay`` config field and the glue that drives `RoutingReplay`.

Modes (``routing_replay`` on GRPOConfig / PPOConfig):

- ``"off"``: the routers route freely (default).
- ``"R2"``: record the routing in the trainer's own old-logprob pass, replay it in every update pass on that batch.
  Removes the routing drift caused by the optimiser steps between the old-logprob pass and the updates.
- ``"R3"``: record the routing in the *sampler* (HF generate: prefill rows then one row per decode step; vLLM:
  ``routed_experts`` handed over by a rollout function) and replay it in the old-logprob pass and the updates. Also
  removes the sampler/trainer routing mismatch, at the price of training on the sampler's routing.

The routing tensor travels in the batch under the key ``"routed_experts"`` ([B, S, num_moe_layers, k], -1 on padding),
so shuffling and mini-batch splitting keep it aligned with its tokens.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

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


def routing_from_generation(
    replay: RoutingReplay,
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    prompt_width: int | None = None,
) -> list[torch.Tensor]:
    """Per-sequence routing ([p_i + c_i, L, k], shorter when the last token was never fed) after a `record()`
    around ``model.generate`` on left-padded prompts of width `prompt_width` (default: the first recorded call's
    length, i.e. an unchunked prefill)."""
    routing = replay.export(dim="sequence")
    if prompt_width is None:
        prompt_width = replay.recorded_shapes[0][1]
    starts = [prompt_width - int(p) for p in prompt_lengths]
    lengths = [int(p) + int(c) for p, c in zip(prompt_lengths, completion_lengths, strict=True)]
    return unpad_routing(routing, starts, lengths)


def batch_routing(sequences: Sequence[Any], attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Per-sequence sampler routing placed in a trainer batch: prompts left-padded to `prompt_width`, completions
    right-padded to ``attention_mask.shape[1]``, padding rows -1."""
    prompt_lengths = attention_mask[:, :prompt_width].sum(dim=1).tolist()
    routing = pad_routing(sequences, prompt_lengths, prompt_width, attention_mask.shape[1])
    return mask_routing(routing.to(attention_mask.device), attention_mask)


def log_routing_metrics(replay: RoutingReplay, sink: Callable[[str, float], None], prefix: str = "routing/") -> None:
    """Send the agreement metrics accumulated since the last call to `sink(name, value)`, then reset them."""
    for name, value in replay.metrics(prefix=prefix).items():
        sink(name, value)
    replay.reset_metrics()


class PPORoutingReplayMixin:
    """Routing replay for trl_stable's `PPOTrainer`: ``class T(PPORoutingReplayMixin, PPOTrainer)``. Reads
    ``args.routing_replay``; with "off" every override is a plain ``super()`` call.

    Hooks used: `generate` (R3: records the policy's routing per sequence while it samples), `_build_batch` (R3: puts
    the sampler's routing in the batch, checked against the tokens `step` receives), `_rollout_forward` (the
    policy/value forward of the rollout pass: record for R2, replay for R3; the reference pass is a separate call
    and is never replayed), `_old_logprob_pass` (collects the recorded chunks into the batch), `_update_forward`
    (replay, also after `_trim_micro_batch` cut trailing columns) and `_optimise` (adds the agreement metrics to the
    step's logs).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._routing_mode = getattr(self.args, "routing_replay", "off")
        check_routing_replay_mode(self._routing_mode)
        self._routing_replay: RoutingReplay | None = None
        self._routing_chunks: list[torch.Tensor] = []
        self._routing_logs: dict[str, float] = {}
        self._sampled_routing: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if self._routing_mode != "off":
            self._routing_replay = RoutingReplay(self._unwrapped().policy)

    # -- sampling (R3)
    def generate(self, query_tensor, *args: Any, **kwargs: Any):
        if self._routing_mode != "R3":
            return super().generate(query_tensor, *args, **kwargs)
        policy = self._unwrapped().policy
        replay = self._routing_replay
        records: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = policy.generate
        had_attribute = "generate" in policy.__dict__

        def generate_recording(*g_args, input_ids=None, attention_mask=None, **g_kwargs):
            with replay.record():
                output = original(*g_args, input_ids=input_ids, attention_mask=attention_mask, **g_kwargs)
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            width = input_ids.shape[1]
            prompt_lengths = attention_mask.sum(1).tolist() if attention_mask is not None else [width] * len(input_ids)
            generated = sequences.shape[1] - width
            per_sequence = routing_from_generation(
                replay, prompt_lengths, [generated] * len(prompt_lengths), prompt_width=width
            )
            replay.clear()
            for row, length, routing in zip(sequences, prompt_lengths, per_sequence, strict=True):
                records.append((row[width - int(length) :], routing))
            return output

        policy.generate = generate_recording
        try:
            out = super().generate(query_tensor, *args, **kwargs)
        finally:
            if had_attribute:
                policy.generate = original
            else:
                del policy.generate
        self._sampled_routing = records
        return out

    def _sampler_routing_for(self, queries, responses) -> list[torch.Tensor]:
        records = self._sampled_routing
        self._sampled_routing = None
        if records is None or len(records) != len(queries):
            raise ValueError(
                "routing_replay='R3' needs the sampler's routing: call step() with the queries and responses of the "
                "last generate() call, all of them, in the same order (or use routing_replay='R2')."
            )
        out = []
        for i, ((tokens, routing), q, r) in enumerate(zip(records, queries, responses, strict=True)):
            fed = torch.cat([q.reshape(-1), r.reshape(-1)]).to(tokens.device)
            if len(fed) > len(tokens) or not torch.equal(tokens[: len(fed)].long(), fed.long()):
                raise ValueError(
                    f"routing_replay='R3': sample {i} passed to step() is not the one generate() produced, so its "
                    "recorded routing does not apply. Pass the generated responses unchanged, in order."
                )
            out.append(routing[: len(fed)])
        return out

    def _build_batch(self, queries, responses):
        batch = super()._build_batch(queries, responses)
        if self._routing_mode == "R3":
            prompt_width = batch["input_ids"].shape[1] - batch["response_ids"].shape[1]
            routing = self._sampler_routing_for(queries, responses)
            batch[ROUTED_EXPERTS_KEY] = batch_routing(routing, batch["attention_mask"], prompt_width)
        return batch

    # -- the rollout pass and the updates
    def _old_logprob_pass(self, batch):
        if self._routing_replay is None:
            return super()._old_logprob_pass(batch)
        self._routing_chunks = []
        result = super()._old_logprob_pass(batch)
        if self._routing_mode == "R2":
            result[ROUTED_EXPERTS_KEY] = torch.cat(self._routing_chunks, dim=0)
            self._routing_chunks = []
        else:
            self._routing_logs.update(self._routing_replay.metrics(prefix="routing/rollout_"))
            self._routing_replay.reset_metrics()
        return result

    def _replaying(self, batch, forward):
        routing = batch.get(ROUTED_EXPERTS_KEY)
        if self._routing_replay is None or routing is None:
            return forward(batch)
        with self._routing_replay.replay(routing[:, : batch["input_ids"].shape[1]]):  # micro-batches may be trimmed
            return forward(batch)

    def _rollout_forward(self, batch):
        replay = self._routing_replay
        if replay is None or self._routing_mode == "R3":
            return self._replaying(batch, super()._rollout_forward)
        with replay.record():
            out = super()._rollout_forward(batch)
        self._routing_chunks.append(mask_routing(replay.export(dim="batch"), batch["attention_mask"]))
        replay.clear()
        return out

    def _update_forward(self, batch):
        return self._replaying(batch, super()._update_forward)

    def _optimise(self, batch):
        stats, early_stopped, epochs_done = super()._optimise(batch)
        if self._routing_replay is not None:
            stats = {**stats, **self._routing_logs, **self._routing_replay.metrics()}
            self._routing_replay.reset_metrics()
            self._routing_logs = {}
        return stats, early_stopped, epochs_done


def with_routing_replay(trainer_cls: type, mixin: type = PPORoutingReplayMixin) -> type:
    """`trainer_cls` with `mixin` in front of it, under the same name and module: the one-line way to give a
    trainer class that defines the hooked methods itself (trl_stable's PPOTrainer) routing replay.

    Example (at the end of the trainer's module): ``PPOTrainer = with_routing_replay(PPOTrainer)``.
    """
    namespace = {
        "__module__": trainer_cls.__module__,
        "__qualname__": trainer_cls.__qualname__,
        "__doc__": trainer_cls.__doc__,
        "__signature__": inspect.signature(trainer_cls),  # the mixin's __init__(*args, **kwargs) would hide it
    }
    return type(trainer_cls.__name__, (mixin, trainer_cls), namespace)


@contextlib.contextmanager
def maybe_replay(replay: RoutingReplay | None, routing: torch.Tensor | None) -> Iterator[None]:
    """`replay.replay(routing)` when both are given, else nothing: the one-liner for a custom trainer's update."""
    if replay is None or routing is None:
        yield
        return
    with replay.replay(routing):
        yield
