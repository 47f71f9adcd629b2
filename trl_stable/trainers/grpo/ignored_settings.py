"""The settings `trl.GRPOConfig` accepts that a GRPO run ignores, each named in an `IgnoredSettingWarning` with the
fix (a script written for `trl.GRPOTrainer` keeps running); docs/grpo.md's "Every setting" lists them."""

from __future__ import annotations

import dataclasses
from typing import Any

import trl

from trl_stable.settings.checks import (
    Dependent,
    check_dependents,
    ignored_setting,
    training_argument_dependents,
    warn_ignored,
)
from trl_stable.trainers.ppo.vllm_args import vllm_dependents

# `TrainingArguments` fields GRPO has nothing to apply to: (the value taken without a word, why another is ignored).
# TRL accepts them, so a script written for `trl.GRPOTrainer` keeps running: each is named in an IgnoredSettingWarning.
GRPO_IGNORED: dict[str, tuple[object, str]] = {
    "label_smoothing_factor": (0.0, "GRPO's loss (TRL's `_compute_loss`) has no labels to smooth."),
    "average_tokens_across_devices": (
        True,
        "GRPO's batches have no labels, so transformers counts no tokens to average; TRL's loss normalizes itself "
        "(loss_type 'dapo' already divides by the tokens of every process).",
    ),
    "prediction_loss_only": (False, "GRPO's evaluation computes only the loss (TRL's prediction_step) either way."),
    "eval_do_concat_batches": (True, "GRPO's evaluation gathers one loss per batch: there are no predictions."),
    "include_for_metrics": (
        [],
        "GRPOTrainer takes no compute_metrics, so nothing receives them (and 'inputs' fails in evaluate(): a GRPO "
        "batch is a list of rows).",
    ),
    "batch_eval_metrics": (False, "GRPOTrainer takes no compute_metrics to call per batch."),
    "label_names": (None, "GRPO's batches have no labels."),
    "train_sampling_strategy": (
        "random",
        "GRPO draws prompts with TRL's RepeatSampler (each prompt num_generations times, shuffled with `seed`); "
        "shuffle_dataset=False keeps the dataset's order.",
    ),
    "length_column_name": ("length", "GRPO does not group by length (TRL's RepeatSampler draws the prompts)."),
    "data_seed": (None, "TRL's RepeatSampler shuffles the prompts with `seed`; set seed instead."),
    "do_train": (
        False,
        "it is not read by the trainer (transformers' own Trainer does not read it either): training runs when your "
        "script calls trainer.train().",
    ),
    "do_predict": (False, "it is not read by the trainer: call trainer.predict(dataset) yourself."),
}
# transformers' own options of activation checkpointing, which TRL's GRPOTrainer drops: it switches checkpointing off
# around its no-grad passes and back on with `gradient_checkpointing_enable(kwargs)`, every layer checkpointed and
# these keys handed to torch's checkpoint function (which, reentrant, refuses them).
_TRAINER_CHECKPOINTING_OPTIONS = ("every_n_layers", "offload")
# The loss types whose clipped ratio reads epsilon / epsilon_high, and those that clip it two-sided with delta.
_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo")
_DELTA_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _prefixed(prefix: str, *, but: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The `trl.GRPOConfig` fields whose name starts with `prefix` (enumerated, so a field TRL adds is covered)."""
    return tuple(f.name for f in dataclasses.fields(trl.GRPOConfig) if f.name.startswith(prefix) and f.name not in but)


def trl_dependents(config: Any) -> tuple[Dependent, ...]:
    """The fields of a resolved `trl.GRPOConfig` that only act with another option, as [`Dependent`]s (TRL ignores
    each without a word when the option is off; `GRPOConfig` warns)."""
    loss = config.loss_type
    plugin = config.deepspeed_plugin
    return (
        Dependent(_prefixed("sapo_"), loss == "sapo", "loss_type='sapo'"),
        Dependent(_prefixed("vespo_"), loss == "vespo", "loss_type='vespo'"),
        Dependent(("epsilon", "epsilon_high"), loss in _CLIPPED_LOSSES, "a clipped loss_type (not 'sapo' / 'vespo')"),
        Dependent(("delta",), loss in _DELTA_LOSSES, f"a loss_type that clips the ratio ({', '.join(_DELTA_LOSSES)})"),
        Dependent(
            _prefixed("entropy_", but=("entropy_coef",)), config.use_adaptive_entropy, "use_adaptive_entropy=True"
        ),
        Dependent(_prefixed("ref_model_"), config.sync_ref_model, "sync_ref_model=True"),
        Dependent(("use_bias_correction_kl",), config.beta != 0.0, "beta > 0 (the KL term)"),
        Dependent(("liger_kernel_config",), config.use_liger_kernel, "use_liger_kernel=True"),
        Dependent(
            ("ds3_gather_for_generation",),
            plugin is not None and plugin.zero_stage == 3,
            "DeepSpeed ZeRO-3 (a deepspeed config or accelerate config with zero_stage 3)",
        ),
        Dependent(
            ("log_multimodal", "num_completions_to_print", "log_unique_prompts"),
            config.log_completions,
            "log_completions=True",
        ),
        Dependent(
            ("log_unique_prompts",),
            bool({"wandb", "trackio"} & set(config.report_to or [])),
            "report_to including 'wandb' or 'trackio' (the completions table it deduplicates)",
        ),
        Dependent(
            ("transformers_continuous_batching_config",),
            config.use_transformers_continuous_batching,
            "use_transformers_continuous_batching=True",
        ),
        Dependent(("cache_implementation",), not config.use_vllm, "use_vllm=False (vLLM manages its own cache)"),
        *vllm_dependents(config, settings=_prefixed("vllm_")),
        Dependent(
            _prefixed("vllm_importance_sampling_", but=("vllm_importance_sampling_correction",)),
            config.vllm_importance_sampling_correction,
            "vllm_importance_sampling_correction=True",
        ),
    )


def warn_ignored_settings(config: Any) -> None:
    """Warn about the `TrainingArguments` and TRL settings `config` (a resolved `GRPOConfig`) ignores."""
    ignored = dict(GRPO_IGNORED)
    if config.do_eval and str(getattr(config.eval_strategy, "value", config.eval_strategy)) == "no":
        ignored["do_eval"] = (
            False,
            "it is not read by the trainer (transformers sets it itself when eval_strategy is not 'no'): set "
            "eval_strategy='steps' or 'epoch' to evaluate during train(), or call trainer.evaluate().",
        )
    if config.local_rank not in (-1, config.local_process_index):
        ignored["local_rank"] = (
            -1,
            f"this process's local rank is {config.local_process_index} (accelerate reads it from the launcher's "
            "environment); the field is only there for the deprecated torch.distributed.launch to pass it.",
        )
    warn_ignored(config, ignored, "GRPOTrainer")
    checkpointing = config.activation_checkpointing_kwargs or config.gradient_checkpointing_kwargs or {}
    dropped = ", ".join(key for key in _TRAINER_CHECKPOINTING_OPTIONS if key in checkpointing)
    if dropped:
        ignored_setting(
            f"activation_checkpointing_kwargs={checkpointing!r}: {dropped} is ignored by GRPOTrainer: TRL switches "
            "activation checkpointing off around its no-grad passes and back on for every layer with these kwargs "
            f"handed to torch's checkpoint function (a reentrant one refuses them). Remove {dropped} from "
            "activation_checkpointing_kwargs."
        )
    # Each dependent field GRPO_IGNORED names is warned about there already.
    dependents = [
        Dependent(tuple(name for name in dep.fields if name not in GRPO_IGNORED), dep.active, dep.needs)
        for dep in (*training_argument_dependents(config), *trl_dependents(config))
    ]
    check_dependents(config, dependents, warn=ignored_setting)
