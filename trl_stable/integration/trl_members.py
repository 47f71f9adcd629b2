"""The registry of every private TRL / transformers member trl_stable relies on, and of the TRL logic it mirrors.

trl_stable extends `trl.GRPOTrainer` by overriding some of its private methods and reading some of its private
attributes; none of them is TRL's public API, and several changed signature or return arity between TRL releases.
This module names them ([`GRPO_MEMBERS`], [`TRANSFORMERS_MEMBERS`], [`HELPER_MEMBERS`], and for PPO [`PPO_MEMBERS`],
[`VLLM_MEMBERS`], [`ENGINE_MEMBERS`]), each as a [`Member`], and names the TRL logic trl_stable repeats or depends on
([`MIRRORED`]), each as a [`Mirrored`] with the TRL lines it stands on. It holds data only: the code that uses the
members lives where it is used (`used_in`). `tests/integration/test_trl_members.py` checks every entry against the
installed TRL and transformers, so an upgrade fails there, naming the member, instead of deep inside a training step.

The TRL-imposed channel. TRL's `_generate_and_score_completions` calls `_calculate_rewards`, `_generate`,
`_generate_single_turn` and `_get_per_token_logps_and_entropies` and keeps what they return to itself (the batch dict
it returns has no rewards, no sampler routing). trl_stable's override therefore opens one per-call record
(`trl_stable.trainers.grpo.RolloutRecord`, a context manager, reset when the call ends, also on error) that those
hooks fill; nothing else carries one batch's values between methods.

The version gate (`trl_stable._compat`) stays: it turns an unsupported TRL into one clear ImportError at import time.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CONFIG_NAME_ATTRIBUTE",
    "ENGINE_MEMBERS",
    "GRPO_BATCH_KEYS",
    "GRPO_MEMBERS",
    "GRPO_OPTIONAL_BATCH_KEYS",
    "GRPO_PADDING",
    "HELPER_MEMBERS",
    "LOGPS_FORWARD_SNIPPETS",
    "LOGPS_PARAMS",
    "MIRRORED",
    "PPO_MEMBERS",
    "REF_ADAPTER_NAME",
    "TRANSFORMERS_MEMBERS",
    "VLLM_MEMBERS",
    "Member",
    "Mirrored",
]


@dataclass(frozen=True)
class Member:
    """One private member of a TRL / transformers class that trl_stable uses.

    Attributes:
        owner: Dotted path of the class (``"trl.GRPOTrainer"``).
        name: The member's name.
        kind: "override" (trl_stable overrides it and calls ``super()``), "replace" (trl_stable overrides it without
            calling ``super()``, repeating its steps: see `MIRRORED`), "call" (trl_stable calls it), "attribute"
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
LOGPS_PARAMS = (
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
_LOGS_PY = ("trl_stable/trainers/grpo/trl_logs.py",)
_REWARDS_PY = ("trl_stable/trainers/grpo/trl_rewards.py",)
_BATCH_PY = ("trl_stable/trainers/grpo/trl_batch.py",)
_REWARD_CALLS_PY = ("trl_stable/integration/reward_calls.py",)

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
        LOGPS_PARAMS,
        "3-tuple (logps [B, T], entropies | None, aux_loss | None); the parameters after compute_aux_loss are the "
        "multimodal forward keys (`multimodal_forward_keys`); `model` is only called, once per chunk, with the "
        "chunk's `input_ids` and `attention_mask` as keywords and no `position_ids` (`LOGPS_FORWARD_SNIPPETS`), so "
        "`with_mask_position_ids` can add them",
        _TRAINER_PY,
    ),
    Member(_GRPO, "_compute_loss", "override", ("model", "inputs"), "a scalar loss tensor", _TRAINER_PY),
    Member(_GRPO, "_log_completion_extra", "call", ("column", "values"), "", _REWARDS_PY),
    Member(_GRPO, "_log_metric", "call", ("name", "value"), "", _REWARDS_PY),
    # attributes, read on an instance (checked on a tiny trainer)
    Member(
        _GRPO,
        "_metrics",
        "attribute",
        returns='{"train"|"eval": defaultdict(list)} of scalar metrics, averaged by TRL\'s `log`',
        used_in=_LOGS_PY,
    ),
    Member(
        _GRPO,
        "_logs",
        "attribute",
        returns='dict with an "advantages" list: the completions table\'s advantage column',
        used_in=_LOGS_PY,
    ),
    Member(
        _GRPO,
        "_pending_metrics",
        "attribute",
        returns="defaultdict(list): values reward functions logged with `log_metric`, flushed after the rewards",
        used_in=_LOGS_PY,
    ),
    Member(
        _GRPO,
        "_pending_extra_logs",
        "attribute",
        returns="dict of columns reward functions logged with `log_extra`, flushed after the rewards",
        used_in=_LOGS_PY,
    ),
    Member(_GRPO, "_tokenizer", "attribute", returns="the tokenizer (pad_token_id)", used_in=_BATCH_PY),
    Member(
        _GRPO,
        "reward_funcs",
        "attribute",
        returns="the list `_calculate_rewards` reads, at every call, when it calls the reward functions (nn.Modules "
        "scored by TRL, the rest called with TRL's keywords, async ones awaited): trl_stable sets it once, at "
        "construction, to the contract-checked functions (`ContractCheckedRewards`; see MIRRORED)",
        used_in=(*_TRAINER_PY, *_REWARDS_PY),
    ),
    Member(
        _GRPO,
        "async_loop",
        "attribute",
        returns="the event loop TRL runs async reward functions on (exists only when some reward function is async)",
        used_in=_TRAINER_PY,
    ),
    Member(
        _GRPO,
        "environments",
        "attribute",
        returns="per-rollout environment instances or None (passed to reward functions)",
        used_in=_REWARDS_PY,
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
        "replace",
        ("model", "trial"),
        "None; writes `checkpoint-{global_step}` under `_get_output_dir(trial)` (RNG file: `rng_state_file`), then "
        "pushes it and rotates old checkpoints. trl_stable's override writes the same files with the same helpers "
        "and rotates only after its completion marker (MIRRORED)",
        _CHECKPOINTS_PY,
    ),
    Member(_GRPO, "_get_output_dir", "call", ("trial",), "the folder checkpoints are written into", _CHECKPOINTS_PY),
    # attributes trl_stable edits once, at construction, and TRL reads at every call (see MIRRORED:
    # `_split_dense_reward_funcs`): the dense functions leave TRL's lists, the overlong penalty joins them
    Member(
        _GRPO, "reward_func_names", "attribute", returns="list[str], aligned with reward_funcs", used_in=_TRAINER_PY
    ),
    Member(
        _GRPO,
        "reward_processing_classes",
        "attribute",
        returns="list, aligned with reward_funcs (the tokenizer of each reward model, else None)",
        used_in=_TRAINER_PY,
    ),
    Member(
        _GRPO,
        "reward_weights",
        "attribute",
        returns="[K] float tensor, aligned with reward_funcs",
        used_in=_TRAINER_PY,
    ),
    # attributes trl_stable reads to decide its own path (TRL sets them from its config in `__init__`)
    Member(_GRPO, "num_generations", "attribute", returns="group size in training", used_in=_TRAINER_PY),
    Member(_GRPO, "max_completion_length", "attribute", returns="int, the completion cap", used_in=_TRAINER_PY),
    Member(_GRPO, "loss_type", "attribute", returns="str, TRL's loss (named in describe_paths)", used_in=_TRAINER_PY),
    Member(
        _GRPO,
        "importance_sampling_level",
        "attribute",
        returns='"token" or "sequence" (GSPO): a masking token filter then also leaves TRL\'s loss mask',
        used_in=_TRAINER_PY,
    ),
    Member(_GRPO, "use_vllm", "attribute", returns="bool: the sampler is vLLM", used_in=_TRAINER_PY),
    Member(
        _GRPO,
        "use_transformers_continuous_batching",
        "attribute",
        returns="bool: the sampler is transformers' continuous batching (no sampler log-probs)",
        used_in=_TRAINER_PY,
    ),
    Member(
        _GRPO, "tools", "attribute", returns="list of tool functions (R3 refuses tool calling)", used_in=_TRAINER_PY
    ),
    Member(_GRPO, "rollout_func", "attribute", returns="the user's rollout function or None", used_in=_TRAINER_PY),
    Member(
        _GRPO,
        "environment_factories",
        "attribute",
        returns="None unless environments make the prompts (then no prompt column is checked)",
        used_in=_TRAINER_PY,
    ),
    Member(
        _GRPO,
        "ref_model",
        "attribute",
        returns="the KL reference model, or None (PEFT: the policy with adapters off)",
        used_in=("trl_stable/trainers/grpo/forward_passes.py",),
    ),
    Member(
        _GRPO, "create_model_card", "call", ("model_name",), "None (writes README.md in output_dir)", _CHECKPOINTS_PY
    ),
    Member(
        _GRPO,
        "use_adaptive_entropy",
        "attribute",
        returns="bool: TRL saves its entropy state",
        used_in=_CHECKPOINTS_PY,
    ),
    Member(_GRPO, "entropy_coef", "attribute", returns="float, in TRL's entropy state file", used_in=_CHECKPOINTS_PY),
    Member(
        _GRPO,
        "_last_world_entropy",
        "attribute",
        returns="float, in TRL's entropy state file",
        used_in=_CHECKPOINTS_PY,
    ),
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
        _CHECKPOINTS_PY,
    ),
    # the steps of `Trainer._save_checkpoint` GRPO's checkpoints call, each given the checkpoint folder
    Member("transformers.Trainer", "save_model", "call", ("output_dir", "_internal_call"), "", _CHECKPOINTS_PY),
    Member("transformers.Trainer", "store_flos", "call", (), "", _CHECKPOINTS_PY),
    Member("transformers.Trainer", "_save_optimizer_and_scheduler", "call", ("output_dir",), "", _CHECKPOINTS_PY),
    Member("transformers.Trainer", "_save_scaler", "call", ("output_dir",), "", _CHECKPOINTS_PY),
    Member("transformers.Trainer", "_save_rng_state", "call", ("output_dir",), "", _CHECKPOINTS_PY),
    Member("transformers.Trainer", "_push_from_checkpoint", "call", ("checkpoint_folder",), "", _CHECKPOINTS_PY),
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
        (*_REWARD_CALLS_PY, *_REWARDS_PY),
    ),
    Member(
        "trl.trainer.utils",
        "start_event_loop_in_daemon",
        "call",
        ("name",),
        "3-tuple (thread, loop, ready event)",
        _REWARD_CALLS_PY,
    ),
    Member(
        "trl.trainer.utils",
        "shutdown_event_loop_in_daemon",
        "call",
        ("thread", "loop"),
        "None",
        _REWARD_CALLS_PY,
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

# How TRL pads each [B, T] key it builds in `_generate_and_score_completions` (`pad(..., padding_value=...,
# padding_side=...)`): (side, value), "pad_token_id" standing for the tokenizer's pad id. Batches trl_stable
# concatenates (`trainers.grpo.trl_batch.concat_rows`) are padded the same way; a key not listed (old / reference log
# probs, the IS ratio) is computed on the [prompt | completion] rows and aligned with the completion: right, 0.
GRPO_PADDING: dict[str, tuple[str, int | float | str]] = {
    "prompt_ids": ("left", "pad_token_id"),
    "prompt_mask": ("left", 0),
    "completion_ids": ("right", "pad_token_id"),
    "completion_mask": ("right", 0),
    "sampling_per_token_logps": ("right", 0.0),
    "tool_mask": ("right", 1),
}

# TRL's name for the copy of the initial adapter it loads as the reference of a re-trained PEFT adapter.
REF_ADAPTER_NAME = "ref"


@dataclass(frozen=True)
class Mirrored:
    """TRL / transformers logic trl_stable repeats (TRL offers no helper for it) or relies on: where trl_stable does
    it and the TRL lines it stands on.

    The contract test asserts that every `snippets` line is still in the TRL member's source, so a TRL change to the
    mirrored logic fails there, naming `ours`; and, with `calls`, that the member makes exactly those calls (as the
    AST spells them), so a step added to or removed from a method trl_stable repeats whole fails too.

    Attributes:
        ours: Dotted path of trl_stable's function, method or class that mirrors or relies on the logic.
        trl_member: Dotted path of the TRL / transformers method (or function) holding it.
        snippets: Lines of `trl_member`'s source, verbatim (stripped).
        relation: "mirrors" (trl_stable repeats the logic) or "relies on" (trl_stable depends on what it does).
        calls: Every call `trl_member` makes, for a method trl_stable repeats step by step; () for no such check.
    """

    ours: str
    trl_member: str
    snippets: tuple[str, ...]
    relation: str = "mirrors"
    calls: tuple[str, ...] = ()


MIRRORED: tuple[Mirrored, ...] = (
    Mirrored(
        "trl_stable.trainers.grpo.trl_rewards.reward_kwargs",
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
        "trl_stable.integration.reward_calls.call_reward_func",
        "trl.GRPOTrainer._calculate_rewards",
        ("asyncio.run_coroutine_threadsafe(_run_async_funcs(), self.async_loop).result()",),
    ),
    Mirrored(
        "trl_stable.trainers.grpo.trl_logs.flush_reward_logs",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "for column in sorted(set(gather_object(list(self._pending_extra_logs)))):",
            "values = self._pending_extra_logs.get(column, [None] * len(prompts))",
            'self._logs["extra"][column].extend(gather_object(values))',
        ),
    ),
    Mirrored(
        # TRL's mean over every call, kept for the metrics trl_stable has no other reduction for
        "trl_stable.trainers.grpo.trl_logs.flush_reward_metrics",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "for name in sorted(set(gather_object(list(self._pending_metrics)))):",
            "local_stats = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=device)",
            "total, count = self.accelerator.gather(local_stats).view(-1, 2).sum(dim=0).tolist()",
            "self._metrics[mode][name].append(total / count)",
        ),
    ),
    Mirrored(
        # the steps of transformers' `_save_checkpoint` in `_write_checkpoint_files`; its push and rotation in
        # `_save_checkpoint`, once the folder is marked complete
        "trl_stable.trainers.grpo.checkpoints.GRPOCheckpoints._write_checkpoint_files",
        "transformers.Trainer._save_checkpoint",
        (
            'checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"',
            "if self.hp_search_backend is None and trial is None:",
            "self.store_flos()",
            "run_dir = self._get_output_dir(trial=trial)",
            "self.save_model(output_dir, _internal_call=True)",
            "self.args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST]",
            "and self.state.best_global_step",
            'best_checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"',
            "best_checkpoint_dir = os.path.join(run_dir, best_checkpoint_folder)",
            "if os.path.exists(best_checkpoint_dir):",
            "self.state.best_model_checkpoint = best_checkpoint_dir",
            "if not self.args.save_only_model:",
            "self._save_optimizer_and_scheduler(output_dir)",
            "self._save_scaler(output_dir)",
            "self._save_rng_state(output_dir)",
            "if self.args.should_save:",
            "cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)",
            "if isinstance(self.state.stateful_callbacks[cb_name], list):",
            "self.state.stateful_callbacks[cb_name].append(cb_state)",
            "self.state.stateful_callbacks[cb_name] = cb_state",
            "self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))",
            "if self.args.push_to_hub:",
            "self._push_from_checkpoint(output_dir)",
            "rotate_checkpoints(",
            "output_dir=run_dir,",
            "save_total_limit=self.args.save_total_limit,",
            "best_model_checkpoint=self.state.best_model_checkpoint,",
            "use_mtime=True,",
        ),
        calls=(
            "cb.state",
            "dist.barrier",
            "is_sagemaker_mp_enabled",
            "is_torch_xla_available",
            "isinstance",
            "os.path.exists",
            "os.path.join",
            "rotate_checkpoints",
            "self._get_output_dir",
            "self._push_from_checkpoint",
            "self._save_optimizer_and_scheduler",
            "self._save_rng_state",
            "self._save_scaler",
            "self.save_model",
            "self.state.save_to_json",
            "self.state.stateful_callbacks[cb_name].append",
            "self.store_flos",
            "smp.barrier",
            "xm.rendezvous",
        ),
    ),
    Mirrored(
        "trl_stable.trainers.grpo.checkpoints.GRPOCheckpoints._write_checkpoint_files",
        "trl.GRPOTrainer._save_checkpoint",
        (
            "if self.args.hub_model_id is None:",
            "model_name = Path(self.args.output_dir).name",
            'model_name = self.args.hub_model_id.split("/")[-1]',
            "self.create_model_card(model_name=model_name)",
            "super()._save_checkpoint(model, trial)",
            "if self.use_adaptive_entropy and self.args.should_save:",
            'with open(os.path.join(output_dir, "entropy_ctrl_state.json"), "w") as f:',
            'json.dump({"entropy_coef": self.entropy_coef, "last_world_entropy": self._last_world_entropy}, f)',
        ),
        calls=(
            "Path",
            "json.dump",
            "open",
            "os.path.join",
            "self._get_output_dir",
            "self.args.hub_model_id.split",
            "self.create_model_card",
            "super",
            "super()._save_checkpoint",
        ),
    ),
    Mirrored(
        "trl_stable.integration.hf_names.rng_state_file",
        "transformers.Trainer._save_rng_state",
        (
            "if self.args.world_size <= 1:",
            'torch.save(rng_states, os.path.join(output_dir, "rng_state.pth"))',
            'torch.save(rng_states, os.path.join(output_dir, f"rng_state_{self.args.process_index}.pth"))',
        ),
    ),
    Mirrored(
        "trl_stable.trainers.grpo.trl_rewards.ContractCheckedRewards",
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
    Mirrored(
        "trl_stable.trainers.grpo.trl_batch.loss_mask",
        "trl.GRPOTrainer._generate_and_score_completions",
        ("loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask",),
    ),
    Mirrored(
        "trl_stable.trainers.grpo.trl_batch.loss_mask",
        "trl.GRPOTrainer._compute_loss",
        ('mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]',),
        "relies on",
    ),
    Mirrored(
        # recomputed wherever trl_stable removes tokens from the loss (`_apply_loss_mask`) or rebuilds the batch
        # (dynamic sampling's refill), so TRL's normaliser counts the tokens that are trained on
        "trl_stable.trainers.grpo.trl_batch.num_items_in_batch",
        "trl.GRPOTrainer._generate_and_score_completions",
        ("num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()",),
    ),
    Mirrored(
        "trl_stable.trainers.grpo.trl_batch.num_items_in_batch",
        "trl.GRPOTrainer._compute_loss",
        (
            'elif self.loss_type in ["cispo", "dapo", "vespo"]:',
            'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes',
            "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
            "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)",
        ),
        "relies on",
    ),
    Mirrored(
        "trl_stable.trainers.grpo.trl_batch.process_slice",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "process_slice = slice(",
            "self.accelerator.process_index * len(prompts),",
            "(self.accelerator.process_index + 1) * len(prompts),",
            "advantages = advantages[process_slice]",
        ),
    ),
    Mirrored(
        # a group is `num_generations` consecutive rows of the gathered batch (in eval: `num_generations_eval`), and an
        # unscorable row's advantage is 0
        "trl_stable.trainers.grpo.GRPOTrainer._postprocess_generation",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            'num_generations = self.num_generations if mode == "train" else self.num_generations_eval',
            "mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)",
            "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)",
            "advantages = torch.nan_to_num(advantages, nan=0.0)",
        ),
    ),
    Mirrored(
        "trl_stable.trainers.grpo.trl_logs.train_mode",
        "trl.GRPOTrainer._generate_and_score_completions",
        ('mode = "train" if self.model.training else "eval"',),
    ),
    Mirrored(
        # the proximal pass is TRL's old-logprob pass, run by trl_stable when TRL skipped it
        "trl_stable.trainers.grpo.GRPOTrainer._compute_proximal_logps",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)",
            "attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)",
            "logits_to_keep = completion_ids.size(1)",
            'batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.'
            "per_device_eval_batch_size",
            "with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs"
            "):",
            "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(",
            "batch_size=batch_size,",
        ),
    ),
    Mirrored(
        # the behaviour weight and the token filter reach TRL's loss folded into (B, T) advantages
        "trl_stable.trainers.grpo.GRPOTrainer._apply_decoupled_loss",
        "trl.GRPOTrainer._compute_loss",
        ("if advantages.dim() == 1:", "advantages = advantages.unsqueeze(1)"),
        "relies on",
    ),
    Mirrored(
        # the dense reward-to-go reaches TRL's loss as (B, T) advantages
        "trl_stable.trainers.grpo.GRPOTrainer._postprocess_generation",
        "trl.GRPOTrainer._compute_loss",
        ("if advantages.dim() == 1:", "advantages = advantages.unsqueeze(1)"),
        "relies on",
    ),
    Mirrored(
        # the exact table is checked against TRL's `pad` calls by the contract test
        "trl_stable.trainers.grpo.trl_batch.concat_rows",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "padding_value=self._tokenizer.pad_token_id,",
            'padding_side="left",',
            'padding_side="right",',
        ),
    ),
    Mirrored(
        # trl_stable's own batch-first key (``routed_experts``) is shuffled and split with the rest
        "trl_stable.trainers.grpo.GRPOTrainer._attach_routing",
        "trl.GRPOTrainer._prepare_inputs",
        (
            "generation_batch = shuffle_sequence_dict(generation_batch)",
            "generation_batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)",
        ),
        "relies on",
    ),
    Mirrored(
        "trl_stable.trainers.grpo.GRPOTrainer._attach_routing",
        "trl.trainer.utils.shuffle_sequence_dict",
        ("if isinstance(v, torch.Tensor) and v.ndim >= 1:", "return v[permutation]"),
        "relies on",
    ),
    Mirrored(
        "trl_stable.trainers.grpo.GRPOTrainer._attach_routing",
        "trl.trainer.utils.split_tensor_dict",
        ("chunk_dict[key] = tensor[i * chunk_size : (i + 1) * chunk_size]",),
        "relies on",
    ),
    Mirrored(
        # TRL's last write to the completions table's advantage column in the call is all of this call's
        # advantages (gathered), so the last N entries are this call's; the contract test checks there is one
        "trl_stable.trainers.grpo.trl_logs.replace_logged_advantages",
        "trl.GRPOTrainer._generate_and_score_completions",
        ('self._logs["advantages"].extend(all_process_advantages.tolist())',),
        "relies on",
    ),
    Mirrored(
        # the optional keys trl_stable reads, and where TRL puts each in the batch
        "trl_stable.integration.trl_members.GRPO_OPTIONAL_BATCH_KEYS",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            'output["old_per_token_logps"] = old_per_token_logps',
            'output["sampling_per_token_logps"] = sampling_per_token_logps',
            'output["ref_per_token_logps"] = ref_per_token_logps',
            'output["tool_mask"] = tool_mask',
            'output["importance_sampling_ratio"] = vllm_importance_sampling_ratio',
        ),
        "relies on",
    ),
    Mirrored(
        # each reward's own group z-score, logged as GDPO's per-reward advantage
        "trl_stable.trainers.grpo.GRPOTrainer._log_per_reward_advantages",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "mean_k = torch.nanmean(grouped, dim=1, keepdim=True)",
            "std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)",
            "reward_k = (grouped - mean_k) / (std_k + 1e-4)",
        ),
    ),
    Mirrored(
        # the reference pass: `ref_model`, or the policy with TRL's "ref" adapter / its adapters disabled
        "trl_stable.trainers.grpo.forward_passes.is_reference_pass",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "if self.ref_model is not None:",
            "ref_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(",
            'with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):',
        ),
        "relies on",
    ),
    Mirrored(
        # scoring right after generation gives TRL's later call the same arguments; not when a rollout_func's
        # extra fields, merged into the inputs only after `_generate`, could reach the reward functions
        "trl_stable.trainers.grpo.GRPOTrainer._scores_early",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "if extra_fields:",
            "inp[key] = values[i]",
            "rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids_list)",
        ),
        "relies on",
    ),
    Mirrored(
        # the HF sampler's recorded log-probs, returned as `_generate_single_turn`'s logprobs, become TRL's
        # `sampling_per_token_logps`
        "trl_stable.trainers.grpo.GRPOTrainer._generate_single_turn",
        "trl.GRPOTrainer._generate",
        (
            "completion_ids, logprobs = self._generate_single_turn(",
            "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images",
        ),
        "relies on",
    ),
    Mirrored(
        "trl_stable.trainers.grpo.GRPOTrainer._split_dense_reward_funcs",
        "trl.GRPOTrainer._calculate_rewards",
        ("rewards_per_func = torch.zeros(len(prompts), len(self.reward_funcs), device=device)",),
        "relies on",
    ),
    Mirrored(
        "trl_stable.trainers.grpo.GRPOTrainer._split_dense_reward_funcs",
        "trl.GRPOTrainer._generate_and_score_completions",
        (
            "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
            "for i, reward_func_name in enumerate(self.reward_func_names):",
        ),
        "relies on",
    ),
)

# The lines of `trl.GRPOTrainer._get_per_token_logps_and_entropies` that `with_mask_position_ids` relies on: the
# model is called with the chunk's ids and mask as keywords; the contract test also checks that TRL sets no
# `position_ids` of its own.
LOGPS_FORWARD_SNIPPETS = (
    'model_inputs = {"input_ids": input_ids_batch, "attention_mask": attention_mask_batch}',
    "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)",
)
