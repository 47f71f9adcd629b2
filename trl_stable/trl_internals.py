"""Every private TRL / transformers member trl_stable relies on, named in one place, with what we rely on.

trl_stable extends `trl.GRPOTrainer` by overriding some of its private methods and reading some of its private
attributes; none of them is TRL's public API, and several changed signature or return arity between TRL releases.
This module lists them ([`GRPO_MEMBERS`], [`TRANSFORMERS_MEMBERS`], [`HELPER_MEMBERS`], and for PPO
[`PPO_MEMBERS`]), owns the small accessors that replace scattered private access (`log_metric`,
`replace_logged_advantages`, `reward_kwargs`, ...), and names the TRL logic trl_stable had to mirror because TRL
offers no helper ([`MIRRORED`]). `tests/test_trl_internals.py` checks every entry against
the installed TRL, so an upgrade fails there, naming the member, instead of deep inside a training step.

The TRL-imposed channel. TRL's `_generate_and_score_completions` calls `_calculate_rewards`, `_generate`,
`_generate_single_turn` and `_get_per_token_logps_and_entropies` and keeps what they return to itself (the batch dict
it returns has no rewards, no sampler routing). trl_stable's override therefore opens one per-call record
(`trl_stable.trainers.grpo.RolloutRecord`, a context manager, reset when the call ends, also on error) that those
hooks fill; nothing else carries one batch's values between methods.

The version gate (`trl_stable._compat`) stays: it turns an unsupported TRL into one clear ImportError at import time.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from trl_stable.core.positions import position_ids_from_mask

__all__ = [
    "GRPO_BATCH_KEYS",
    "CONFIG_NAME_ATTRIBUTE",
    "ENGINE_MEMBERS",
    "GRPO_MEMBERS",
    "GRPO_OPTIONAL_BATCH_KEYS",
    "HELPER_MEMBERS",
    "LOGPS_FORWARD_SNIPPETS",
    "MIRRORED",
    "REF_ADAPTER_NAME",
    "TRANSFORMERS_MEMBERS",
    "VLLM_MEMBERS",
    "Member",
    "Mirrored",
    "PPO_MEMBERS",
    "call_reward_func",
    "flush_reward_logs",
    "forward_kwargs",
    "is_reference_pass",
    "log_metric",
    "model_name_of",
    "multimodal_forward_keys",
    "replace_logged_advantages",
    "reward_event_loop",
    "reward_kwargs",
    "rng_state_file",
    "tokenizer_of",
    "train_mode",
    "wrapped_method",
    "with_mask_position_ids",
]


@dataclass(frozen=True)
class Member:
    """One private member of a TRL / transformers class that trl_stable uses.

    Attributes:
        owner: Dotted path of the class (``"trl.GRPOTrainer"``).
        name: The member's name.
        kind: "override" (trl_stable overrides it and calls ``super()``), "call" (trl_stable calls it), "attribute"
            (read on an instance) or "patch" (replaced on an instance for the duration of a call).
        params: For methods: the leading parameters (after ``self``) trl_stable passes or accepts, in order.
        returns: What trl_stable relies on in the return value (arity, type, keys).
        used_in: The trl_stable modules that use it.
    """

    owner: str
    name: str
    kind: str
    params: tuple[str, ...] = ()
    returns: str = ""
    used_in: tuple[str, ...] = ()


_GRPO = "trl.GRPOTrainer"
# The leading parameters of `_get_per_token_logps_and_entropies`; the ones after them are multimodal inputs.
_LOGPS_PARAMS = (
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
)
_TRAINER_PY = ("trl_stable/trainers/grpo/grpo_trainer.py",)
_CHECKPOINTS_PY = ("trl_stable/trainers/grpo/checkpoints.py",)

GRPO_MEMBERS: tuple[Member, ...] = (
    Member(
        _GRPO,
        "_generate_and_score_completions",
        "override",
        ("inputs",),
        "dict with GRPO_BATCH_KEYS (+ GRPO_OPTIONAL_BATCH_KEYS); every tensor of batch size B is shuffled and split "
        "by TRL's `_prepare_inputs`, so trl_stable may add batch-first keys",
        _TRAINER_PY,
    ),
    Member(
        _GRPO,
        "_generate",
        "override",
        ("prompts",),
        "8-tuple (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images); "
        "extra_fields (index 5) is a dict holding a rollout_func's extra keys; TRL later calls `_calculate_rewards` "
        "with the same prompts, completions (index 3) and completion ids (index 1), which early scoring relies on",
        _TRAINER_PY,
    ),
    Member(
        _GRPO,
        "_tokenize_prompts",
        "override",
        ("prompts",),
        "3-tuple (prompt_ids: list[list[int]], images, multimodal_fields); called once per generation batch, before "
        "generation, only when there is no rollout_func",
        _TRAINER_PY,
    ),
    Member(
        _GRPO,
        "_generate_single_turn",
        "override",
        ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
        "2-tuple (completion_ids: list[list[int]], logprobs: list[list[float]] | None)",
        _TRAINER_PY,
    ),
    Member(
        _GRPO,
        "_calculate_rewards",
        "override",
        ("inputs", "prompts", "completions", "completion_ids_list"),
        "[N_global, K] float tensor, gathered over processes, NaN where a function returned None",
        _TRAINER_PY,
    ),
    Member(
        _GRPO,
        "_get_per_token_logps_and_entropies",
        "override",
        _LOGPS_PARAMS,
        "3-tuple (logps [B, T], entropies | None, aux_loss | None); the parameters after compute_aux_loss are the "
        "multimodal forward keys (`multimodal_forward_keys`); `model` is only called, once per chunk, with the "
        "chunk's `input_ids` and `attention_mask` as keywords and no `position_ids` (`LOGPS_FORWARD_SNIPPETS`), so "
        "`with_mask_position_ids` can add them",
        _TRAINER_PY,
    ),
    Member(_GRPO, "_compute_loss", "override", ("model", "inputs"), "a scalar loss tensor", _TRAINER_PY),
    Member(_GRPO, "_log_completion_extra", "call", ("column", "values"), "", ("trl_stable/trl_internals.py",)),
    Member(_GRPO, "_log_metric", "call", ("name", "value"), "", ("trl_stable/trl_internals.py",)),
    # attributes, read on an instance (checked on a tiny trainer)
    Member(
        _GRPO,
        "_metrics",
        "attribute",
        returns='{"train"|"eval": defaultdict(list)} of scalar metrics, averaged by TRL\'s `log`',
        used_in=("trl_stable/trl_internals.py", "trl_stable/monitoring/integration.py"),
    ),
    Member(
        _GRPO,
        "_logs",
        "attribute",
        returns='dict with an "advantages" list: the completions table\'s advantage column',
        used_in=("trl_stable/trl_internals.py",),
    ),
    Member(
        _GRPO,
        "_pending_metrics",
        "attribute",
        returns="defaultdict(list): values reward functions logged with `log_metric`, flushed after the rewards",
        used_in=("trl_stable/trl_internals.py",),
    ),
    Member(
        _GRPO,
        "_pending_extra_logs",
        "attribute",
        returns="dict of columns reward functions logged with `log_extra`, flushed after the rewards",
        used_in=("trl_stable/trl_internals.py",),
    ),
    Member(_GRPO, "_tokenizer", "attribute", returns="the tokenizer (pad_token_id)", used_in=_TRAINER_PY),
    Member(
        _GRPO,
        "reward_funcs",
        "attribute",
        returns="the list `_calculate_rewards` reads when it calls the reward functions (nn.Modules scored by TRL, "
        "the rest called with TRL's keywords, async ones awaited): trl_stable swaps in contract-checking wrappers "
        "for the duration of that call (see MIRRORED)",
        used_in=_TRAINER_PY,
    ),
    Member(
        _GRPO,
        "async_loop",
        "attribute",
        returns="the event loop TRL runs async reward functions on (exists only when some reward function is async)",
        used_in=("trl_stable/trl_internals.py",),
    ),
    Member(
        _GRPO,
        "environments",
        "attribute",
        returns="per-rollout environment instances or None (passed to reward functions)",
        used_in=("trl_stable/trl_internals.py",),
    ),
    Member(
        _GRPO,
        "num_generations_eval",
        "attribute",
        returns="group size in evaluation",
        used_in=_TRAINER_PY,
    ),
    # checkpoints (TRL overrides transformers' `_save_checkpoint` to add its model card and extras)
    Member(
        _GRPO,
        "_save_checkpoint",
        "override",
        ("model", "trial"),
        "None; writes `checkpoint-{global_step}` under `_get_output_dir(trial)` (RNG file: `rng_state_file`) and "
        "rotates old checkpoints by `args.save_total_limit`, read inside this call",
        _CHECKPOINTS_PY,
    ),
    Member(_GRPO, "_get_output_dir", "call", ("trial",), "the folder checkpoints are written into", _CHECKPOINTS_PY),
)

TRANSFORMERS_MEMBERS: tuple[Member, ...] = (
    Member(
        "transformers.GenerationMixin",
        "_get_logits_processor",
        "patch",
        ("generation_config",),
        "a LogitsProcessorList; trl_stable appends its sampler-log-prob recorder last",
        ("trl_stable/sampler_logprobs.py",),
    ),
    Member(
        "transformers.trainer_utils",
        "rotate_checkpoints",
        "call",
        ("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime"),
        "None; deletes the oldest `checkpoint-*` folders beyond the limit (GRPO calls it after the marker)",
        ("trl_stable/trainers/grpo/checkpoints.py",),
    ),
    Member(
        "transformers.modeling_layers.GradientCheckpointingLayer",
        "__call__",
        "call",
        returns="the decoder-layer class whose forward is recomputed under gradient checkpointing",
        used_in=("trl_stable/moe/replay.py",),
    ),
)

# What trl_stable's own PPOTrainer takes from TRL and transformers beyond their top-level API: helpers of
# `trl.trainer.utils` and the `Trainer` plumbing of `transformers.trainer_callback` that `PPOPlumbing` drives itself.
_PPO = (
    "trl_stable/trainers/ppo/models.py",
    "trl_stable/trainers/ppo/plumbing.py",
    "trl_stable/trainers/ppo/rewards.py",
)
_PPO_TRAINER = ("trl_stable/trainers/ppo/ppo_trainer.py",)
PPO_MEMBERS: tuple[Member, ...] = (
    Member(
        "trl.trainer.utils",
        "selective_log_softmax_and_entropy",
        "call",
        ("logits", "index", "entropy_requires_grad", "temperature"),
        "2-tuple (token log-probs, entropy), both shaped like `index`",
        _PPO[:1],
    ),
    Member(
        "trl.trainer.utils",
        "disable_dropout_in_model",
        "call",
        ("model",),
        "None (sets every Dropout's p to 0)",
        _PPO[:1],
    ),  # fmt: skip
    Member("trl.trainer.utils", "get_callable_name", "call", ("func",), "the reward function's log name", _PPO[2:]),
    Member(
        "trl.trainer.utils",
        "generate_model_card",
        "call",
        ("base_model", "model_name", "hub_model_id", "dataset_name", "tags", "wandb_url", "trackio_url"),
        "a `huggingface_hub.ModelCard` (its `text` extended, then saved as README.md)",
        _PPO[1:2],
    ),
    Member(
        "transformers.trainer_callback.CallbackHandler",
        "__init__",
        "call",
        ("callbacks", "model", "processing_class", "optimizer", "lr_scheduler"),
        "a handler with on_train_begin / on_step_end / on_log / on_save / on_train_end and a `lr_scheduler` slot",
        _PPO[1:2],
    ),
    Member(
        "transformers.trainer_callback.TrainerState",
        "compute_steps",
        "call",
        ("args", "max_steps"),
        "sets logging_steps / save_steps / eval_steps from `args` (fractions of max_steps resolved)",
        _PPO[1:2],
    ),
    Member(
        "transformers.integrations",
        "get_reporting_integration_callbacks",
        "call",
        ("report_to",),
        "the callback classes of the `report_to` integrations",
        _PPO[1:2],
    ),
    Member(
        "transformers.Trainer",
        "_get_train_sampler",
        "override",
        ("train_dataset",),
        "the train sampler; for group_by_length a `LengthGroupedSampler` whose `lengths` and `generator` PPO reuses",
        _PPO_TRAINER,
    ),
    Member(
        "transformers.Trainer",
        "_get_eval_sampler",
        "call",
        ("eval_dataset",),
        "the evaluation sampler (None for a dataset without a length)",
        _PPO_TRAINER,
    ),
    Member(
        "transformers.trainer_pt_utils.LengthGroupedSampler",
        "__init__",
        "call",
        ("batch_size", "dataset", "lengths", "model_input_name", "generator"),
        "a sampler grouping rows of similar `lengths` into batches of `batch_size`",
        _PPO_TRAINER,
    ),
)
# TRL's vLLM helper, which PPO's vLLM rollouts drive as GRPO does (`trl_stable/trainers/ppo/vllm.py`).
_PPO_VLLM = ("trl_stable/trainers/ppo/vllm.py",)
_VLLM_GENERATION = "trl.generation.vllm_generation.VLLMGeneration"
VLLM_MEMBERS: tuple[Member, ...] = (
    Member(
        _VLLM_GENERATION,
        "__init__",
        "call",
        ("model", "accelerator", "processing_class", "mode"),
        "a helper holding the colocate engine in `llm` or the server client; keyword arguments as GRPOTrainer passes",
        _PPO_VLLM,
    ),
    Member(
        _VLLM_GENERATION,
        "generate",
        "call",
        ("prompts", "images", "num_generations"),
        "4-tuple (prompt_ids, completion_ids, logprobs [B][T][1] with None for NaN, logprob_token_ids)",
        _PPO_VLLM,
    ),
    Member(
        _VLLM_GENERATION, "sync_weights", "call", (), "None (gathers shards, merges LoRA, loads into vLLM)", _PPO_VLLM
    ),
    Member(
        _VLLM_GENERATION,
        "max_completion_length",
        "attribute",
        returns="set per call: `generate` reads it for vLLM's max_tokens",
        used_in=_PPO_VLLM,
    ),
    Member(
        _VLLM_GENERATION,
        "llm",
        "patch",
        returns="the colocate `vllm.LLM`; its `generate` is wrapped for one call to read `routed_experts` (R3)",
        used_in=_PPO_VLLM,
    ),
    Member(
        "trl.generation.vllm_generation",
        "LLM",
        "patch",
        returns="the engine class `_init_vllm` builds from; replaced while the helper is built, to pass "
        "`enable_return_routed_experts=True` (R3)",
        used_in=_PPO_VLLM,
    ),
)
# Helpers TRL keeps outside its top-level API that the rest of trl_stable calls or subclasses.
HELPER_MEMBERS: tuple[Member, ...] = (
    Member("trl.trainer.utils", "nanstd", "call", ("tensor",), "std ignoring NaN", _TRAINER_PY),
    Member(
        "trl.models.utils",
        "disable_gradient_checkpointing",
        "call",
        ("model", "gradient_checkpointing_kwargs"),
        "a context manager (the proximal forward runs without recomputation)",
        _TRAINER_PY,
    ),
    Member(
        "trl.trainer.utils",
        "is_async_callable",
        "call",
        ("func",),
        "bool",
        ("trl_stable/trl_internals.py", *_TRAINER_PY),
    ),
    Member(
        "trl.trainer.utils",
        "start_event_loop_in_daemon",
        "call",
        ("name",),
        "3-tuple (thread, loop, ready event)",
        ("trl_stable/trl_internals.py",),
    ),
    Member(
        "trl.trainer.utils",
        "shutdown_event_loop_in_daemon",
        "call",
        ("thread", "loop"),
        "None",
        ("trl_stable/trl_internals.py",),
    ),
    Member(
        "trl.trainer.sft_trainer.DataCollatorForLanguageModeling",
        "torch_call",
        "override",
        ("examples",),
        "a batch dict with `labels` (-100 where no loss); `padding_free` packs rows into one",
        ("trl_stable/masking/sft.py",),
    ),
)
# What PPOTrainer takes from TRL and accelerate to run under DeepSpeed / FSDP (`trl_stable.trainers.ppo.engines`):
# TRL's engine helpers of `trl.models` (exported there, outside TRL's documented API) and accelerate's private setter
# of the "this backward closes an optimizer step" flag that DeepSpeed's engine steps on.
_ENGINES_PY = ("trl_stable/trainers/ppo/engines.py",)
ENGINE_MEMBERS: tuple[Member, ...] = (
    Member(
        "trl.models",
        "unwrap_model_for_generation",
        "call",
        ("model", "accelerator"),
        "a context manager yielding the unwrapped module with ZeRO-3 parameters gathered (reads and toggles "
        "`is_gradient_checkpointing` / `gradient_checkpointing_disable` / `_enable` on it)",
        _ENGINES_PY,
    ),
    Member("trl.models", "prepare_deepspeed", "call", ("model", "accelerator"), "a DeepSpeed engine", _ENGINES_PY),
    Member("trl.models", "prepare_fsdp", "call", ("model", "accelerator"), "the FSDP-wrapped model", _ENGINES_PY),
    Member(
        "accelerate.state.GradientState",
        "_set_sync_gradients",
        "call",
        ("sync_gradients",),
        "None; `accelerator.backward` passes the flag to DeepSpeed as the accumulation boundary",
        _ENGINES_PY,
    ),
)
# `config._name_or_path`: the name a model was loaded from (PPO loads its tokenizer and names its reward models by it).
CONFIG_NAME_ATTRIBUTE = "_name_or_path"


def model_name_of(model: Any) -> str | None:
    """The name or path `model` was loaded from (its config's `CONFIG_NAME_ATTRIBUTE`), None when it has none."""
    return getattr(getattr(model, "config", None), CONFIG_NAME_ATTRIBUTE, None) or None


# Keys of TRL's `_generate_and_score_completions` output that trl_stable reads.
GRPO_BATCH_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "num_items_in_batch",
)
# Present only in some configurations: old logps (num_iterations > 1 or vLLM IS), sampler logps (vLLM, rollout_func,
# or HF generate recorded by trl_stable), reference logps (beta != 0), tool_mask (tools / env_mask), vLLM IS ratio.
GRPO_OPTIONAL_BATCH_KEYS = (
    "old_per_token_logps",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "tool_mask",
    "importance_sampling_ratio",
)

