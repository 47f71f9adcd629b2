"""Prompt checks both trainers run before they generate: no empty or missing prompt, and prompt + generation within
the model's context. Past a *learned* position table (GPT-2, OPT) a sequence fails inside the embedding, so it is
refused by name; rotary or relative positions (Llama, Qwen) run past it, with a warning at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


# Config attributes that hold the context length, in the order transformers' model families use them.
CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


@dataclass(frozen=True)
class ModelContext:
    """The positions a model covers: the declared `limit` (or None), its `source` (``"config.n_positions"``), and
    whether a `learned` position table of `limit` rows makes a longer sequence fail."""

    limit: int | None
    source: str = ""
    learned: bool = False

    def describe(self) -> str:
        kind = (
            "a learned position table: a longer sequence fails with an IndexError"
            if self.learned
            else "positions past it are ones the model was not trained on"
        )
        return f"the model's context of {self.limit} positions ({self.source}; {kind})"


def model_context(model: nn.Module) -> ModelContext:
    """The context `model` declares; learned when an `nn.Embedding` besides the token embedding has `limit` rows
    (OPT and BioGPT keep two more, for their position offset)."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in CONTEXT_ATTRIBUTES:
        limit = getattr(config, name, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            break
    else:
        return ModelContext(None)
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    learned = any(
        isinstance(module, nn.Embedding) and module is not tokens and limit <= module.num_embeddings <= limit + 2
        for module in model.modules()
    )
    return ModelContext(limit, f"config.{name}", learned)


def check_generation_budget(
    context: ModelContext, generation_tokens: int | None, field: str, prompt_tokens: int | None = None
) -> None:
    """Start-up check of `generation_tokens` (the setting `field`) and the longest prompt the config keeps
    (`prompt_tokens`, or None) against the context: ValueError on a learned table the generation alone fills."""
    if context.limit is None or generation_tokens is None:
        return
    if generation_tokens >= context.limit:
        message = (
            f"{field}={generation_tokens} leaves no room for a prompt in {context.describe()}. Lower {field} below "
            f"{context.limit}."
        )
        if context.learned:
            raise ValueError(message)
        logger.warning(message)
    elif prompt_tokens is not None and prompt_tokens + generation_tokens > context.limit and not context.learned:
        logger.warning(
            f"max_prompt_length={prompt_tokens} + {field}={generation_tokens} exceeds {context.describe()}. Lower "
            f"max_prompt_length to {context.limit - generation_tokens} or less, or {field}."
        )


def empty_prompt_error(prompt: Any, where: str) -> ValueError | None:
    """The error for a prompt (text, chat messages or token ids) that is missing, of another type, or empty; None
    when it is fine. `where` names the sample (``"train_dataset row 7"``)."""
    if prompt is None:
        problem = "is None (a missing value)"
    elif isinstance(prompt, str):
        problem = "is an empty string" if not prompt else None
    elif isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
        problem = "is empty (no messages or token ids)" if len(prompt) == 0 else None
    else:
        problem = f"is a {type(prompt).__name__}, not text, chat messages or token ids"
    if problem is None:
        return None
    text = repr(prompt)
    shown = "" if prompt is None else f": {text if len(text) <= 80 else text[:77] + '...'}"
    return ValueError(
        f"The prompt of {where} {problem}{shown}. Every sample needs a prompt to generate from: drop or fill such "
        "rows (e.g. dataset.filter(lambda row: bool(row['prompt'])))."
    )


def too_long_error(
    context: ModelContext, lengths: Sequence[int], generation_tokens: int, where: Callable[[int], str], fix: str
) -> ValueError | None:
    """The error for the prompts whose length plus `generation_tokens` passes a learned position table (`where(i)`
    names sample i, `fix` ends the message); None when every prompt fits or positions are not learned."""
    if context.limit is None or not context.learned:
        return None
    longest = context.limit - generation_tokens
    over = [i for i, n in enumerate(lengths) if n > longest]
    if not over:
        return None
    shown = ", ".join(f"{where(i)} ({lengths[i]} tokens)" for i in over[:3])
    more = f" and {len(over) - 3} more" if len(over) > 3 else ""
    return ValueError(
        f"{shown}{more}: with {generation_tokens} generated tokens the sequence passes {context.describe()}; a "
        f"prompt may have at most {longest} tokens. {fix}"
    )


def check_prompt_column(
    dataset: Any, column: str = "prompt", name: str = "train_dataset", alternatives: Sequence[str] = ()
) -> None:
    """Raise `empty_prompt_error` for the first row whose `column` is missing or empty, or a ValueError when
    `dataset` has neither `column` nor one of `alternatives`; datasets without named columns are checked per batch."""
    columns = list(getattr(dataset, "column_names", None) or ())
    if columns and column not in columns and not set(alternatives) & set(columns):
        wanted = " or ".join(repr(c) for c in (column, *alternatives))
        raise ValueError(
            f"{name} has no {wanted} column (its columns: {', '.join(columns)}); every row's {column!r} is what the "
            f"trainer generates from. Rename the column holding the prompts, e.g. "
            f"{name}.rename_column({columns[0]!r}, {column!r})."
        )
    if column in columns:
        error = first_error(empty_prompt_error(prompt, f"{name} row {i}") for i, prompt in enumerate(dataset[column]))
        if error is not None:
            raise error


def first_error(errors: Iterable[ValueError | None]) -> ValueError | None:
    return next((e for e in errors if e is not None), None)
