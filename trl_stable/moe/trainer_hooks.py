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

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trl_stable.moe.hook import (  # noqa: F401  (re-exported: the names trainers and configs import from here)
    ROUTED_EXPERTS_KEY,
    ROUTING_REPLAY_HELP,
    ROUTING_REPLAY_MODES,
    batch_routing,
    check_routing_replay_mode,
)
from trl_stable.moe.layout import mask_routing, unpad_routing
from trl_stable.moe.replay import RoutingReplay


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


def log_routing_metrics(replay: RoutingReplay, sink: Callable[[str, float], None], prefix: str = "routing/") -> None:
    """Send the agreement metrics accumulated since the last call to `sink(name, value)`, then reset them."""
    for name, value in replay.metrics(prefix=prefix).items():
        sink(name, value)
    replay.reset_metrics()


class GRPORoutingReplayMixin:
    """Routing replay for `trl.GRPOTrainer`: ``class T(GRPORoutingReplayMixin, trl.GRPOTrainer)``, or anywhere in the
    MRO of a subclass of it. Reads ``args.routing_replay``; with "off" every override is a plain ``super()`` call.

    Hooks used (TRL 1.16): `_generate_single_turn` (R3 with HF generate: record), `_generate` (R3 from a
    rollout_func: take its ``routed_experts``), `_get_per_token_logps_and_entropies` (no-grad passes of the policy
    on a fresh batch: record for R2, replay otherwise), `_generate_and_score_completions` (puts ``routed_experts``
    in the batch) and `_compute_loss` (replays the batch's routing in the update forward).

    Which no-grad pass is which: TRL runs its old-logprob pass (when it needs one) and then, for a PEFT policy, the
    reference pass on the same model with the adapter off; the reference pass is never replayed. Any later no-grad
    pass of the policy on the batch (e.g. a proximal pass a subclass runs after TRL) records (R2, if nothing was
    recorded yet) or replays.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._routing_mode = getattr(self.args, "routing_replay", "off")
        check_routing_replay_mode(self._routing_mode)
        self._routing_replay: RoutingReplay | None = None
        self._routing_phase = False
        self._routing_calls: deque[str] = deque()
        self._routing_batch: torch.Tensor | None = None
        self._routing_output: dict | None = None
        self._sampled_routing: list[torch.Tensor] | None = None
        if self._routing_mode == "off":
            return
        if self._routing_mode == "R3":
            if self.use_vllm and self.rollout_func is None:
                raise ValueError(
                    "routing_replay='R3' with vLLM needs the sampler's routing: pass a rollout_func whose output "
                    "has 'routed_experts' (one [tokens, layers, k] array per sequence, as vLLM returns them), or "
                    "use routing_replay='R2'."
                )
            if getattr(self, "use_transformers_continuous_batching", False) or self.tools:
                raise ValueError(
                    "routing_replay='R3' supports single-turn HF generate or a rollout_func; it does not support "
                    "continuous batching or tool calling. Fix: use routing_replay='R2'."
                )
        self._routing_replay = RoutingReplay(self.accelerator.unwrap_model(self.model))

    def _routing_log(self, prefix: str) -> None:
        mode = "train" if self.model.training else "eval"
        log_routing_metrics(self._routing_replay, lambda k, v: self._metrics[mode][k].append(v), prefix=prefix)

    # -- sampling (R3)
    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        if self._routing_mode != "R3" or self.use_vllm:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        with self._routing_replay.record():
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        prompt_lengths = [len(p) for p in prompt_ids]
        width, multiple = max(prompt_lengths), self.pad_to_multiple_of  # the padding TRL gave generate's input
        width = width if not multiple else -(-width // multiple) * multiple
        self._sampled_routing = routing_from_generation(
            self._routing_replay, prompt_lengths, [len(c) for c in completion_ids], prompt_width=width
        )
        self._routing_replay.clear()
        return completion_ids, logprobs

    def _generate(self, prompts):
        result = super()._generate(prompts)
        if self._routing_mode == "R3":
            extra_fields = result[5]
            routed = extra_fields.pop(ROUTED_EXPERTS_KEY, None) if isinstance(extra_fields, dict) else None
            if routed is not None:
                self._sampled_routing = [torch.as_tensor(r) for r in routed]
            if self._sampled_routing is None:
                raise RuntimeError(
                    "routing_replay='R3' got no routing from the sampler: the rollout_func must return "
                    f"'{ROUTED_EXPERTS_KEY}'."
                )
        return result

    # -- no-grad passes on a fresh batch (old-logprob / proximal)
    def _trl_computes_old_logps(self) -> bool:
        # The condition under which TRL 1.16's `_generate_and_score_completions` runs the old-logprob pass.
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        def run():
            return super(GRPORoutingReplayMixin, self)._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )

        if not self._routing_phase or torch.is_grad_enabled() or model is getattr(self, "ref_model", None):
            return run()
        if self._routing_calls and self._routing_calls.popleft() == "ref":
            return run()
        replay = self._routing_replay
        routing = self._routing_batch
        if routing is None and self._routing_mode == "R3":
            routing = batch_routing(self._sampled_routing, attention_mask, input_ids.shape[1] - logits_to_keep)
        if routing is None:  # R2: this is the pass the updates will be compared with
            with replay.record():
                out = run()
            routing = mask_routing(replay.export(dim="batch"), attention_mask)
            replay.clear()
        elif routing.shape[:2] != input_ids.shape:
            return run()  # not the batch the routing belongs to
        else:
            with replay.replay(routing):
                out = run()
            self._routing_log("routing/rollout_" if self._routing_mode == "R3" else "routing/proximal_")
        self._routing_batch = routing
        if self._routing_output is not None:  # a pass run after the batch dict was built (by a subclass)
            self._routing_output[ROUTED_EXPERTS_KEY] = routing
        return out

    def _generate_and_score_completions(self, inputs):
        if self._routing_replay is None:
            return super()._generate_and_score_completions(inputs)
        peft_reference = self.beta != 0.0 and getattr(self, "ref_model", None) is None
        self._routing_calls = deque(["old"] * self._trl_computes_old_logps() + ["ref"] * peft_reference)
        self._routing_phase, self._routing_batch, self._routing_output = True, None, None
        try:
            output = super()._generate_and_score_completions(inputs)
        except BaseException:
            self._end_routing_phase()
            raise
        self._routing_calls.clear()
        routing = self._routing_batch
        if routing is None and self._routing_mode == "R3":
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            routing = batch_routing(self._sampled_routing, attention_mask, output["prompt_ids"].shape[1])
            self._routing_batch = routing
        if routing is not None:
            output[ROUTED_EXPERTS_KEY] = routing
        self._routing_output = output
        return output

    def _end_routing_phase(self) -> None:
        self._routing_phase, self._routing_batch, self._routing_output = False, None, None
        self._routing_calls.clear()
        self._sampled_routing = None

    # -- the update passes
    def _compute_loss(self, model, inputs):
        if self._routing_replay is None:
            return super()._compute_loss(model, inputs)
        self._end_routing_phase()
        routing = inputs.get(ROUTED_EXPERTS_KEY)
        if routing is None:
            return super()._compute_loss(model, inputs)
        with self._routing_replay.replay(routing):
            loss = super()._compute_loss(model, inputs)
        self._routing_log("routing/")
        return loss
