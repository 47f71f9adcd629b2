"""Tiny models and a tokenizer built locally in seconds, for tests, examples and benchmarks (no hub access).

>>> from trl_stable.testing import build_tokenizer, build_causal_lm
>>> tokenizer = build_tokenizer()
>>> model = build_causal_lm("qwen3_moe", tokenizer, seed=0)
"""

from trl_stable.testing.kit import (
    CAUSAL_LM_FAMILIES,
    MOE_FAMILIES,
    build_causal_lm,
    build_reward_model,
    build_tokenizer,
    save_tiny,
    tiny_config,
)

__all__ = [
    "CAUSAL_LM_FAMILIES",
    "MOE_FAMILIES",
    "build_causal_lm",
    "build_reward_model",
    "build_tokenizer",
    "save_tiny",
    "tiny_config",
]