# TRL's name for the copy of the initial adapter it loads as the reference of a re-trained PEFT adapter.
REF_ADAPTER_NAME = "ref"


@dataclass(frozen=True)
class Mirrored:
    """TRL logic trl_stable had to repeat because TRL offers no helper: where it lives and the lines we mirror.

    The contract test asserts that every `snippets` line is still in the TRL member's source, so a TRL change to the
    mirrored logic fails there, naming `ours`.
    """

    ours: str
    trl_member: str
    snippets: tuple[str, ...]


MIRRORED: tuple[Mirrored, ...] = (
    Mirrored(
        "trl_stable.trainers.ppo.ppo_trainer.PPOTrainer.get_eval_dataloader",
        "transformers.Trainer._get_dataloader",
        (
            '"num_workers": self.args.dataloader_num_workers,',
            '"pin_memory": self.args.dataloader_pin_memory,',
            '"persistent_workers": self.args.dataloader_persistent_workers,',
            '"multiprocessing_context": self.args.dataloader_multiprocessing_context,',
            '"prefetch_factor": self.args.dataloader_prefetch_factor,',
            '"in_order": self.args.dataloader_in_order,',
            'dataloader_params["drop_last"] = self.args.dataloader_drop_last',
            "dataloader = self.accelerator.prepare(DataLoader(dataset, **dataloader_params))",
        ),
    ),
    Mirrored(
        "trl_stable.trainers.ppo.ppo_trainer.PPOTrainer.update (sync_each_batch)",
        "transformers.Trainer._run_epoch",
        ('self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)',),
    ),
    Mirrored(
        "trl_stable.trl_internals.reward_kwargs",
        "trl.GRPOTrainer._calculate_rewards",
        (
            'keys = [key for key in inputs[0] if key not in ["prompt", "completion", "completion_ids"]]',
            'reward_kwargs["trainer_state"] = self.state',
            'reward_kwargs["log_extra"] = self._log_completion_extra',
            'reward_kwargs["log_metric"] = self._log_metric',
            'reward_kwargs["environments"] = self.environments',
        ),
    ),
    Mirrored(
        "trl_stable.trl_internals.call_reward_func",
        "trl.GRPOTrainer._calculate_rewards",
        ("asyncio.run_coroutine_threadsafe(_run_async_funcs(), self.async_loop).result()",),
    ),
    Mirrored(
        "trl_stable.trl_internals.flush_reward_logs",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "for column in sorted(set(gather_object(list(self._pending_extra_logs)))):",
            "values = self._pending_extra_logs.get(column, [None] * len(prompts))",
            'self._logs["extra"][column].extend(gather_object(values))',
        ),
    ),
    Mirrored(
        # TRL's mean over every call, kept for the metrics trl_stable has no other reduction for
        "trl_stable.trl_internals.flush_reward_metrics",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "for name in sorted(set(gather_object(list(self._pending_metrics)))):",
            "local_stats = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=device)",
            "total, count = self.accelerator.gather(local_stats).view(-1, 2).sum(dim=0).tolist()",
            "self._metrics[mode][name].append(total / count)",
        ),
    ),
    Mirrored(
        "trl_stable.trainers.grpo.checkpoints.GRPOCheckpoints._save_checkpoint",
        "transformers.Trainer._save_checkpoint",
        (
            "rotate_checkpoints(",
            "output_dir=run_dir,",
            "save_total_limit=self.args.save_total_limit,",
            "best_model_checkpoint=self.state.best_model_checkpoint,",
            "use_mtime=True,",
        ),
    ),
    Mirrored(
        "trl_stable.trl_internals.rng_state_file",
        "transformers.Trainer._save_rng_state",
        (
            "if self.args.world_size <= 1:",
            'torch.save(rng_states, os.path.join(output_dir, "rng_state.pth"))',
            'torch.save(rng_states, os.path.join(output_dir, f"rng_state_{self.args.process_index}.pth"))',
        ),
    ),
    Mirrored(
        "trl_stable.trainers.grpo.GRPOTrainer._contract_checked_reward_funcs",
        "trl.GRPOTrainer._calculate_rewards",
        (
            "zip(self.reward_funcs, self.reward_processing_classes, self.reward_func_names, strict=True)",
            "if isinstance(reward_func, nn.Module):",
            "elif is_async_callable(reward_func):",
            "prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs",
            "rewards_per_func = gather(rewards_per_func)",
        ),
    ),
    Mirrored(
        "trl_stable.rewards.dense.weighted_reward_sum",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
            "rewards[unscorable_mask] = torch.nan",
        ),
    ),
)

