"""PPO's rollouts through HF `generate` (`PPOTrainer.generate` without vLLM): left-padded chunks sampled with the
engine's full parameters, responses cut after EOS, the sampler's log-probs and MoE routing (R3) recorded."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from trl.trainer.utils import pad

from trl_stable.trainers.ppo.engines import generation_call
from trl_stable.trainers.ppo.rollout import Rollout
from trl_stable.trainers.prompt_checks import first_error, too_long_error
from trl_stable.trainers.sampler_logprobs import record_sampler_logps


def trim_response(response: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """`response` cut after its first EOS (kept)."""
    eos = (response == eos_token_id).nonzero()
    # without EOS there is no padding: generate pads only after a finished sequence (a sampled pad token is an action)
    return response[: int(eos[0]) + 1] if len(eos) else response


def hf_rollout(
    trainer: Any,
    queries: list[torch.Tensor],
    chunk: int,
    length_sampler: Callable[[], int] | None,
    return_prompt: bool,
    generation_kwargs: dict[str, Any],
) -> Rollout:
    """`PPOTrainer.generate` through the policy's own `generate`, `chunk` queries at a time."""
    args, device = trainer.args, trainer.accelerator.device
    kwargs = {"do_sample": True, "top_k": args.top_k, "top_p": args.top_p, "temperature": args.temperature}
    kwargs.update(max_new_tokens=args.max_new_tokens, pad_token_id=trainer.pad_token_id)
    kwargs.update({"eos_token_id": trainer.eos_token_id, **(args.generation_kwargs or {}), **generation_kwargs})
    capture, replay = args.use_decoupled_loss, trainer.routing.mode == "R3"
    policy = trainer.unwrapped().policy
    sequences, sampler_logps, routing = [], [], []
    was_training = policy.training
    policy.eval()
    engine_call = generation_call(trainer, policy)
    try:
        with torch.no_grad(), trainer.accelerator.autocast(), engine_call as sample:
            for start in range(0, len(queries), chunk):
                batch = [q.to(device).long() for q in queries[start : start + chunk]]
                if length_sampler is not None:
                    kwargs["max_new_tokens"] = max(1, int(length_sampler()))
                lengths, where = [len(q) for q in batch], lambda i, start=start: f"query {start + i}"
                fix = "Shorten the queries (train() cuts prompts to max_prompt_length) or lower max_new_tokens."
                too_long = first_error(
                    too_long_error(c, lengths, kwargs["max_new_tokens"], where, fix) for c in trainer.model_contexts
                )
                if too_long is not None:
                    raise too_long
                input_ids = pad(batch, trainer.pad_token_id, padding_side="left")
                attention_mask = pad([torch.ones_like(q) for q in batch], padding_side="left")
                record = record_sampler_logps(policy) if capture else nullcontext()
                with trainer.routing.sampling() as sampled, record as recorder:
                    generated = sample(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
                generated = generated[:, input_ids.shape[1] :]
                responses = [trim_response(row, trainer.eos_token_id) for row in generated]
                if capture:
                    rows = recorder.per_token_logps(generated.tolist())
                    sampler_logps += [torch.tensor(lp[: len(r)]) for lp, r in zip(rows, responses)]
                if replay:
                    per_sequence = sampled.per_sequence([len(q) for q in batch], [generated.shape[1]] * len(batch))
                    routing += [seq[: len(q) + len(r)] for seq, q, r in zip(per_sequence, batch, responses)]
                sequences += [torch.cat([q, r]) if return_prompt else r for q, r in zip(batch, responses)]
    finally:
        policy.train(was_training)
    logps, routes = (sampler_logps if capture else None), (routing if replay else None)
    return Rollout(sequences, queries, sampler_logprobs=logps, routing=routes, with_prompt=return_prompt)
