"""The sampler's own per-token log-probs under HF `generate` (vLLM returns them itself), for the decoupled loss and
the mismatch monitor: read after temperature, top-k, top-p, min-p and repetition penalty, as the sampler draws."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from trl_stable.integration.patching import wrapped_method


class SamplerLogprobRecorder:
    """Logits processor placed last in `generate`'s chain, recording the log-prob of each sampled token; it keeps
    one [B, V] step: the token drawn at step t is read from `input_ids` at t + 1, the last from the completions."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []
        self._last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self._last is not None:
            self.steps.append(self._last.gather(1, input_ids[:, -1:].to(self._last.device)).squeeze(1))
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def per_token_logps(self, completion_ids: list[list[int]]) -> list[list[float]]:
        if self._last is None:
            return [[] for _ in completion_ids]
        n = len(self.steps) + 1
        last_tokens = torch.tensor(
            [ids[n - 1] if len(ids) >= n else 0 for ids in completion_ids], device=self._last.device
        )
        last = self._last.gather(1, last_tokens.unsqueeze(1)).squeeze(1)
        table = torch.stack([*self.steps, last], dim=1).cpu()
        return [table[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]


@contextmanager
def record_sampler_logps(model):
    """Record the per-token log-probs `model.generate` samples with: `generate` puts user processors *before* its
    warpers, so the recorder is appended to the list it builds (an instance patch of `_get_logits_processor`)."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    recorder = SamplerLogprobRecorder()

    def with_recorder(original):
        def _get_logits_processor(*args, **kwargs):
            processors = original(*args, **kwargs)
            processors.append(recorder)
            return processors

        return _get_logits_processor

    with wrapped_method(target, "_get_logits_processor", with_recorder):
        yield recorder