# The lines of `trl.GRPOTrainer._get_per_token_logps_and_entropies` that `with_mask_position_ids` relies on: the
# model is called with the chunk's ids and mask as keywords; the contract test also checks that TRL sets no
# `position_ids` of its own.
LOGPS_FORWARD_SNIPPETS = (
    'model_inputs = {"input_ids": input_ids_batch, "attention_mask": attention_mask_batch}',
    "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)",
)


class _MaskPositionIds:
    """A model whose every call gets ``position_ids`` derived from that call's ``attention_mask``.

    Attribute reads go to the model, so code that inspects it (its config, `training`) sees the model itself.
    """

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
            kwargs["position_ids"] = position_ids_from_mask(kwargs["attention_mask"])
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def with_mask_position_ids(trainer: Any, model: torch.nn.Module) -> Any:
    """`model` for `trl.GRPOTrainer._get_per_token_logps_and_entropies`, numbering each row from its first real token.

    TRL's pass gives the model no position ids, so a left-padded row is numbered from its first (padding) column,
    while HF `generate` numbers it from the attention mask (and vLLM sees no padding); see
    `trl_stable.core.positions`. The returned callable adds `position_ids_from_mask(attention_mask)` to each call.
    A model whose forward takes no `position_ids` is returned unchanged, as `generate` then passes none either.
    """
    inner = trainer.accelerator.unwrap_model(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT forwards **kwargs
    if "position_ids" not in inspect.signature(inner.forward).parameters:
        return model
    return _MaskPositionIds(model)


# Parameters of `_get_per_token_logps_and_entropies` that are not multimodal forward inputs.
_LOGPS_CORE_PARAMS = ("self", *_LOGPS_PARAMS)


def multimodal_forward_keys() -> tuple[str, ...]:
    """The batch keys TRL forwards to the policy besides ids and masks (pixel_values, image_grid_thw, ...).

    Read from the signature of `trl.GRPOTrainer._get_per_token_logps_and_entropies`, TRL's own list, rather than
    copied, so a TRL release that adds a multimodal input is followed automatically.
    """
    import trl

    signature = inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies)
    return tuple(name for name in signature.parameters if name not in _LOGPS_CORE_PARAMS)


