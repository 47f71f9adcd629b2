"""Configuration of trl_stable's PPOTrainer: the RELC-era PPO fields next to the usual `TrainingArguments`.

Every inherited field is honored as `transformers.Trainer` honors it, or refused by name with the reason
(`PPO_UNSUPPORTED`, and fields that only act with another option); `docs/ppo.md` lists every field.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import TrainingArguments
from transformers.utils import is_torch_tf32_available

from trl_stable.core.kl import kl_estimator_names
from trl_stable.monitoring.integration import PPOHealthArguments
from trl_stable.rewards.dense import DEFAULT_MAX_ABS_REWARD
from trl_stable.settings.checks import (
    Bound,
    Dependent,
    check_all_finite,
    check_bounds,
    check_ddp_backend,
    check_dependents,
    check_fp16_device,
    check_reward_scale,
    check_training_length,
    option,
    training_argument_bounds,
    training_argument_dependents,
)
from trl_stable.settings.secrets import SecretsNotPickled
from trl_stable.trainers.decoupled_args import DecoupledLossArguments
from trl_stable.trainers.ppo.vllm_args import VLLMArguments
from trl_stable.trainers.step_mask_args import StepMaskArguments

_SAME_PRECISION = "PPO evaluates by generating with the training policy, in its training precision."

# `TrainingArguments` fields PPO has nothing to apply to (no labels, no prediction loop, no loss over a dataloader's
# batches): (the value that is accepted, why another one is refused).
PPO_UNSUPPORTED: dict[str, tuple[object, str]] = {
    "label_smoothing_factor": (0.0, "PPO's policy loss has no labels to smooth."),
    "neftune_noise_alpha": (None, "NEFTune noises training passes only, so the PPO ratio would not start at 1."),
    "use_liger_kernel": (False, "PPO takes its log-probs from TRL's fused LM head or the logits, not from Liger."),
    "liger_kernel_config": (None, "it configures `use_liger_kernel`, which PPO does not use."),
    "auto_find_batch_size": (
        False,
        "PPO's batches are its config's: lower per_device_train_batch_size to fit memory.",
    ),
    "bf16_full_eval": (False, _SAME_PRECISION),
    "fp16_full_eval": (False, _SAME_PRECISION),
    "prediction_loss_only": (False, "PPO's evaluation generates and scores completions; it predicts no loss."),
    "eval_do_concat_batches": (True, "PPO's evaluation gathers rewards, not predictions to concatenate."),
    "eval_use_gather_object": (False, "PPO's evaluation gathers rewards, not prediction objects."),
    "eval_accumulation_steps": (None, "PPO's evaluation accumulates no predictions."),
    "include_for_metrics": ([], "PPO's evaluation has no compute_metrics inputs to include."),
    "batch_eval_metrics": (False, "PPO's evaluation has no compute_metrics to call per batch."),
    "label_names": (None, "PPO's batches have no labels."),
    "parallelism_config": (None, "PPO runs under DDP, ZeRO or FSDP2, not tensor/context/sequence parallelism."),
    "average_tokens_across_devices": (False, "PPO averages each micro-batch's loss over its own tokens (as RELC)."),
    "remove_unused_columns": (False, "every column of train_dataset is passed to the reward functions."),
    # flags for your own script, which transformers' Trainer does not read either
    "do_train": (False, "no trainer reads it: training runs when your script calls trainer.train()."),
    "do_predict": (False, "PPOTrainer has no prediction loop: generate and score with trainer.evaluate(dataset)."),
    "debug": ("", "it watches Trainer's own loop, which PPO does not run."),
}

# Every numeric field of PPOConfig and what is valid (the TrainingArguments ones are in
# `trl_stable.settings.checks.TRAINING_ARGUMENT_BOUNDS`; the token filter's and the health monitor's check themselves).
PPO_BOUNDS: dict[str, Bound] = {
    "num_shared_layers": Bound(low=0, integer=True, optional=True, fix="None copies every layer."),
    "batch_size": Bound(low=1, integer=True),
    "per_device_train_batch_size": Bound(low=1, integer=True),
    "mini_batch_size": Bound(low=1, integer=True, optional=True, fix="None uses per_device_train_batch_size."),
    "ppo_epochs": Bound(low=1, integer=True),
    "init_kl_coef": Bound(low=0.0, fix="0 turns the KL penalty off."),
    "target": Bound(low=0.0, low_open=True, optional=True),
    "horizon": Bound(low=0.0, low_open=True, optional=True),
    "target_kl": Bound(low=0.0, low_open=True, optional=True, fix="None (or early_stopping=False) disables the stop."),
    "cliprange": Bound(low=0.0, low_open=True),
    "cliprange_value": Bound(low=0.0, low_open=True),
    "vf_coef": Bound(low=0.0, fix="A negative coefficient would ascend the value error."),
    # the first mini-batch of every step has mean ratio 1
    "ratio_threshold": Bound(low=1.0, low_open=True, fix="A threshold <= 1 zeroes (nearly) every loss; RELC uses 10."),
    "gamma": Bound(low=0.0, high=1.0),
    "lam": Bound(low=0.0, high=1.0),
    "lam_alpha": Bound(low=0.0, low_open=True),
    "lam_q": Bound(low=0.0, high=1.0, low_open=True),
    "score_clip": Bound(low=0.0, low_open=True, optional=True, fix="None disables the clip."),
    "max_abs_reward": Bound(low=0.0, low_open=True, optional=True, fix="None bounds only +-inf."),
    "reward_max_failing_steps": Bound(low=1, integer=True, optional=True, fix="None never stops."),
    "max_prompt_length": Bound(low=1, integer=True, optional=True, fix="None keeps whole prompts."),
    "min_new_tokens": Bound(low=0, integer=True, optional=True, fix="None always generates max_new_tokens."),
    "max_new_tokens": Bound(low=1, integer=True),
    "temperature": Bound(low=0.0, low_open=True),
    "top_k": Bound(low=0, integer=True, fix="0 turns top-k off."),
    "top_p": Bound(low=0.0, high=1.0, low_open=True, fix="1.0 turns nucleus sampling off."),
    "generation_batch_size": Bound(low=1, integer=True, optional=True, fix="None generates the whole batch at once."),
    "health_reward_max": Bound(optional=True, fix="None declares no maximum."),
    "vllm_gpu_memory_utilization": Bound(low=0.0, high=1.0, low_open=True),
    "vllm_tensor_parallel_size": Bound(low=1, integer=True),
}


@dataclass
class PPOConfig(
    SecretsNotPickled, TrainingArguments, PPOHealthArguments, DecoupledLossArguments, StepMaskArguments, VLLMArguments
):
    r"""Configuration for [`PPOTrainer`]: PPO with a value model and per-token (dense) rewards.

    Every field of [`~transformers.TrainingArguments`] plus those of the RELC-era `trl.PPOConfig`, with their
    meanings and defaults; one step (`state.global_step`) is one PPO iteration (`docs/ppo.md`, "How one PPO step
    works", and its configuration reference); the `TrainingArguments` defaults it changes come first below.
    """

    # --- overridden TrainingArguments defaults ---
    learning_rate: float = option(1.41e-5, "Adam learning rate (RELC default 1.41e-5).")
    seed: int = option(0, "Random seed (sampling, shuffling, value-head init).")
    logging_steps: float = option(1, "Log every X PPO steps (a float in [0, 1) is a ratio of the total steps).")
    lr_scheduler_type: str = option("constant", "Learning-rate schedule over optimizer steps (transformers names).")
    average_tokens_across_devices: bool = option(
        False, "False: each micro-batch's loss is averaged over its own tokens."
    )
    remove_unused_columns: bool = option(False, "False: every train_dataset column reaches the reward functions.")

    # --- model / run identity ---
    model_name: str | None = option(None, "Name or path of the policy, used when `PPOTrainer(model=None)`.")
    model_init_kwargs: dict | None = option(None, "Keyword arguments of `from_pretrained` for a policy given by name.")
    load_in_4bit: bool = option(False, "Load a policy given by name in 4-bit (bitsandbytes, CUDA, `peft_config`).")
    load_in_8bit: bool = option(False, "Load a policy given by name in 8-bit (bitsandbytes, CUDA, `peft_config`).")
    num_shared_layers: int | None = option(
        None, "First layers (and embeddings) shared by the policy and the reference, frozen. None: none."
    )
    disable_dropout: bool = option(True, "Turn dropout off in every model, so the first update's ratio is 1.")
    log_with: str | None = option(None, "RELC-era alias of `report_to`; overrides it.")

    # --- batch geometry ---
    batch_size: int = option(16, "Rollout samples (prompts) per process per PPO step.")
    per_device_train_batch_size: int = option(
        16,  # RELC's: the rollout batch size PPO used before `per_device_train_batch_size` took the micro-batch's role
        "The micro-batch: samples per forward/backward (x gradient_accumulation_steps: one step).",
    )
    mini_batch_size: int | None = option(
        None, "RELC's name of the micro-batch: when set, `per_device_train_batch_size`."
    )
    ppo_epochs: int = option(4, "Optimization passes over each rollout batch.")

    # --- KL penalty and controller ---
    kl_penalty: str = option(
        "kl", "Per-token KL estimator: 'kl', 'abs', 'mse', 'k3', 'low_var_kl', 'full' or registered."
    )
    adap_kl_ctrl: bool = option(True, "Adapt kl_coef toward `target` (Ziegler et al. 2019); else fixed.")
    init_kl_coef: float = option(0.2, "Initial (or fixed) KL coefficient.")
    target: float = option(6.0, "Target sequence KL of the adaptive controller.")
    horizon: float = option(10000.0, "Horizon (in samples) of the adaptive controller.")
    target_kl: float | None = option(6.0, "Stop a step's epochs when the policy KL exceeds 1.5 x target_kl.")
    early_stopping: bool = option(True, "Enable the `target_kl` early stop.")

    # --- losses ---
    cliprange: float = option(0.2, "PPO ratio clip range epsilon.")
    cliprange_value: float = option(0.2, "Clip range of the value predictions.")
    vf_coef: float = option(0.1, "Value loss coefficient.")
    ratio_threshold: float = option(10.0, "Zero a mini-batch's loss when its mean ratio exceeds this (loss spikes).")
    use_decoupled_loss: bool = option(False, "Decoupled PPO loss (AReaL): the clip term times the behavior weight.")
    # token_filter, token_filter_level/_action/_lower/_upper: from DecoupledLossArguments

    # --- advantages ---
    gamma: float = option(1.0, "Discount factor of GAE.")
    lam: float = option(0.95, "GAE lambda (used when `lam_schedule` is None).")
    lam_schedule: str | None = option(None, "Per-sequence GAE lambda from its length: 'vapo' or 'relative_position'.")
    lam_alpha: float = option(0.05, "alpha of the VAPO length-adaptive lambda.")
    lam_q: float = option(0.5, "q of the relative-position lambda: weight of the last token's TD error.")
    whiten_rewards: bool = option(False, "Whiten the per-token rewards over the batch before GAE, keeping their mean.")
    whiten_advantages: bool = option(True, "Whiten the advantages over the batch.")
    bootstrap_truncated: bool = option(
        False, "Bootstrap responses cut before EOS from the value after their last token (Pardo 2018)."
    )

    # --- scores ---
    reward_weights: list[float] | None = option(
        None, "Weights of the reward functions (sequence and dense), in order. None: all 1."
    )
    multi_objective_aggregation: str = option(
        "sum", "'sum' (weighted) or 'normalize_then_sum' (GDPO) of the sequence rewards."
    )
    use_score_scaling: bool = option(False, "Divide the scores by their running std.")
    use_score_norm: bool = option(False, "With `use_score_scaling`, also subtract the running mean of the scores.")
    score_clip: float | None = option(None, "Clip the sequence scores to +-score_clip.")
    reward_max_failing_steps: int | None = option(
        5, "Stop after a reward function failed wholesale this many steps in a row."
    )
    max_abs_reward: float | None = option(
        DEFAULT_MAX_ABS_REWARD, "Rewards beyond +-max_abs_reward count as NaN, with a warning (None: only +-inf)."
    )
    nan_reward_action: str = option("drop", "A sample without a reward: 'drop' it, or give it advantage 0 ('zero').")

    # --- generation ---
    max_prompt_length: int | None = option(512, "Keep at most this many (rightmost) prompt tokens in `train()`.")
    min_new_tokens: int | None = option(None, "Draw each generation cap from [min_new_tokens, max_new_tokens] (RELC).")
    max_new_tokens: int = option(20, "Maximum number of generated tokens.")
    temperature: float = option(1.0, "Sampling temperature (log-probs use it too).")
    top_k: int = option(0, "Top-k sampling (0: off).")
    top_p: float = option(1.0, "Nucleus sampling threshold (1.0: off).")
    generation_batch_size: int | None = option(None, "Generate in chunks of this many prompts (None: all at once).")
    fused_lm_head: bool | None = option(
        None, "Log-probs through TRL's fused LM head (no [B, R, V] logits). None: on CUDA."
    )
    generation_kwargs: dict | None = option(
        None, "Extra `generate` arguments (override the fields above); with `use_vllm`, SamplingParams."
    )
    step_loss_mask: bool = option(
        False, "Remove the tokens of invalid agent steps (malformed tool calls) from the policy loss."
    )
    # step_mask_tools: from StepMaskArguments
    routing_replay: str = option("off", "MoE routing replay: 'off', 'R2' (rollout pass's) or 'R3' (sampler's).")

    def __post_init__(self):
        if self.log_with is not None:
            if self.report_to not in (None, "none", [], ["none"], self.log_with, [self.log_with]):
                raise ValueError(
                    f"log_with={self.log_with!r} and report_to={self.report_to!r} both set the trackers: set one."
                )
            self.report_to = self.log_with
        # RELC's name of the micro-batch wins rather than conflicting: `dataclasses.replace(config, mini_batch_size=)`
        # carries the micro-batch an earlier validation wrote into `per_device_train_batch_size`
        if self.mini_batch_size is not None:
            self.per_device_train_batch_size = self.mini_batch_size
        if self.max_grad_norm is None:  # PPO's spelling of "no clipping", transformers' is 0
            self.max_grad_norm = 0.0
        # Before TrainingArguments' own checks, which divide by some of these (a zero accumulation would be a
        # ZeroDivisionError there and below, not an error naming the field).
        check_bounds(self, {**training_argument_bounds(self), **PPO_BOUNDS})
        # also before: what `TrainingArguments.__post_init__` would fail on without saying the fix (bf16_full_eval on a
        # CPU among them), or would fill in so that PPO's evaluation cannot answer it
        for name, (accepted, why) in PPO_UNSUPPORTED.items():
            value = getattr(self, name)
            if value != accepted and not (accepted in ([], "") and not value):
                raise ValueError(f"{name}={value!r} is not supported by PPOTrainer: {why} Leave it at {accepted!r}.")
        if self.tf32 and not is_torch_tf32_available():
            raise ValueError("tf32=True needs an NVIDIA Ampere (or newer) GPU, not found here: leave tf32=None.")
        check_ddp_backend(self)
        schedule = str(getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type))
        if self.metric_for_best_model is None and (
            self.load_best_model_at_end or schedule in ("reduce_lr_on_plateau", "greedy")
        ):
            what = "load_best_model_at_end=True" if self.load_best_model_at_end else f"lr_scheduler_type={schedule!r}"
            raise ValueError(
                f"{what} compares evaluations by metric_for_best_model, which transformers would set to 'loss', but "
                "PPO's evaluation has no loss: set metric_for_best_model='reward' or another metric `evaluate` logs."
            )
        super().__post_init__()
        # after: a setting PPO would have to ignore once transformers resolved it
        if self.train_sampling_strategy == "batch_rebalance":
            raise ValueError(
                "train_sampling_strategy='batch_rebalance' does not apply to generated PPO batches: use 'random', "
                "'sequential' or 'group_by_length'."
            )
        if self.accelerator_config.split_batches:
            raise ValueError("accelerator_config.split_batches=True: PPO's batch_size is per process; leave it False.")
        # the kwargs besides sync_each_batch configure `accumulate()`, unused here
        unread = sorted(set(self.accelerator_config.gradient_accumulation_kwargs or {}) - {"sync_each_batch"})
        if unread:
            raise ValueError(
                f"accelerator_config.gradient_accumulation_kwargs {unread} are not supported by PPOTrainer (it does "
                "not use `accumulate()`): set gradient_accumulation_steps; only 'sync_each_batch' is read."
            )
        optim = str(getattr(self.optim, "value", self.optim))
        if optim in ("lomo", "adalomo"):  # they update the weights inside the backward pass
            raise ValueError(
                f"optim={optim!r} is not supported by PPOTrainer: LOMO steps inside the backward pass, but PPO "
                "decides after it whether the step happens (early_stopping, ratio_threshold). Use e.g. 'adamw_torch'."
            )
        if self.do_eval and str(getattr(self.eval_strategy, "value", self.eval_strategy)) == "no":
            raise ValueError("do_eval=True is read by no trainer: set eval_strategy='steps' or 'epoch' instead.")
        check_fp16_device(self)
        if self.local_rank != -1 and self.local_rank != self.local_process_index:
            raise ValueError(
                f"local_rank={self.local_rank} but the launcher set {self.local_process_index}. Leave local_rank=-1."
            )
        check_all_finite(self)
        check_training_length(self)
        self.validate_health_arguments()
        from trl_stable.moe.hook import check_routing_replay_mode  # lazy: keeps this module import-light

        check_routing_replay_mode(self.routing_replay)
        backward = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.batch_size % backward != 0:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by per_device_train_batch_size x "
                f"gradient_accumulation_steps ({self.per_device_train_batch_size} x {self.gradient_accumulation_steps}"
                f" = {backward}); change one of them."
            )
        check_reward_scale(self)
        if self.kl_penalty not in kl_estimator_names():
            raise ValueError(
                f"kl_penalty must be one of {kl_estimator_names()} or a name registered with "
                f"`trl_stable.core.register_kl_estimator`, got {self.kl_penalty!r}."
            )
        for name, allowed in (
            ("nan_reward_action", ("drop", "zero")),
            ("lam_schedule", (None, "vapo", "relative_position")),
            ("multi_objective_aggregation", ("sum", "normalize_then_sum")),  # 'normalize_then_sum' is GDPO
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if self.adap_kl_ctrl and (self.target is None or self.horizon is None or self.init_kl_coef == 0):
            raise ValueError(
                f"adap_kl_ctrl=True needs init_kl_coef, target, horizon > 0, got init_kl_coef={self.init_kl_coef:g}, "
                f"target={self.target}, horizon={self.horizon}: set them, or adap_kl_ctrl=False."
            )
        if self.min_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be between 0 and max_new_tokens ({self.max_new_tokens})."
            )
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("Choose one of load_in_4bit and load_in_8bit.")
        check_dependents(
            self,
            (
                Dependent(("target", "horizon"), self.adap_kl_ctrl, "adap_kl_ctrl=True (the adaptive KL controller)"),
                Dependent(("target_kl",), self.early_stopping, "early_stopping=True"),
                Dependent(("lam",), self.lam_schedule is None, "lam_schedule=None (a schedule sets lambda itself)"),
                Dependent(("lam_alpha",), self.lam_schedule == "vapo", "lam_schedule='vapo'"),
                Dependent(("lam_q",), self.lam_schedule == "relative_position", "lam_schedule='relative_position'"),
                Dependent(("use_score_norm",), self.use_score_scaling, "use_score_scaling=True"),
                *training_argument_dependents(self),
            ),
        )
        self.validate_decoupled_loss_arguments()
        self.validate_step_mask_arguments()
        self.validate_vllm_arguments()
