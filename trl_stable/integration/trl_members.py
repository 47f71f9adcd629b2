"""The registry of every private TRL / transformers (and httpx) member trl_stable relies on ([`Member`]), and the
keys and padding of TRL's GRPO batch dict: data only, checked against the installed versions by
`tests/integration/test_trl_members.py` (docs/development.md, "TRL internals"). The TRL logic trl_stable mirrors is
the second table, `trl_stable.integration.mirrored`.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def _attrs(owner: str, rows: dict[str, tuple[tuple[str, ...], str]]) -> tuple[Member, ...]:
    """Attributes trl_stable reads on an instance of `owner` (checked on a tiny trainer): {name: (used_in, what)}."""
    return tuple(
        Member(owner, name, "attribute", returns=returns, used_in=used_in) for name, (used_in, returns) in rows.items()
    )


def _members(
    groups: dict[tuple[str, str, tuple[str, ...]], dict[str, tuple[tuple[str, ...], str]]],
) -> tuple[Member, ...]:
    """The members of `groups`, {(owner, kind, used_in): {name: (params, returns)}}: each group holds the members of
    one owner and kind that the same modules use."""
    return tuple(
        Member(owner, name, kind, params, returns, used_in)
        for (owner, kind, used_in), rows in groups.items()
        for name, (params, returns) in rows.items()
    )


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
_MARKED_PY = ("trl_stable/trainers/checkpoints.py",)  # both trainers' marked checkpoint save
_LOGS_PY = ("trl_stable/trainers/grpo/trl_logs.py",)
_REWARDS_PY = ("trl_stable/trainers/grpo/trl_rewards.py",)
_ADVANTAGES_PY = ("trl_stable/trainers/grpo/advantages.py",)
_DECOUPLED_PY = ("trl_stable/trainers/grpo/decoupled_loss.py",)
_DENSE_PY = ("trl_stable/trainers/grpo/dense_rewards.py",)
_DYNAMIC_PY = ("trl_stable/trainers/grpo/dynamic_sampling.py",)
_BATCH_PY = ("trl_stable/trainers/grpo/trl_batch.py",)
_REWARD_CALLS_PY = ("trl_stable/integration/reward_calls.py",)

GRPO_MEMBERS: tuple[Member, ...] = _members(
    {
        (_GRPO, "override", _TRAINER_PY): {
            "_generate_and_score_completions": (
                ("inputs",),
                "dict with GRPO_BATCH_KEYS (+ GRPO_OPTIONAL_BATCH_KEYS); every tensor of batch size B is "
                "shuffled and split by TRL's `_prepare_inputs`, so trl_stable may add batch-first keys",
            ),
            "_generate": (
                ("prompts",),
                "8-tuple (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, "
                "tool_images); extra_fields (index 5) is a dict holding a rollout_func's extra keys; TRL later "
                "calls `_calculate_rewards` with the same prompts, completions (index 3) and completion ids "
                "(index 1), which early scoring relies on",
            ),
            "_tokenize_prompts": (
                ("prompts",),
                "3-tuple (prompt_ids: list[list[int]], images, multimodal_fields); called once per generation "
                "batch, before generation, only when there is no rollout_func",
            ),
            "_generate_single_turn": (
                ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
                "2-tuple (completion_ids: list[list[int]], logprobs: list[list[float]] | None)",
            ),
            "_calculate_rewards": (
                ("inputs", "prompts", "completions", "completion_ids_list"),
                "[N_global, K] float tensor, gathered over processes, NaN where a function returned None",
            ),
            "_compute_loss": (("model", "inputs"), "a scalar loss tensor"),
        },
        (_GRPO, "override", (*_TRAINER_PY, *_DECOUPLED_PY)): {
            "_get_per_token_logps_and_entropies": (
                LOGPS_PARAMS,
                "3-tuple (logps [B, T], entropies | None, aux_loss | None); the parameters after "
                "compute_aux_loss are the multimodal forward keys (`multimodal_forward_keys`); `model` is only "
                "called, once per chunk, with the chunk's `input_ids` and `attention_mask` as keywords and no "
                "`position_ids` (`LOGPS_FORWARD_SNIPPETS`), so `with_mask_position_ids` can add them",
            ),
        },
        (_GRPO, "call", _REWARDS_PY): {
            "_log_completion_extra": (("column", "values"), ""),
            "_log_metric": (("name", "value"), ""),
        },
        # checkpoints (TRL overrides transformers' `_save_checkpoint` to add its model card and extras)
        (_GRPO, "replace", _CHECKPOINTS_PY): {
            "_save_checkpoint": (
                ("model", "trial"),
                "None; writes `checkpoint-{global_step}` under `_get_output_dir(trial)` (RNG file: "
                "`rng_state_file`), then pushes it and rotates old checkpoints. trl_stable's override writes the "
                "same files with the same helpers and rotates only after its completion marker (MIRRORED)",
            ),
        },
        (_GRPO, "call", _MARKED_PY): {"_get_output_dir": (("trial",), "the folder checkpoints are written into")},
        (_GRPO, "call", _CHECKPOINTS_PY): {
            "create_model_card": (("model_name",), "None (writes README.md in output_dir)")
        },
    }
) + _attrs(
    _GRPO,
    {
        "_metrics": (_LOGS_PY, '{"train"|"eval": defaultdict(list)} of scalar metrics, averaged by TRL\'s `log`'),
        "_logs": (_LOGS_PY, 'dict with an "advantages" list: the completions table\'s advantage column'),
        "_pending_metrics": (
            _LOGS_PY,
            "defaultdict(list): values reward functions logged with `log_metric`, flushed after the rewards",
        ),
        "_pending_extra_logs": (
            _LOGS_PY,
            "dict of columns reward functions logged with `log_extra`, flushed after the rewards",
        ),
        "_tokenizer": (_BATCH_PY, "the tokenizer (pad_token_id)"),
        "reward_funcs": (
            (*_TRAINER_PY, *_REWARDS_PY, *_DENSE_PY),
            "the list `_calculate_rewards` reads, at every call, when it calls the reward functions (nn.Modules "
            "scored by TRL, the rest called with TRL's keywords, async ones awaited): trl_stable sets it once, at "
            "construction, to the contract-checked functions (`ContractCheckedRewards`; see MIRRORED)",
        ),
        "async_loop": (
            _DENSE_PY,
            "the event loop TRL runs async reward functions on (exists only when some reward function is async)",
        ),
        "environments": (_REWARDS_PY, "per-rollout environment instances or None (passed to reward functions)"),
        "num_generations_eval": (_TRAINER_PY, "group size in evaluation"),
        # edited once by trl_stable, at construction, and read by TRL at every call (see MIRRORED:
        # `_split_dense_reward_funcs`): the dense functions leave TRL's lists, the overlong penalty joins them
        "reward_func_names": ((*_TRAINER_PY, *_ADVANTAGES_PY, *_DENSE_PY), "list[str], aligned with reward_funcs"),
        "reward_processing_classes": (
            (*_TRAINER_PY, *_DENSE_PY),
            "list, aligned with reward_funcs (the tokenizer of each reward model, else None)",
        ),
        "reward_weights": (
            (*_TRAINER_PY, *_ADVANTAGES_PY, *_DENSE_PY),
            "[K] float tensor, aligned with reward_funcs",
        ),
        # read by trl_stable to decide its own path (TRL sets them from its config in `__init__`)
        "num_generations": ((*_TRAINER_PY, *_DYNAMIC_PY), "group size in training"),
        "max_completion_length": (_TRAINER_PY, "int, the completion cap"),
        "loss_type": (_TRAINER_PY, "str, TRL's loss (named in describe)"),
        "importance_sampling_level": (
            (*_TRAINER_PY, *_DECOUPLED_PY),
            '"token" or "sequence" (GSPO): a masking token filter then also leaves TRL\'s loss mask',
        ),
        "use_vllm": (_TRAINER_PY, "bool: the sampler is vLLM"),
        "use_transformers_continuous_batching": (
            _TRAINER_PY,
            "bool: the sampler is transformers' continuous batching (no sampler log-probs)",
        ),
        "tools": (_TRAINER_PY, "list of tool functions (R3 refuses tool calling)"),
        "rollout_func": (_TRAINER_PY, "the user's rollout function or None"),
        "environment_factories": (
            _TRAINER_PY,
            "None unless environments make the prompts (then no prompt column is checked)",
        ),
        "ref_model": (
            ("trl_stable/trainers/grpo/forward_passes.py",),
            "the KL reference model, or None (PEFT: the policy with adapters off)",
        ),
        "use_adaptive_entropy": (_CHECKPOINTS_PY, "bool: TRL saves its entropy state"),
        "entropy_coef": (_CHECKPOINTS_PY, "float, in TRL's entropy state file"),
        "_last_world_entropy": (_CHECKPOINTS_PY, "float, in TRL's entropy state file"),
    },
)

TRANSFORMERS_MEMBERS: tuple[Member, ...] = _members(
    {
        ("transformers.GenerationMixin", "patch", ("trl_stable/trainers/sampler_logprobs.py",)): {
            "_get_logits_processor": (
                ("generation_config",),
                "a LogitsProcessorList; trl_stable appends its sampler-log-prob recorder last",
            ),
        },
        ("transformers.trainer_utils", "call", _MARKED_PY): {
            "rotate_checkpoints": (
                ("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime"),
                "None; deletes the oldest `checkpoint-*` folders beyond the limit (called after the marker)",
            ),
        },
        # the steps of `Trainer._save_checkpoint` both trainers' checkpoints call, each given the checkpoint folder
        ("transformers.Trainer", "replace", _MARKED_PY): {
            "_save_checkpoint": (
                ("model", "trial"),
                "None; writes `checkpoint-{global_step}`, pushes it, rotates old ones. `MarkedCheckpoints` writes the "
                "same files with the same helpers and rotates only after its completion marker (MIRRORED)",
            ),
        },
        ("transformers.Trainer", "call", _MARKED_PY): {
            "save_model": (("output_dir", "_internal_call"), ""),
            "store_flos": ((), ""),
            "_save_optimizer_and_scheduler": (("output_dir",), ""),
            "_save_scaler": (("output_dir",), ""),
            "_save_rng_state": (("output_dir",), ""),
            "_push_from_checkpoint": (("checkpoint_folder",), ""),
        },
        ("transformers.modeling_layers.GradientCheckpointingLayer", "call", ("trl_stable/moe/replay.py",)): {
            "__call__": ((), "the decoder-layer class whose forward is recomputed under gradient checkpointing")
        },
    }
)

# What trl_stable's PPOTrainer, a `transformers.Trainer` through TRL's `_BaseTrainer`, takes from them beyond their
# public API: the Trainer steps its own loop calls (engine set-up, clipping, evaluation and saving, resume, the end of
# training), the methods it overrides, and the TRL helpers of its log-prob passes.
_PPO = (
    "trl_stable/trainers/ppo/models.py",
    "trl_stable/trainers/ppo/ppo_trainer.py",
    "trl_stable/trainers/ppo/rewards.py",
)
_PPO_TRAINER = _PPO[1:2]
_PPO_LOOP = ("trl_stable/trainers/ppo/loop_events.py",)
_PPO_PROMPTS = ("trl_stable/trainers/ppo/prompts.py",)
_PPO_SAVING = ("trl_stable/trainers/ppo/saving.py",)
_T = "transformers.Trainer"
_STATE = "transformers.trainer_callback.TrainerState"
PPO_MEMBERS: tuple[Member, ...] = _members(
    {
        ("trl.trainer.utils", "call", _PPO[:1]): {
            "selective_log_softmax_and_entropy": (
                ("logits", "index", "entropy_requires_grad", "temperature"),
                "2-tuple (token log-probs, entropy), both shaped like `index`",
            ),
            "disable_dropout_in_model": (("model",), "None (every Dropout's p to 0)"),
            "add_fused_lm_head": (("model",), "None; `fused_lm_head=True` calls"),
        },
        ("trl.trainer.utils", "call", _PPO[2:]): {"get_callable_name": (("func",), "the reward function's log name")},
        ("trl.trainer.base_trainer._BaseTrainer", "override", _PPO_SAVING): {
            "create_model_card": (
                ("model_name", "dataset_name", "tags"),
                "None; writes README.md in output_dir from `_name`, `_paper`, `_tag_names` and `model.config`",
            ),
        },
        (_T, "call", _PPO_TRAINER): {
            "_prepare_for_training": (
                ("max_steps", "train_dataloader", "resume_from_checkpoint"),
                "(prepared model, dataloader); builds the optimizer (deepspeed_init under DeepSpeed) and the "
                "scheduler over `max_steps` optimizer steps; PPO calls it once, in __init__, so the step API has them",
            ),
            "_clip_grad_norm": (("model",), "the pre-clip gradient norm (None under DeepSpeed's start)"),
            "_track_num_input_tokens": (
                ("inputs",),
                "None; adds the batch's tokens over every process to `state.num_input_tokens_seen` (MIRRORED)",
            ),
            "_finalize_training": (
                ("trial", "num_train_samples", "start_time"),
                "the TrainOutput; reads `_tr_loss`, `_total_loss_scalar`, `_initial_global_step` (MIRRORED), "
                "logs the speed metrics, loads the best model, calls on_train_end and waits for the hub push",
            ),
        },
        (_T, "override", _PPO_PROMPTS): {
            "_get_train_sampler": (
                ("train_dataset",),
                "the sampler of `train_sampling_strategy`; for group_by_length a `LengthGroupedSampler` whose "
                "`lengths` and `generator` PPO reuses",
            ),
        },
        ("transformers.trainer_pt_utils.LengthGroupedSampler", "call", _PPO_PROMPTS): {
            "__init__": (
                ("batch_size", "dataset", "lengths", "model_input_name", "generator"),
                "a sampler grouping rows of similar `lengths` into batches of `batch_size`",
            ),
        },
        (_T, "call", _PPO_TRAINER + _PPO_LOOP): {
            "_evaluate": (("trial", "ignore_keys_for_eval", "skip_scheduler"), "the eval metrics")
        },
        (_T, "call", _PPO_LOOP): {"_determine_best_metric": (("metrics", "trial"), "whether a new best was reached")},
        (_T, "override", _PPO_SAVING): {
            "_save": (("output_dir", "state_dict"), "None; what save_model writes"),
            "_load_from_checkpoint": (
                ("resume_from_checkpoint", "model"),
                "None; loads full weights, shards or the adapter into `model` (PPO passes its policy, then loads "
                "its value head)",
            ),
            "_load_best_model": ((), "None"),
        },
        (_T, "call", _PPO_SAVING): {
            "_load_optimizer_and_scheduler": (("checkpoint",), "None"),
            "_load_scaler": (("checkpoint",), "None"),
            "_load_callback_state": ((), "None (honours restore_callback_states_from_checkpoint)"),
            "_load_rng_state": (("checkpoint",), "None"),
        },
        (_STATE, "call", _PPO_LOOP + _PPO_SAVING): {
            "init_training_references": (
                ("trainer", "max_steps", "num_train_epochs", "trial"),
                "None; sets max_steps, num_train_epochs and the process flags on the state",
            ),
        },
        (_STATE, "call", _PPO_LOOP): {
            "compute_steps": (
                ("args", "max_steps"),
                "sets logging_steps / save_steps / eval_steps from `args` (fractions of max_steps resolved)",
            ),
        },
        ("transformers.integrations.deepspeed", "call", _PPO_SAVING): {
            "deepspeed_load_checkpoint": (
                ("deepspeed_engine", "checkpoint_path", "load_module_strict"),
                "None; loads the engine's checkpoint (weights, optimizer) written by `_save_optimizer_and_scheduler`",
            ),
        },
        ("transformers.trainer_utils", "call", _PPO_PROMPTS): {
            "seed_worker": (("worker_id", "num_workers", "rank"), "None; Trainer's dataloader worker_init_fn")
        },
    }
)
# TRL's vLLM helper, which PPO's vLLM rollouts drive as GRPO does (`trl_stable/trainers/ppo/vllm.py`).
_PPO_VLLM = ("trl_stable/trainers/ppo/vllm.py",)
_VLLM_GENERATION = "trl.generation.vllm_generation.VLLMGeneration"
VLLM_MEMBERS: tuple[Member, ...] = _members(
    {
        (_VLLM_GENERATION, "call", _PPO_VLLM): {
            "__init__": (
                ("model", "accelerator", "processing_class", "mode"),
                "a helper holding the colocate engine in `llm` or the server client; keyword arguments as "
                "GRPOTrainer passes",
            ),
            "generate": (
                ("prompts", "images", "num_generations"),
                "4-tuple (prompt_ids, completion_ids, logprobs [B][T][1] with None for NaN, logprob_token_ids)",
            ),
            "sync_weights": ((), "None (gathers shards, merges LoRA, loads into vLLM)"),
        },
        (_VLLM_GENERATION, "patch", _PPO_VLLM): {
            "llm": (
                (),
                "the colocate `vllm.LLM`; its `generate` is wrapped for one call to read `routed_experts` (R3)",
            ),
        },
        ("trl.generation.vllm_generation", "patch", _PPO_VLLM): {
            "LLM": (
                (),
                "the engine class `_init_vllm` builds from; replaced while the helper is built, to pass "
                "`enable_return_routed_experts=True` (R3)",
            ),
        },
    }
) + _attrs(
    _VLLM_GENERATION,
    {"max_completion_length": (_PPO_VLLM, "set per call: `generate` reads it for vLLM's max_tokens")},
)
# Helpers TRL keeps outside its top-level API that the rest of trl_stable calls or subclasses.
HELPER_MEMBERS: tuple[Member, ...] = _members(
    {
        ("trl.trainer.utils", "call", _ADVANTAGES_PY): {"nanstd": (("tensor",), "std ignoring NaN")},
        ("trl.models.utils", "call", _DECOUPLED_PY): {
            "disable_gradient_checkpointing": (
                ("model", "gradient_checkpointing_kwargs"),
                "a context manager (the proximal forward runs without recomputation)",
            ),
        },
        ("trl.trainer.utils", "call", (*_REWARD_CALLS_PY, *_REWARDS_PY)): {"is_async_callable": (("func",), "bool")},
        ("trl.trainer.utils", "call", _REWARD_CALLS_PY): {
            "start_event_loop_in_daemon": (("name",), "3-tuple (thread, loop, ready event)"),
            "shutdown_event_loop_in_daemon": (("thread", "loop"), "None"),
        },
        ("trl.trainer.sft_trainer.DataCollatorForLanguageModeling", "override", ("trl_stable/masking/sft.py",)): {
            "torch_call": (
                ("examples",),
                "a batch dict with `labels` (-100 where no loss); `padding_free` packs rows into one",
            ),
        },
    }
) + _attrs(
    "httpx2.HTTPTransport",
    {
        "_pool": (
            ("trl_stable/rewards/critic/transport.py",),
            "the httpcore pool (ConnectionPool, or HTTPProxy for a proxy) built from the transport's settings; the "
            "critic sends through its public `request` (tests/rewards/test_chat_http.py)",
        )
    },
)
# What PPOTrainer takes from TRL and accelerate to run under DeepSpeed / FSDP (`trl_stable.trainers.ppo.engines`):
# TRL's engine helpers of `trl.models` (exported there, outside TRL's documented API) and accelerate's private setter
# of the "this backward closes an optimizer step" flag that DeepSpeed's engine steps on.
_ENGINES_PY = ("trl_stable/trainers/ppo/engines.py",)
ENGINE_MEMBERS: tuple[Member, ...] = _members(
    {
        ("trl.models", "call", _ENGINES_PY): {
            "unwrap_model_for_generation": (
                ("model", "accelerator"),
                "a context manager yielding the unwrapped module with ZeRO-3 parameters gathered (reads and "
                "toggles `is_gradient_checkpointing` / `gradient_checkpointing_disable` / `_enable` on it)",
            ),
            "prepare_deepspeed": (("model", "accelerator"), "a DeepSpeed engine"),
            "prepare_fsdp": (("model", "accelerator"), "the FSDP-wrapped model"),
        },
        ("accelerate.state.GradientState", "call", ("trl_stable/trainers/ppo/ppo_trainer.py",)): {
            "_set_sync_gradients": (
                ("sync_gradients",),
                "None; `accelerator.backward` passes the flag to DeepSpeed as the accumulation boundary",
            ),
        },
    }
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