def forward_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """The multimodal forward inputs present in a GRPO batch, for `_get_per_token_logps_and_entropies`."""
    return {key: batch[key] for key in multimodal_forward_keys() if key in batch}


def train_mode(trainer: Any) -> str:
    """ "train" or "eval": the key of TRL's per-mode metric and log buffers."""
    return "train" if trainer.model.training else "eval"


def log_metric(trainer: Any, name: str, value: float) -> None:
    """Append a scalar to TRL's metric buffer (`_metrics[mode]`); TRL averages and logs it at the next `log`."""
    trainer._metrics[train_mode(trainer)][name].append(float(value))


def flush_reward_logs(trainer: Any, num_local: int) -> None:
    """Flush what reward functions logged through ``log_extra`` / ``log_metric`` since TRL's own flush, as TRL does
    right after `_calculate_rewards` (columns gathered; metrics reduced over processes by `flush_reward_metrics`). A
    collective: every process calls it. GRPO calls it after the dense reward functions it collects later than TRL's
    flush.

    Args:
        num_local: Completions on this process (the length of a column no function logged here).
    """
    from accelerate.utils import gather_object

    for column in sorted(set(gather_object(list(trainer._pending_extra_logs)))):
        values = trainer._pending_extra_logs.get(column, [None] * num_local)
        trainer._logs["extra"][column].extend(gather_object(values))
    trainer._pending_extra_logs.clear()
    flush_reward_metrics(trainer)


