"""PPO's rollouts: the record `PPOTrainer.generate` hands to its step, the chunk sampler through HF `generate`
(without vLLM: left-padded chunks sampled with the engine's full parameters, the sampler's log-probs and MoE routing
(R3) recorded; responses are cut after EOS), and the generation-length sampler of RELC-era scripts."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from trl.trainer.utils import pad

from trl_stable.trainers.ppo.engines import generation_call
from trl_stable.trainers.prompt_checks import first_error, too_long_error
from trl_stable.trainers.sampler_logprobs import record_sampler_logps


class LengthSampler:
    """Draw a generation length uniformly from [min_value, max_value] (inclusive), as RELC's scripts did."""

    def __init__(self, min_value: int, max_value: int, generator: torch.Generator | None = None):
        if not 0 <= min_value <= max_value:
            raise ValueError(f"LengthSampler needs 0 <= min_value <= max_value, got {min_value}, {max_value}.")
        self.min_value, self.max_value, self.generator = min_value, max_value, generator

    def __call__(self) -> int:
        return int(torch.randint(self.min_value, self.max_value + 1, (1,), generator=self.generator).item())


class Rollout(list):
    """What `PPOTrainer.generate` sampled: a list of response tensors (what old TRL returned) that also carries what
    the step needs from the sampler.

    Attributes:
        queries: The prompts the responses were sampled from (1-D LongTensors).
        sampler_logprobs: Per response, the sampler's log-prob of each token; None when not recorded.
        routing: Per sample, the sampler's MoE routing of its query + response ([tokens, layers, k], R3), or None.
        with_prompt: Whether each entry is query + response (``generate(return_prompt=True)``).
    """

    def __init__(
        self,
        sequences: Sequence[torch.Tensor],
        queries: Sequence[torch.Tensor],
        sampler_logprobs: Sequence[torch.Tensor] | None = None,
        routing: Sequence[torch.Tensor] | None = None,
        with_prompt: bool = False,
    ):
        super().__init__(sequences)
        self.queries = list(queries)
        self.sampler_logprobs = None if sampler_logprobs is None else list(sampler_logprobs)
        self.routing = None if routing is None else list(routing)
        self.with_prompt = with_prompt


def trim_response(response: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """`response` cut after its first EOS (kept)."""
    eos = (response == eos_token_id).nonzero()
    # without EOS there is no padding: generate pads only after a finished sequence (a sampled pad token is an action)
    return response[: int(eos[0]) + 1] if len(eos) else response


@contextmanager
def hf_sampler(trainer: Any, generation_kwargs: dict[str, Any]) -> Iterator[Callable[..., tuple]]:
    """`PPOTrainer.generate`'s chunk sampler through the policy's own `generate`, with the engine's full parameters,
    the policy in eval mode and no grad for the life of the context: ``sample(start, queries, max_new_tokens)``
    (None: the configured cap) returns each query's completion, its sampler log-probs (decoupled loss) and its
    routing (R3), or None for those not recorded."""
    args = trainer.args
    kwargs = {"do_sample": True, "top_k": args.top_k, "top_p": args.top_p, "temperature": args.temperature}
    kwargs.update(max_new_tokens=args.max_new_tokens, pad_token_id=trainer.pad_token_id)
    kwargs.update({"eos_token_id": trainer.eos_token_id, **(args.generation_kwargs or {}), **generation_kwargs})
    capture, replay = args.use_decoupled_loss, trainer.routing.mode == "R3"
    policy = trainer.unwrapped().policy
    fix = "Shorten the queries (train() cuts prompts to max_prompt_length) or lower max_new_tokens."

    def sample(start: int, batch: list[torch.Tensor], max_new_tokens: int | None) -> tuple:
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        lengths, where = [len(q) for q in batch], lambda i: f"query {start + i}"
        cap = kwargs["max_new_tokens"]
        too_long = first_error(too_long_error(c, lengths, cap, where, fix) for c in trainer.model_contexts)
        if too_long is not None:
            raise too_long
        input_ids = pad(batch, trainer.pad_token_id, padding_side="left")
        attention_mask = pad([torch.ones_like(q) for q in batch], padding_side="left")
        record = record_sampler_logps(policy) if capture else nullcontext()
        with trainer.routing.sampling() as sampled, record as recorder:
            generated = generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[:, input_ids.shape[1] :]
        logps = recorder.per_token_logps(generated.tolist()) if capture else None
        routing = sampled.per_sequence(lengths, [generated.shape[1]] * len(batch)) if replay else None
        return list(generated), logps, routing

    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), trainer.accelerator.autocast(), generation_call(trainer, policy) as generate:
            yield sample
    finally:
        policy.train(was_training)
