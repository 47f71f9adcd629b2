"""The policy of a research script: the embedded tiny policy, or a hub model (by name) and its tokenizer."""

from __future__ import annotations

from embedded import embedded_policy, use_one_thread


def hub_tokenizer(model_name: str, padding_side: str | None = "left"):
    """The tokenizer of `model_name`, padding with EOS when it has no pad token; generation pads on the left
    (`padding_side=None` keeps the tokenizer's own side)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    return tokenizer


def load_policy(model_name: str | None, seed: int, run, task: str, embedded: bool):
    """(model or model name, tokenizer) of the policy for the mode. `run` holds the embedded policy's settings
    (`embedded_layers`, `embedded_hidden_size`, `embedded_warmup_steps`; None: `embedded_policy`'s defaults)."""
    if embedded:
        use_one_thread()
    if embedded and model_name is None:
        settings = {}
        if run is not None:
            settings = dict(
                num_layers=run.embedded_layers,
                hidden_size=run.embedded_hidden_size,
                warmup_steps=run.embedded_warmup_steps,
            )
        return embedded_policy(task, seed=seed, **settings)
    return model_name, hub_tokenizer(model_name)
