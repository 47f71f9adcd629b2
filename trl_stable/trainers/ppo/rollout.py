"""The rollout record PPO's generation hands to its step, and the generation-length sampler of RELC-era scripts."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
