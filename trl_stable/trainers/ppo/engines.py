"""PPOTrainer under the engines `Trainer` sets up through accelerate (DDP, DeepSpeed ZeRO-1/2/3, FSDP2), read from
Trainer's `is_deepspeed_enabled` / `is_fsdp_enabled` and accelerate's plugins (docs/ppo.md, "Multi-process")."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation


def is_zero3(trainer: Any) -> bool:
    return trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3


def require_deepspeed_if_asked() -> None:
    """Raise a clear ImportError when accelerate was asked for DeepSpeed but deepspeed is not installed."""
    asked = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")
    if asked and importlib.util.find_spec("deepspeed") is None:
        raise ImportError(
            "The accelerate config asks for DeepSpeed (distributed_type: DEEPSPEED) but deepspeed is not installed: "
            "`pip install deepspeed`, or launch with examples/accelerate_configs/multi_gpu.yaml or fsdp.yaml."
        )


def check_engine(trainer: Any, *, quantized: bool) -> None:
    """Refuse, naming the fix, what PPOTrainer cannot run under the trainer's engine."""
    args, deepspeed, fsdp = trainer.args, trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled
    name = "DeepSpeed" if deepspeed else "FSDP"
    if args.n_gpu > 1:
        raise ValueError(
            f"PPOTrainer does not run under nn.DataParallel ({args.n_gpu} GPUs in one process): use `accelerate "
            "launch` (examples/accelerate_configs/multi_gpu.yaml), or make one GPU visible (CUDA_VISIBLE_DEVICES)."
        )
    if fsdp and int(getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)) == 1:
        raise ValueError(
            "PPOTrainer supports FSDP2 only (FSDP1 cannot generate through a policy that is not the FSDP root): set "
            "`fsdp_version: 2` in the accelerate config (examples/accelerate_configs/fsdp.yaml)."
        )
    if quantized and (deepspeed or fsdp):
        raise ValueError(
            f"load_in_4bit/load_in_8bit place the model with a device map, which {name} cannot shard or wrap: train "
            "the quantized policy with DDP (examples/accelerate_configs/multi_gpu.yaml) or turn quantization off."
        )
    if args.num_shared_layers is not None and (fsdp or is_zero3(trainer)):
        raise ValueError(
            f"num_shared_layers shares the policy's first layers with the reference, which {name} shards apart: set "
            "`num_shared_layers=None`."
        )
    if args.early_stopping and args.target_kl is not None and deepspeed:
        raise ValueError(
            "early_stopping skips an optimizer step after its backward passes, but DeepSpeed steps inside the last "
            "backward: set `early_stopping=False` (or `target_kl=None`), or use DDP / FSDP."
        )


def configure_deepspeed(accelerator: Any) -> None:
    """Under ZeRO-3, gather the 16-bit weights when the model is saved (the full policy and value head are written)."""
    if accelerator.state.deepspeed_plugin.zero_stage == 3:
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True


def prepare_reference(trainer: Any, ref_model: nn.Module) -> nn.Module:
    """Place the frozen reference model the way TRL's GRPO does for the engine in use."""
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(ref_model, trainer.accelerator)
    if trainer.is_fsdp_enabled:
        return prepare_fsdp(ref_model, trainer.accelerator)
    return ref_model.to(trainer.accelerator.device)


@contextmanager
def generation_call(trainer: Any, policy: nn.Module) -> Iterator[Callable[..., torch.Tensor]]:
    """The policy's `generate` with the full parameters available: TRL's `unwrap_model_for_generation` under ZeRO-3,
    through the FSDP2 root's forward (which holds the value head too) under FSDP, for the life of the context."""
    if is_zero3(trainer):
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
            yield unwrapped.policy.generate
    elif trainer.is_fsdp_enabled:

        def through_root(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            kwargs.setdefault("synced_gpus", trainer.accelerator.num_processes > 1)
            return trainer.model_wrapped(input_ids=input_ids, attention_mask=attention_mask, generation_kwargs=kwargs)

        yield through_root
    else:
        yield policy.generate
