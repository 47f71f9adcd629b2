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
from collections import deque
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
