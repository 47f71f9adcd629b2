"""Shared pieces of the GPU checks run by `scripts/gpu_check.sh`: the scaled-up tiny kit, the SKIP convention.

A check exits 0 for PASS, `SKIP_EXIT` (77, automake's convention) for SKIP, anything else for FAIL; its last line of
output is the reason `gpu_check.sh` prints. Models come from `trl_stable.testing` (no hub access).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

SKIP_EXIT = 77
# The tiny kit scaled up: big enough for vLLM's and bitsandbytes' kernels (head_dim 64, 4-bit blocks), small enough
# to build in seconds.
SCALED = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)
PROMPTS = ["The movie was", "A story about", "I think that", "We saw the"] * 4


def skip(reason: str) -> None:
    print(f"SKIP: {reason}", flush=True)
    sys.exit(SKIP_EXIT)


def need(*modules: str) -> None:
    """Skip unless every module is importable (nothing is installed: the machine may have no hub access)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        skip(f"{', '.join(missing)} not installed")


def need_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        skip("no CUDA device")


def scaled_model_dir(family: str = "qwen2", **overrides) -> str:
    """Save the scaled-up tiny `family` model and its tokenizer into a fresh folder; returns its path."""
    from trl_stable.testing import build_causal_lm, build_tokenizer, save_tiny

    tokenizer = build_tokenizer()
    model = build_causal_lm(family, tokenizer, seed=0, **{**SCALED, **overrides})
    return save_tiny(tempfile.mkdtemp(prefix=f"gpu_check_{family}_"), model, tokenizer)


def length_reward(completion_ids, **kwargs):
    return [min(len(c), 8) / 8 for c in completion_ids]


def last_step(trainer) -> dict:
    """The last PPO step's log entry (after `train()`, Trainer's run summary is the very last one)."""
    return [entry for entry in trainer.state.log_history if "loss/total" in entry][-1]


def finite(stats: dict, *keys: str) -> None:
    import math

    bad = {k: stats.get(k) for k in keys if not (isinstance(stats.get(k), float) and math.isfinite(stats[k]))}
    if bad:
        raise AssertionError(f"non-finite or missing statistics: {bad}")
