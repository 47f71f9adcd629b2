"""PPOTrainer under accelerate's engines (DDP, DeepSpeed ZeRO-1/2/3, FSDP2, set up by `Trainer`): generation with
the full parameters, the reference placed as TRL's GRPO places it, DeepSpeed's step inside the closing backward, and
what cannot work refused with the fix (docs/ppo.md, "Multi-process")."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Engine:
    """The engine accelerate runs the trainer under (`zero_stage` / `fsdp_version` None without DeepSpeed / FSDP)."""

    zero_stage: int | None = None
    fsdp_version: int | None = None
    num_processes: int = 1

    @classmethod
    def of(cls, accelerator: Any) -> Engine:
        ds_plugin, fsdp_plugin = (getattr(accelerator.state, f"{k}_plugin", None) for k in ("deepspeed", "fsdp"))
        zero_stage = int(ds_plugin.zero_stage) if ds_plugin is not None else None
        fsdp_version = int(getattr(fsdp_plugin, "fsdp_version", 1)) if fsdp_plugin is not None else None
        return cls(zero_stage, fsdp_version, int(accelerator.num_processes))

    @property
    def name(self) -> str:
        if self.zero_stage is not None:
            return f"deepspeed_zero{self.zero_stage}"
        if self.fsdp_version is not None:
            return f"fsdp{self.fsdp_version}"
        return "ddp" if self.num_processes > 1 else "single"

    @property
    def is_deepspeed(self) -> bool:
        return self.zero_stage is not None

    @property
    def is_zero3(self) -> bool:
        return self.zero_stage == 3

    @property
    def is_fsdp(self) -> bool:
        return self.fsdp_version is not None

    @property
    def shards_parameters(self) -> bool:
        """Whether a process holds only a shard of each parameter (ZeRO-3, FSDP): full weights need a collective."""
        return self.is_zero3 or self.is_fsdp


def require_deepspeed_if_asked() -> None:
    """Raise a clear ImportError when accelerate was asked for DeepSpeed but deepspeed is not installed."""
    asked = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")
    if asked and importlib.util.find_spec("deepspeed") is None:
        raise ImportError(
            "The accelerate config asks for DeepSpeed (distributed_type: DEEPSPEED) but deepspeed is not installed: "
            "`pip install deepspeed`, or launch with examples/accelerate_configs/multi_gpu.yaml or fsdp.yaml."
        )


def check_engine(engine: Engine, args: Any, *, quantized: bool) -> None:
    """Refuse, naming the fix, what PPOTrainer cannot run under `engine`."""
    if args.n_gpu > 1:
        raise ValueError(
            f"PPOTrainer does not run under nn.DataParallel ({args.n_gpu} GPUs in one process): launch one process "
            "per GPU with `accelerate launch` (examples/accelerate_configs/multi_gpu.yaml), or make one GPU visible "
            "(CUDA_VISIBLE_DEVICES)."
        )
    if engine.fsdp_version == 1:
        raise ValueError(
            "PPOTrainer supports FSDP2 only: set `fsdp_version: 2` in the accelerate config "
            "(examples/accelerate_configs/fsdp.yaml). FSDP1 cannot generate through the policy, which is not the "
            "FSDP root (the root also holds the value head)."
        )
    if quantized and (engine.is_deepspeed or engine.is_fsdp):
        raise ValueError(
            f"load_in_4bit/load_in_8bit place the model with a device map, which {engine.name} cannot shard or "
            "wrap: train the quantized policy with DDP (examples/accelerate_configs/multi_gpu.yaml) or turn "
            "quantization off."
        )
    if args.num_shared_layers is not None and engine.shards_parameters:
        raise ValueError(
            f"num_shared_layers shares the policy's first layers with the reference model, which {engine.name} "
            "cannot do (the policy's parameters are sharded by the engine that trains them, the reference's by "
            "another): set `num_shared_layers=None`."
        )
    if args.early_stopping and args.target_kl is not None and engine.is_deepspeed:
        raise ValueError(
            "early_stopping checks the policy KL after a mini-batch's backward passes and skips the optimizer "
            "step, but DeepSpeed steps inside the last backward: set `early_stopping=False` (or `target_kl=None`), "
            "or use DDP / FSDP."
        )


def configure_deepspeed(accelerator: Any) -> None:
    """Under ZeRO-3, gather the 16-bit weights when the model is saved (the full policy and value head are written)."""
    if accelerator.state.deepspeed_plugin.zero_stage == 3:
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True


def sync_gradients(accelerator: Any, engine: Engine, last_micro_batch: bool) -> None:
    """Under DeepSpeed, tell `accelerator.backward` whether this micro-batch closes an optimizer step (PPO counts its
    micro-batches itself, without `accelerator.accumulate`)."""
    if engine.is_deepspeed:
        accelerator.gradient_state._set_sync_gradients(last_micro_batch)


def prepare_reference(ref_model: nn.Module, accelerator: Any, engine: Engine) -> nn.Module:
    """Place the frozen reference model the way TRL's GRPO does for the engine in use."""
    if engine.is_deepspeed:
        from trl.models import prepare_deepspeed

        return prepare_deepspeed(ref_model, accelerator)
    if engine.is_fsdp:
        from trl.models import prepare_fsdp

        return prepare_fsdp(ref_model, accelerator)
    return ref_model.to(accelerator.device)


@contextmanager
def generation_call(
    model_wrapped: nn.Module, policy: nn.Module, accelerator: Any, engine: Engine
) -> Iterator[Callable[..., torch.Tensor]]:
    """The policy's `generate` with the full parameters available: TRL's `unwrap_model_for_generation` under ZeRO-3,
    through the FSDP2 root's forward (which holds the value head too) under FSDP, for the life of the context."""
    if engine.is_zero3:
        from trl.models import unwrap_model_for_generation

        with unwrap_model_for_generation(model_wrapped, accelerator) as unwrapped:
            yield unwrapped.policy.generate
    elif engine.is_fsdp:

        def through_root(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            kwargs.setdefault("synced_gpus", engine.num_processes > 1)
            return model_wrapped(input_ids=input_ids, attention_mask=attention_mask, generation_kwargs=kwargs)

        yield through_root
    else:
        yield policy.generate


def is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned `model`'s parameters as it was built (``zero3_init_flag``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())
