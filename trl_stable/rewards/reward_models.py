"""Reward models (sequence classifiers) as reward functions, scored as TRL's GRPO scores them: GRPO leaves them to
TRL, PPOTrainer repeats TRL's steps here (a test scores one model through both trainers), so the numbers agree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer


def prepare_reward_model(model: nn.Module, processing_class: Any | None, policy_tokenizer: Any) -> Any:
    """The tokenizer `model` is scored with, as TRL's GRPO resolves it: `processing_class`, else loaded from the
    model's name; a model without a name (built in memory) takes the policy's tokenizer when their vocabularies agree.
    Sets a missing pad token to EOS and the model's `pad_token_id` to the tokenizer's (the classifier reads the last
    non-padding token).

    Raises:
        ValueError: for a nameless model whose vocabulary is not the policy's, naming the fix.
    """
    if processing_class is None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
        if name:
            processing_class = AutoTokenizer.from_pretrained(name)
        elif getattr(model.config, "vocab_size", None) in (None, len(policy_tokenizer)):
            processing_class = policy_tokenizer
        else:
            raise ValueError(
                f"The reward model {type(model).__name__} has no name to load its tokenizer from and a vocabulary of "
                f"{model.config.vocab_size} tokens, not the policy tokenizer's {len(policy_tokenizer)}: pass its "
                "tokenizer in reward_processing_classes."
            )
    if processing_class.pad_token_id is None:
        processing_class.pad_token = processing_class.eos_token
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.pad_token_id = processing_class.pad_token_id
    return processing_class


def reward_model_scores(
    model: nn.Module,
    processing_class: Any,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Logit 0 of `model` on each prompt + completion, [N] float32 on the model's device (TRL's reward-model branch).

    Args:
        prompts: Text prompts, or chat prompts (lists of messages).
        completions: The completions: texts, or for chat prompts lists of messages (``[{"role": "assistant",
            "content": ...}]``), as TRL passes them.
        chat_template_kwargs: Extra arguments of the chat template.
    """
    from trl.data_utils import apply_chat_template, is_conversational

    if is_conversational({"prompt": prompts[0]}):
        messages = [{"messages": p + c} for p, c in zip(prompts, completions, strict=True)]
        texts = [apply_chat_template(x, processing_class, **(chat_template_kwargs or {}))["text"] for x in messages]
    else:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    inputs = processing_class(
        text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    with torch.inference_mode():
        return model(**inputs.to(next(model.parameters()).device)).logits[:, 0].float()
