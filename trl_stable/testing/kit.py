"""Builders of the tiny test models, from configs and a tokenizer trained on an embedded text (so everything runs
with ``HF_HUB_OFFLINE=1``); given a seed, every builder is deterministic."""

from __future__ import annotations

import functools
import os
from importlib import resources
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS = ["<|im_start|>"]

# ChatML-style: every turn ends with EOS, so generation stops at the end of the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|endoftext|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# family (its model_type) -> config fields. Sizes are the smallest that still exercise every code path
# (grouped-query attention, shared experts, group-limited routing, ...).
_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
_MOE = {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2}
_FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 256},
    "llama": _DECODER,
    "qwen2": _DECODER,
    "qwen3": {**_DECODER, "head_dim": 8},
    "qwen2_moe": {**_MOE, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "norm_topk_prob": False},
    "qwen3_moe": {**_MOE, "moe_intermediate_size": 16, "norm_topk_prob": True},
    "mixtral": {
        **_DECODER,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_jitter_noise": 0.1,
    },
    "olmoe": {**_MOE, "intermediate_size": 16, "norm_topk_prob": False},
    "deepseek_v3": {
        **_DECODER,
        "moe_intermediate_size": 16,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
    },
}

CAUSAL_LM_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)
MOE_FAMILIES: tuple[str, ...] = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3")


def corpus() -> str:
    """The embedded training text of the tiny tokenizer (written for this project)."""
    return resources.files("trl_stable.testing").joinpath("corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown token
        show_progress=False,
    )
    tok.train_from_iterator([line for line in corpus().splitlines() if line.strip()] * 2, trainer=trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int = 1024, padding_side: str = "left") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained locally on the embedded corpus.

    It has pad, bos and eos tokens and a ChatML-style chat template, encodes any unicode text (byte fallback)
    and returns character offsets (``return_offsets_mapping=True``). Deterministic: the same `vocab_size`
    always gives the same vocabulary.

    Args:
        vocab_size: Size of the BPE vocabulary, special tokens included.
        padding_side: "left" (what generation wants) or "right".
    """
    backend = Tokenizer.from_str(_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=CHAT_TOKENS,
        padding_side=padding_side,
        model_max_length=256,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(family: str, tokenizer: PreTrainedTokenizerFast | None = None, **overrides: Any):
    """The config of a tiny `family` model whose vocabulary matches `tokenizer`.

    Args:
        family: One of `CAUSAL_LM_FAMILIES`.
        tokenizer: Defaults to `build_tokenizer()`.
        overrides: Config fields to change (e.g. ``num_hidden_layers=4``).
    """
    if family not in _FAMILIES:
        raise ValueError(f"Unknown family {family!r}. Choose one of {', '.join(CAUSAL_LM_FAMILIES)}.")
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    kwargs = {
        **_FAMILIES[family],
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": True,
        **overrides,
    }
    return AutoConfig.for_model(family, **kwargs)


def build_causal_lm(
    family: str = "qwen2",
    tokenizer: PreTrainedTokenizerFast | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM of `family`, deterministic given `seed`."""
    config = tiny_config(family, tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):  # neither depends on nor disturbs the caller's RNG state
        torch.manual_seed(seed)
        # the generation config takes its pad, eos and bos ids from `config` (GenerationConfig.from_model_config)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_reward_model(
    family: str = "gpt2",
    tokenizer: PreTrainedTokenizerFast | None = None,
    seed: int = 0,
    num_labels: int = 1,
    **overrides: Any,
) -> PreTrainedModel:
    """A tiny randomly initialised sequence-classification model (a reward model with `num_labels` outputs).

    Returned in eval mode (dropout off), as a reward model is used for scoring.
    """
    from transformers import AutoModelForSequenceClassification

    config = tiny_config(family, tokenizer, num_labels=num_labels, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForSequenceClassification.from_config(config).eval()


def save_tiny(path: str | os.PathLike, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> str:
    """Save `model` and `tokenizer` to `path` so ``from_pretrained(path)`` loads them back; returns the path."""
    path = os.fspath(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