def flush_reward_metrics(trainer: Any, select: Callable[[str], bool] | None = None) -> None:
    """Move the metrics reward functions logged through ``log_metric`` (TRL's `_pending_metrics`) into TRL's metric
    buffer, reduced over processes: TRL's mean over every call for metrics trl_stable does not know, the kind
    `trl_stable.monitoring.reduction.logged_metric_stat` names for the ones it does (the critic's counts summed and
    its fractions recomputed from them, ...). A collective: every process calls it.

    Args:
        select: Flush only the names it accepts (the others stay for TRL's own flush); None: all.
    """
    from accelerate.utils import gather_object

    from trl_stable.monitoring.reduction import logged_metric_stat, reduce_metrics

    # sorted union: every process reduces the same names in the same order, those it did not log with no share
    names = [
        name for name in sorted(set(gather_object(list(trainer._pending_metrics)))) if select is None or select(name)
    ]
    if not names:
        return
    stats = {name: logged_metric_stat(name, trainer._pending_metrics.pop(name, [])) for name in names}
    mode = train_mode(trainer)
    for name, value in reduce_metrics(stats, trainer.accelerator).items():
        trainer._metrics[mode][name].append(value)


def replace_logged_advantages(trainer: Any, advantages: Sequence[float]) -> None:
    """Replace the advantages TRL just put in its completions table (`_logs["advantages"]`) by `advantages`."""
    logged = trainer._logs["advantages"]  # a bounded deque in TRL 1.16: no slice deletion
    for _ in range(min(len(logged), len(advantages))):
        logged.pop()
    logged.extend(advantages)


