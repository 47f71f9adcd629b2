"""`TransformersCritic`: a local causal LM as the critic (the policy itself, or any local model)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from trl_stable.rewards.critic.backend import CriticBackend

logger = logging.getLogger(__name__)


class TransformersCritic(CriticBackend):
    """A local causal LM as the critic: batched greedy decoding, left padding, prompts cut from the left (the text
    under critique ends them) to fit the context. A batch that raises gives None for its prompts.

    Args:
        model: A `PreTrainedModel` or a path/name for ``AutoModelForCausalLM.from_pretrained``.
        tokenizer: Its tokenizer (loaded from `model` when it is a path).
        batch_size: Prompts per `generate` call.
        max_new_tokens: Answer length limit.
        use_chat_template: Wrap each prompt as a user turn; None: when the tokenizer has a chat template.
        max_prompt_length: Prompt tokens kept; default: the model's context minus `max_new_tokens`.
    """

    name = "transformers"

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        batch_size: int = 8,
        max_new_tokens: int = 64,
        use_chat_template: bool | None = None,
        max_prompt_length: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model)
        if tokenizer is None:
            raise ValueError("TransformersCritic needs the model's tokenizer (tokenizer=...).")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_chat_template = has_template if use_chat_template is None else use_chat_template
        if max_prompt_length is None:
            config = getattr(model, "config", None)
            context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
            max_prompt_length = (context - max_new_tokens) if context else 2048
        if max_prompt_length < 1:
            raise ValueError("max_prompt_length must leave room for the prompt; lower max_new_tokens.")
        self.max_prompt_length = max_prompt_length

    def __repr__(self) -> str:
        return f"TransformersCritic(model={type(self.model).__name__}, batch_size={self.batch_size})"

    def _encode(self, prompt: str) -> list[int]:
        if self.use_chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return list(ids)[-self.max_prompt_length :]

    def _generate_batch(self, prompts: Sequence[str]) -> list[str]:
        import torch

        encoded = [self._encode(p) for p in prompts]
        width = max(len(e) for e in encoded)
        pad_id = self.tokenizer.pad_token_id
        pad_id = self.tokenizer.eos_token_id if pad_id is None else pad_id
        device = next(self.model.parameters()).device
        inputs = {
            "input_ids": torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded], device=device),
            "attention_mask": torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device),
        }
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = self.model.generate(
                    **inputs, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=pad_id
                )
        finally:
            self.model.train(was_training)
        return self.tokenizer.batch_decode(out[:, width:].tolist(), skip_special_tokens=True)

    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        answers: list[str | None] = []
        self.counters.add("requests", len(prompts))
        for start in range(0, len(prompts), self.batch_size):
            batch = list(prompts[start : start + self.batch_size])
            self.counters.add("attempts")
            try:
                answers.extend(self._generate_batch(batch))
                self.counters.add("successes", len(batch))
            except Exception as exc:  # noqa: BLE001 - a failed batch gives zero intrinsic reward, not a crash
                logger.warning("Local critic batch failed: %s: %s", type(exc).__name__, str(exc)[:200])
                self.counters.add("failures", len(batch))
                answers.extend([None] * len(batch))
        return answers