def rng_state_file(trainer: Any) -> str:
    """The name of this process's RNG file in a checkpoint transformers' `Trainer` wrote (see `MIRRORED`)."""
    if trainer.args.world_size <= 1:
        return "rng_state.pth"
    return f"rng_state_{trainer.args.process_index}.pth"


def tokenizer_of(trainer: Any) -> Any:
    """TRL's tokenizer (the processor's tokenizer for a VLM)."""
    return trainer._tokenizer


def reward_kwargs(trainer: Any, inputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The keyword arguments TRL passes every reward function (mirrors `trl.GRPOTrainer._calculate_rewards`).

    The dataset columns (repeated per completion), ``trainer_state``, ``log_extra``, ``log_metric`` and, with
    environments, ``environments``. See `MIRRORED`.
    """
    keys = [key for key in inputs[0] if key not in ("prompt", "completion", "completion_ids")]
    kwargs: dict[str, Any] = {key: [example[key] for example in inputs] for key in keys}
    kwargs["trainer_state"] = trainer.state
    kwargs["log_extra"] = trainer._log_completion_extra
    kwargs["log_metric"] = trainer._log_metric
    if trainer.environments is not None:
        kwargs["environments"] = trainer.environments
    return kwargs


def call_reward_func(func: Callable[..., Any], loop: asyncio.AbstractEventLoop | None, **kwargs: Any) -> Any:
    """Call a reward function; an async one runs on `loop`, as TRL runs them on its reward event loop.

    GRPO passes TRL's `async_loop`; PPO its own loop from TRL's `start_event_loop_in_daemon` (`reward_event_loop`),
    so an async reward function also works where an event loop is already running (a notebook).
    """
    from trl.trainer.utils import is_async_callable

    out = func(**kwargs)
    if is_async_callable(func) or inspect.isawaitable(out):
        if loop is None:
            raise RuntimeError(f"Reward function {func!r} is async but no event loop was started for it.")
        out = asyncio.run_coroutine_threadsafe(out, loop).result()
    return out


def reward_event_loop(funcs: Sequence[Callable[..., Any]]) -> asyncio.AbstractEventLoop | None:
    """A daemon-thread event loop for the async functions among `funcs` (TRL's helper), None when there are none."""
    from trl.trainer.utils import is_async_callable, shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    if not any(is_async_callable(f) for f in funcs):
        return None
    thread, loop, ready = start_event_loop_in_daemon(name="trl_stable-reward-loop")
    ready.wait()
    atexit.register(shutdown_event_loop_in_daemon, thread, loop)
    return loop


def is_reference_pass(trainer: Any, model: torch.nn.Module) -> bool:
    """Whether a forward of `model` computes the KL reference, judged from the model's own state.

    The reference is `trainer.ref_model`, or for a PEFT policy the same model with its adapters disabled (a new
    adapter: peft's ``disable_adapter()``) or with TRL's reference adapter (`REF_ADAPTER_NAME`) active.
    """
    if model is getattr(trainer, "ref_model", None):
        return True
    unwrapped = trainer.accelerator.unwrap_model(model)
    if not hasattr(unwrapped, "peft_config"):
        return False
    if getattr(unwrapped, "active_adapter", None) == REF_ADAPTER_NAME:
        return True
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(module.disable_adapters for module in unwrapped.modules() if isinstance(module, BaseTunerLayer))


@contextmanager
def wrapped_method(obj: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace ``obj.<name>`` by ``wrap(original)`` on this instance only, and restore it on exit (also on error): an
    attribute the instance had is put back, one it only inherited is deleted again, so the class is never touched."""
    had_instance_attr = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, wrap(original))
    try:
        yield
    finally:
        if had_instance_attr:
            setattr(obj, name, original)
        else:
            delattr(obj, name)
