"""PPO with a value model and per-token (dense) rewards, a `transformers.Trainer` (through TRL's base trainer).

TRL 1.16 ships no PPO; this is trl_stable's own, built the way TRL's last PPOTrainer was: the PPO iteration and the
training loop are ours, everything else is `Trainer`'s — the accelerator and engine set-up (DDP, DeepSpeed, FSDP2),
the optimizer and scheduler (every `optim`, `optim_args`), the dataloader, callbacks and `report_to` integrations,
state and logging, checkpoint saving, rotation and resume, `push_to_hub` and the model card. Two ways to drive it:

- `trainer.train()`: over a prompt dataset, with reward functions (sequence-level reward models / callables and
  dense callables marked with `trl_stable.rewards.dense_reward`); `eval_dataset` / `eval_strategy` evaluate by
  generating on the eval prompts and scoring them with the same functions (`evaluate`).
- the step API of the RELC-era scripts: ``responses = trainer.generate(queries, return_prompt=False)``, compute
  rewards, then ``stats = trainer.step(queries, responses, token_rewards)``.

One PPO step, top to bottom in `step`:

1. **rollout** (`generate`): sample responses; the returned `Rollout` carries the sampler's log-probs and MoE routing
   to the step.
2. **rollout pass** (`rollout_pass`): under no grad, the log-probs and values of the rollout policy, the reference
   log-probs and the per-token KL.
3. **rewards and advantages** (`compute_advantages`): $r_t = -\\beta\\, KL_t + d_t + s\\cdot[t = last]$
   (`core.compose_token_rewards`), then GAE over tokens or turns (the ``"gae"`` / ``"turn_gae"`` estimators of
   `core.estimators`, the registry GRPO's estimators live in too).
4. **update** (`update`): `ppo_epochs` passes over shuffled mini-batches with the clipped policy loss (or the
   decoupled loss with IcePop / KPop) and the clipped value loss; one optimizer step per mini-batch.

The model wiring lives in `trl_stable.trainers.ppo.models` and the reward calling in `trl_stable.trainers.ppo.rewards`.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch
from accelerate import PartialState
from accelerate.data_loader import skip_first_batches
from accelerate.utils import gather_object, set_seed
from accelerate.utils.memory import clear_device_cache
from torch import nn
from transformers import AutoTokenizer, TrainerCallback
from transformers.integrations.deepspeed import deepspeed_load_checkpoint
from transformers.optimization import GreedyLR
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_callback import TrainerState
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, TrainOutput, seed_worker, speed_metrics
from trl.trainer.base_trainer import _BaseTrainer

from trl_stable.config_checks import field_default
from trl_stable.core.behaviour_weights import behaviour_weight, filter_behaviour_weight
from trl_stable.core.estimators import AdvantageInputs, get_advantage_estimator
from trl_stable.core.gae import count_turns, relative_position_lambda, vapo_lambda
from trl_stable.core.kl import AdaptiveKLController, FixedKLController, full_kl, kl_estimate
from trl_stable.core.masked_stats import masked_mean, masked_whiten
from trl_stable.core.policy_loss import decoupled_ppo_loss, policy_clip_fraction, ppo_clip_term, pre_mask_token_mean
from trl_stable.core.positions import position_ids_from_mask
from trl_stable.core.score_scaling import RunningMoments
from trl_stable.core.score_scaling import scale_scores as scale_with_moments
from trl_stable.core.token_rewards import compose_token_rewards, last_action_index
from trl_stable.core.value_loss import clipped_value_loss
from trl_stable.integration.hf_names import model_name_of, rng_state_file
from trl_stable.masking.completion_steps import CompletionStepMasker
from trl_stable.moe.hook import ROUTED_EXPERTS_KEY, RoutingHook, batch_routing
from trl_stable.monitoring.integration import attach_health_monitor
from trl_stable.monitoring.mismatch import behaviour_filter_metrics, mismatch_stats
from trl_stable.monitoring.reduction import Stat, reduce_metrics, step_mask_stats
from trl_stable.rewards.dense import (
    RewardContractError,
    RewardTypeError,
    call_on_every_process,
    raise_on_every_process,
    record_reward_failures,
    reward_numbers,
)
from trl_stable.rewards.failure_guard import FailureGuard
from trl_stable.sampler_logprobs import record_sampler_logps
from trl_stable.trainers.checkpoints import (
    TRAINER_STATE_FILE,
    CheckpointInfo,
    MarkedCheckpoints,
    check_checkpoint_names,
    load_stable_state,
    resolve_checkpoint,
    restore_stable_state,
)
from trl_stable.trainers.ppo.engines import (
    Engine,
    check_engine,
    configure_deepspeed,
    generation_call,
    is_zero3_partitioned,
    prepare_reference,
    require_deepspeed_if_asked,
    sync_gradients,
)
from trl_stable.trainers.ppo.models import (
    PolicyAndValue,
    ResponseScores,
    add_fused_logprob_head,
    build_value_head,
    enable_activation_checkpointing,
    fused_logprob_labels,
    fused_scores,
    is_quantized,
    load_policy,
    prepare_policy,
    reference_model,
    response_logprobs,
)
from trl_stable.trainers.ppo.ppo_config import PPOConfig
from trl_stable.trainers.ppo.rewards import RewardFunctions
from trl_stable.trainers.ppo.rollout import LengthSampler, Rollout
from trl_stable.trainers.ppo.value_head import VALUE_HEAD_FILE, ValueHead
from trl_stable.trainers.ppo.vllm import VLLMRollouts, check_vllm_routing, vllm_rollout
from trl_stable.trainers.prompt_checks import (
    check_generation_budget,
    check_prompt_column,
    empty_prompt_error,
    first_error,
    model_context,
    too_long_error,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "LengthSampler",
    "PPOConfig",
    "PPOTrainer",
    "Rollout",
    "RunningMoments",
]

PPO_CITATION = """\
@article{schulman2017proximal,
    title        = {{Proximal Policy Optimization Algorithms}},
    author       = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
    year         = 2017,
    eprint       = {arXiv:1707.06347}
}"""
VALUE_MODEL_DIR = "value_model"
# transformers' schedules that need the run's length in optimizer steps (the others run without a horizon)
_HORIZON_FREE_SCHEDULES = ("constant", "constant_with_warmup", "reduce_lr_on_plateau")
# schedules that step on evaluation metrics, not per optimizer step (as in Trainer's loop)
_METRIC_SCHEDULES = (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)


def _rows(rows: list[dict]) -> list[dict]:
    """The dataloader's collator: a batch is the list of its rows (prompts are tokenized by the trainer)."""
    return rows


class PPOTrainer(MarkedCheckpoints, _BaseTrainer):
    """PPO trainer with a value model, a reference model and per-token rewards.

    A `transformers.Trainer`: `args` are honoured as `Trainer` honours them (optimizer, scheduler, callbacks,
    logging, evaluation, checkpoints, hub), see `docs/ppo.md` for how the batch fields map onto PPO's batches.

    Args:
        model: The policy: a causal LM, or its name/path (loaded with `args.model_init_kwargs`). None: use
            `args.model_name`.
        reward_funcs: Reward function(s) for `train()` and `evaluate()`: a sequence-classification model (nn.Module)
            or its name, a callable ``f(prompts, completions, completion_ids, **dataset_columns) -> list[float |
            None]`` (TRL's reward-function signature), or a dense callable marked with
            `trl_stable.rewards.dense_reward` that returns per-token rewards aligned to the completion tokens (called
            after the sequence-level ones with ``env_rewards=``, the weighted sum of sequence rewards per sample). What
            None, NaN and inf mean is `trl_stable.rewards.dense`'s contract, the same as in GRPO; a sample no
            sequence-level function applies to follows `args.nan_reward_action`. Several functions are combined with
            `args.reward_weights`. Not needed for the step API.
        args: A `PPOConfig`. None: defaults with `output_dir="ppo_output"`.
        train_dataset: Prompts for `train()`: a "prompt" column (text or chat messages) or an "input_ids" column
            (token ids). Other columns are passed to the reward functions as keyword lists.
        eval_dataset: Prompts for `evaluate()` (same columns), or a dict of them (each evaluated under its name).
        processing_class: The tokenizer (left padding is used for generation). None: loaded from the model name.
        ref_model: The frozen reference model. None: with `peft_config` (or a PEFT policy) the policy with its
            adapter disabled; else a frozen copy of the policy sharing its first `args.num_shared_layers` layers.
        value_model: None: a scalar value head on the policy's last hidden state (shared backbone, RELC style).
            A `ValueHead`: that head on the policy backbone (its hidden size must match). A `PreTrainedModel`
            (causal LM, base model or 1-label sequence classifier): a separate critic; a 1-output `score` head is
            reused, otherwise a new value head is put on its backbone.
        reward_processing_classes: Tokenizers of the reward models (same order as `reward_funcs`; None entries:
            loaded from the reward model's name, as TRL's GRPO does).
        callbacks: `transformers.TrainerCallback`s, called as `Trainer` calls them; `state.log_history` holds every
            logged dict.
        optimizers: (optimizer, lr_scheduler); None entries are built by `Trainer` from `args`.
        peft_config: A `peft.PeftConfig`: train a LoRA adapter (+ the value head) instead of the full policy.
        lam_fn: A callable ``lam_fn(lengths: LongTensor[B]) -> Tensor[B]`` giving a GAE lambda per sequence from
            its effective length (the number of steps GAE runs over: action tokens, or turns with `turn_ids`; 0 for
            a dropped sample); replaces `args.lam` / `args.lam_schedule`, which must then be left unset.

    Example:
        ```python
        trainer = PPOTrainer(model, args=PPOConfig(output_dir="out", batch_size=8, per_device_train_batch_size=8))
        responses = trainer.generate(queries, return_prompt=False)
        token_rewards = [[0.0] * (len(r) - 1) + [score] for r, score in zip(responses, scores)]
        stats = trainer.step(queries, responses, token_rewards)
        ```
    """

    _tag_names = ["trl", "ppo", "trl_stable"]
    _name = "PPO"
    _paper = {"title": "Proximal Policy Optimization Algorithms", "id": "1707.06347", "citation": PPO_CITATION}

    def __init__(
        self,
        model: str | nn.Module | None = None,
        reward_funcs: Any | Sequence[Any] | None = None,
        args: PPOConfig | None = None,
        train_dataset: Any | None = None,
        eval_dataset: Any | None = None,
        processing_class: Any | None = None,
        ref_model: nn.Module | None = None,
        value_model: nn.Module | None = None,
        reward_processing_classes: Any | Sequence[Any] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any | None] = (None, None),
        peft_config: Any | None = None,
        lam_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        args = PPOConfig(output_dir="ppo_output") if args is None else args
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a trl_stable PPOConfig, got {type(args).__name__}.")
        require_deepspeed_if_asked()
        set_seed(args.seed)  # identical value-head init and model copies on every process

        # --- policy, tokenizer, reference, value model: the Trainer's model is the policy + value wrapper ---
        model = args.model_name if model is None else model
        if model is None:
            raise ValueError("Pass `model` (a causal LM or its name) or set `PPOConfig.model_name`.")
        model_id = model if isinstance(model, str) else model_name_of(model)
        _refuse_unused_arguments(args, model, ref_model, lam_fn)
        if isinstance(model, str):
            model = load_policy(model, args, peft_config, PartialState().local_process_index)
        elif args.load_in_4bit or args.load_in_8bit:
            raise ValueError("load_in_4bit/load_in_8bit apply to a model given by name; pass `model` as a str.")
        if processing_class is None:
            if not model_id:
                raise ValueError("Pass `processing_class` (a tokenizer): it cannot be loaded for an unnamed model.")
            processing_class = AutoTokenizer.from_pretrained(model_id)
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        self.pad_token_id = processing_class.pad_token_id
        self.eos_token_id = processing_class.eos_token_id
        model, self.is_peft = prepare_policy(model, peft_config, args)
        if self.is_peft and args.num_shared_layers is not None:
            raise ValueError(
                f"num_shared_layers={args.num_shared_layers} would share layers between the policy and a copy of it, "
                "but with a PEFT policy the reference is the policy itself with its adapter disabled (nothing is "
                "copied): leave num_shared_layers=None."
            )
        if ref_model is None and not self.is_peft and is_zero3_partitioned(model):
            # ZeRO-3 partitioned the policy as it was built, and a partitioned model cannot be deep-copied
            if not model_id:
                raise ValueError("Under DeepSpeed ZeRO-3 pass `ref_model` (or the policy by name) for the reference.")
            ref_model = load_policy(model_id, args, None, PartialState().local_process_index)
        ref_model = reference_model(model, ref_model, self.is_peft, args)
        value_head, value_backbone = build_value_head(model, value_model, args.disable_dropout)
        if args.activation_checkpointing:
            enable_activation_checkpointing(model, value_backbone, self.is_peft, args)
        if is_quantized(model):
            # accelerate does not move quantised (device-mapped) models: put the head where the policy lives
            value_head.to(next(model.parameters()).device)
        wrapper = PolicyAndValue(model, value_head, value_backbone)

        super().__init__(
            model=wrapper,
            args=args,
            data_collator=_rows,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        check_checkpoint_names(self.args.output_dir)
        if self.args.n_gpu > 1:
            raise ValueError(
                f"PPOTrainer does not run under nn.DataParallel ({self.args.n_gpu} GPUs in one process): launch one "
                "process per GPU with `accelerate launch` (examples/accelerate_configs/multi_gpu.yaml), or make one "
                "GPU visible (CUDA_VISIBLE_DEVICES)."
            )
        self.engine = Engine.of(self.accelerator)
        check_engine(self.engine, args, quantized=is_quantized(model))
        # Log-probs through TRL's fused LM head (no [B, R, V] logits) where it saves memory: on CUDA, or when asked
        fused = args.fused_lm_head if args.fused_lm_head is not None else self.accelerator.device.type == "cuda"
        self.fused_policy = fused and add_fused_logprob_head(model, args.temperature)
        self.fused_ref = fused and ref_model is not None and add_fused_logprob_head(ref_model, args.temperature)

        # --- rewards; the engine set-up, optimizer and scheduler are Trainer's (the step API needs them now) ---
        self.rewards = RewardFunctions(
            reward_funcs, args.reward_weights, reward_processing_classes, processing_class, args.max_abs_reward
        )
        self.rewards.to(self.accelerator.device)
        self.reward_guards = {
            name: FailureGuard(f"Reward function '{name}'", args.reward_max_failing_steps, "reward_max_failing_steps")
            for name in self.rewards.names
        }
        # The data order is the sampler's (seeded with `data_seed` or `seed`): built before the per-process seeding
        # below, which the sampler would otherwise read as its seed.
        self.train_dataloader = self.get_train_dataloader() if train_dataset is not None else None
        if self.is_deepspeed_enabled:
            configure_deepspeed(self.accelerator)
        self.model_wrapped, _ = self._prepare_for_training(self._scheduler_horizon(), None, None)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped
        self.ref_model = None if ref_model is None else prepare_reference(ref_model, self.accelerator, self.engine)
        self.kl_ctl = (
            AdaptiveKLController(args.init_kl_coef, args.target, args.horizon)
            if args.adap_kl_ctrl
            else FixedKLController(args.init_kl_coef)
        )
        self.running = RunningMoments()
        self.lam_fn = lam_fn
        self.current_device = self.accelerator.device  # old TRL's attribute, read by RELC-era scripts
        # Invalid agent steps leave the policy loss (assign `trainer.step_masker` for environment-reported steps).
        self.step_masker = CompletionStepMasker(tools=args.step_mask_tools) if args.step_loss_mask else None
        self.routing = RoutingHook(self.unwrapped().policy, args.routing_replay)
        # The context of every model the sequences go through (a separate value model or reference may differ):
        # a length they cannot take fails here or before `generate`, not as an IndexError inside a forward.
        self.model_contexts = [model_context(m) for m in (model, value_backbone, ref_model) if m is not None]
        self._check_prompts_at_start(train_dataset)
        # vLLM rollouts (TRL's helper): after `prepare`, so the helper sees the engine's (possibly sharded) policy
        self.vllm_rollouts = None
        if args.use_vllm:
            check_vllm_routing(args)
            self.vllm_rollouts = VLLMRollouts(
                self.unwrapped().policy, self.accelerator, processing_class, args, model_id
            )
        # per-process streams: mini-batch shuffling, and sampling in generate (seeded per rank below)
        self.shuffle_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        set_seed(args.seed, device_specific=True)
        self._train_begun = False
        self._step_api_reward_funcs: list[Any] = []  # stateful reward functions a step-API loop checkpoints
        self.tables: dict[str, dict[str, list[Any]]] = {}  # latest table per name (main process), see log_table
        self.health_monitor = attach_health_monitor(self)  # reads the logs only
        logger.info(self.describe())

    def unwrapped(self) -> PolicyAndValue:
        """The `PolicyAndValue` module (policy, value head, optional value backbone) without its engine wrapper."""
        return self.accelerator.unwrap_model(self.model_wrapped)

    def _scheduler_horizon(self) -> int:
        """The run's length in optimizer steps, for the learning-rate schedule (1 when it needs none and none is
        known: the step API without `max_steps`)."""
        args = self.args
        steps = self._max_steps(check=False) if self.train_dataloader is not None else max(args.max_steps, 0)
        per_step = args.ppo_epochs * (
            args.batch_size // (args.per_device_train_batch_size * args.gradient_accumulation_steps)
        )
        if steps:
            return steps * per_step
        needs_horizon = (
            str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) not in _HORIZON_FREE_SCHEDULES
        )
        if needs_horizon or 0 < args.warmup_steps < 1:
            what = (
                f"lr_scheduler_type={args.lr_scheduler_type!r}"
                if needs_horizon
                else f"warmup_steps={args.warmup_steps}"
            )
            raise ValueError(
                f"{what} needs the run's length, which is unknown without a train_dataset or max_steps: set "
                "max_steps (PPO steps the step API will run), or use lr_scheduler_type='constant' / "
                "'constant_with_warmup' with warmup_steps >= 1."
            )
        return 1

    def describe(self) -> str:
        """One line naming the active advantage, KL, loss, filter and routing path (logged once at start-up)."""
        args = self.args
        lam = "lam_fn" if self.lam_fn else args.lam_schedule or f"lam={args.lam}"
        kl = f"{args.kl_penalty}, {'adaptive' if args.adap_kl_ctrl else 'fixed'} coef {args.init_kl_coef}"
        loss = "decoupled" if args.use_decoupled_loss else "clip"
        if args.token_filter:
            lower, upper = args.filter_bounds
            loss += (
                f", filter={args.token_filter}[{lower}, {upper}] {args.token_filter_level}/{args.token_filter_action}"
            )
        return (
            f"trl_stable PPO: advantages=gae ({lam}, gamma={args.gamma}, whiten={args.whiten_advantages}; "
            "turn_gae for steps with turn_ids), "
            f"kl={kl}, loss={loss}, value_clip={args.cliprange_value}, routing={args.routing_replay}"
        )

    # ------------------------------------------------------------------ 1. rollout
    def generate(
        self,
        query_tensor: torch.Tensor | list[torch.Tensor],
        length_sampler: Callable[[], int] | None = None,
        return_prompt: bool = True,
        batch_size: int | None = None,
        **generation_kwargs: Any,
    ) -> torch.Tensor | Rollout:
        """Sample responses from the policy.

        Args:
            query_tensor: One 1-D LongTensor of prompt ids, or a list of them (no padding).
            length_sampler: Called once per generation chunk for its `max_new_tokens` (e.g. `LengthSampler`).
                None: `args.min_new_tokens`/`args.max_new_tokens`.
            return_prompt: Prepend the query to each returned sequence (the old TRL default); RELC passes False.
            batch_size: Generate in chunks of this many queries (None: `args.generation_batch_size` or all).
            generation_kwargs: Override `generate` arguments (top_k, top_p, temperature, do_sample, ...).

        Returns:
            For a list of queries, a `Rollout`: a list of 1-D LongTensors (each response without padding, cut after
            its EOS (kept), on the trainer's device) that also carries the sampler's log-probs (with
            `use_decoupled_loss`) and MoE routing (with ``routing_replay="R3"``) for `step`. For one query, its
            tensor.
        """
        single = isinstance(query_tensor, torch.Tensor) and query_tensor.dim() == 1
        queries = [query_tensor] if single else list(query_tensor)
        if any(len(q) == 0 for q in queries):
            raise ValueError("Every query needs at least one token (e.g. a BOS token).")
        args = self.args
        if length_sampler is None and args.min_new_tokens is not None:
            length_sampler = LengthSampler(args.min_new_tokens, args.max_new_tokens)
        chunk = batch_size or args.generation_batch_size or len(queries)
        if self.vllm_rollouts is not None:
            if generation_kwargs:
                raise ValueError(
                    f"generate() got {sorted(generation_kwargs)} with use_vllm=True: set sampling on PPOConfig "
                    "(temperature, top_k, top_p, generation_kwargs for vLLM's SamplingParams)."
                )
            rollout = vllm_rollout(self, queries, chunk, length_sampler, return_prompt)
            return rollout[0] if single else rollout
        kwargs = {
            "do_sample": True,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "temperature": args.temperature,
            "max_new_tokens": args.max_new_tokens,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": self.eos_token_id,
            **(args.generation_kwargs or {}),
            **generation_kwargs,
        }
        capture = args.use_decoupled_loss
        policy = self.unwrapped().policy
        sequences, sampler_logps, routing = [], [], []
        was_training = policy.training
        policy.eval()
        engine_call = generation_call(self.model_wrapped, policy, self.accelerator, self.engine)
        with torch.no_grad(), self.accelerator.autocast(), engine_call as sample:
            for start in range(0, len(queries), chunk):
                batch = [q.to(self.accelerator.device).long() for q in queries[start : start + chunk]]
                if length_sampler is not None:
                    kwargs["max_new_tokens"] = max(1, int(length_sampler()))
                too_long = first_error(
                    too_long_error(
                        context,
                        [len(q) for q in batch],
                        kwargs["max_new_tokens"],
                        lambda i, start=start: f"query {start + i}",
                        "Shorten the queries (train() cuts prompts to max_prompt_length) or lower max_new_tokens.",
                    )
                    for context in self.model_contexts
                )
                if too_long is not None:
                    policy.train(was_training)
                    raise too_long
                input_ids, attention_mask = self._left_pad(batch)
                record = record_sampler_logps(policy) if capture else nullcontext()
                with self.routing.sampling() as sampled, record as recorder:
                    generated = sample(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
                generated = generated[:, input_ids.shape[1] :]
                responses = [self._trim_response(row) for row in generated]
                if capture:
                    rows = recorder.per_token_logps(generated.tolist())
                    sampler_logps += [torch.tensor(lp[: len(r)]) for lp, r in zip(rows, responses)]
                if self.routing.mode == "R3":
                    per_sequence = sampled.per_sequence([len(q) for q in batch], [generated.shape[1]] * len(batch))
                    routing += [seq[: len(q) + len(r)] for seq, q, r in zip(per_sequence, batch, responses)]
                sequences += [torch.cat([q, r]) if return_prompt else r for q, r in zip(batch, responses)]
        policy.train(was_training)
        if single:
            return sequences[0]
        return Rollout(
            sequences,
            queries,
            sampler_logprobs=sampler_logps if capture else None,
            routing=routing if self.routing.mode == "R3" else None,
            with_prompt=return_prompt,
        )

    def _left_pad(self, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long, device=self.accelerator.device)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = s
            mask[i, width - len(s) :] = 1
        return ids, mask

    def _trim_response(self, response: torch.Tensor) -> torch.Tensor:
        eos = (response == self.eos_token_id).nonzero()
        if len(eos):
            return response[: int(eos[0]) + 1]
        # without EOS there is no padding: generate pads only after a finished sequence, and a sampled pad token
        # is a real action
        return response

    # ------------------------------------------------------------------ the PPO step
    def step(
        self,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor] | Rollout,
        token_rewards: list[torch.Tensor | Sequence[float]]
        | Callable[[], list[torch.Tensor | Sequence[float]] | None]
        | None = None,
        scores: list[float] | torch.Tensor | None = None,
        turn_ids: list[torch.Tensor | Sequence[int]] | None = None,
        sampler_logprobs: list[torch.Tensor] | None = None,
        extra_logs: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Run one PPO iteration on a batch of `args.batch_size` samples and return its statistics.

        Args:
            queries: Prompt ids, one 1-D LongTensor per sample.
            responses: Response ids, one per sample: the `Rollout` returned by ``generate(return_prompt=False)``
                (it carries the sampler's log-probs and routing), or plain tensors.
            token_rewards: Per-token rewards, one list/tensor per sample with exactly ``len(responses[i])`` entries
                (dense rewards; RELC puts the environment score on the last token itself). Optional if `scores`.
                Or a zero-argument callable returning them (or None): deferred token rewards, resolved after the
                rollout pass, so slow rewards (an LLM critic whose requests were sent before `step`) overlap the
                policy / value / reference forwards. `train()` passes its dense reward functions this way.
            scores: One sequence-level score per sample, added on the last response token after optional
                score scaling/normalisation/clipping (`use_score_scaling`, `use_score_norm`, `score_clip`).
            turn_ids: Multi-turn agents: per sample, one id per response token, the assistant turn index (0, 1, ...,
                non-decreasing) or -1 for tokens that are no action (tool output). Switches to turn-level GAE
                (`core.compute_turn_gae`: each turn one macro step, token KL added back per token); -1 tokens get
                no loss, and the score goes on the last assistant token.
            sampler_logprobs: With `use_decoupled_loss`, the sampler's log-prob of each response token. None: taken
                from `responses` when it is a `Rollout`.
            extra_logs: Merged into the step's logs (e.g. reward metrics); read after deferred `token_rewards` are
                resolved, so they may add to it. Floats are logged as given; `trl_stable.monitoring.reduction.Stat`
                values (what `train()` passes) are reduced over processes.

        The per-token PPO reward is ``-kl_coef * KL + token_rewards + score@last``. These are final rewards, not
        reward-function output: a NaN, None or infinite `token_rewards` entry or score marks a sample without a
        reward, which `args.nan_reward_action` drops (the default; error when all are) or keeps with advantage 0, with
        a warning; a value that is not a number raises `trl_stable.rewards.dense.RewardTypeError` (a `TypeError`) on
        every process. The step is logged (`self.state.log_history`, callbacks) and, as `Trainer` does at the end of an
        optimizer step, evaluated and checkpointed when `eval_strategy` / `save_strategy` say so.

        Returns:
            The step's statistics (objective/kl, loss/policy, loss/value, policy/clipfrac, ...).
        """
        sampler_logprobs, routing = self._sampler_record(queries, responses, sampler_logprobs)
        deferred = token_rewards if callable(token_rewards) else None
        self._check_step_inputs(
            queries, responses, None if deferred else token_rewards, scores, turn_ids, sampler_logprobs, deferred
        )
        args = self.args
        if not self._train_begun:
            self._begin(max_steps=max(args.max_steps, 0))
        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        step_start = time.time()

        batch = self.make_batch(queries, responses, turn_ids, routing)
        self._count_input_tokens(batch["attention_mask"])
        self.model_wrapped.eval()
        # The forwards first: they read ids and masks only, never the rewards, so deferred rewards (a critic's
        # requests in flight) are waited for after them.
        batch, rollout_logs = self.rollout_pass(batch)
        if deferred is not None:
            token_rewards = self._resolve_token_rewards(deferred, responses)
            if token_rewards is None and scores is None:
                raise ValueError("step()'s deferred token_rewards returned None and no `scores` were given.")
        batch, reward_logs = self._drop_broken_rewards(batch, token_rewards, scores)
        # on the final action mask, so the step mask and its counts cover only the samples that are trained on
        rollout_logs.update(self._apply_step_keep(batch))
        batch, advantage_logs = self.compute_advantages(batch)
        behaviour_logs = self._behaviour_weights(batch, sampler_logprobs) if args.use_decoupled_loss else {}
        self.model_wrapped.train()
        update_logs = self.update(batch)
        self.kl_ctl.update(advantage_logs["objective/kl"], args.batch_size * self.accelerator.num_processes)

        logs = {
            **advantage_logs,
            **reward_logs,
            "ppo/learning_rate": self.optimizer.param_groups[0]["lr"],
            **update_logs,
            **rollout_logs,
            **behaviour_logs,
            **(extra_logs or {}),
            "time/ppo_step": Stat.max(time.time() - step_start),
        }
        # the step mask's counts, the reward functions' metrics and the step time are this process's own; a reward
        # function may log a metric on some processes only
        logs = reduce_metrics(logs, self.accelerator, names_may_differ=True)
        self._end_step(logs)
        return logs

    def _sampler_record(self, queries, responses, sampler_logprobs):
        """The sampler's log-probs and routing for this step, from the arguments or the `Rollout` itself."""
        rollout = responses if isinstance(responses, Rollout) else None
        if rollout is not None and rollout.with_prompt:
            raise ValueError(
                "step() takes responses without their prompt: generate them with return_prompt=False (the Rollout "
                "passed holds query + response sequences)."
            )
        if sampler_logprobs is None and rollout is not None:
            sampler_logprobs = rollout.sampler_logprobs
        if self.args.use_decoupled_loss and sampler_logprobs is None:
            raise ValueError(
                "use_decoupled_loss needs the sampler's log-probs: pass step(sampler_logprobs=...) or step the "
                "Rollout returned by trainer.generate(..., return_prompt=False) unchanged."
            )
        routing = None
        if self.routing.mode == "R3":
            routing = rollout.routing if rollout is not None else None
            if routing is None or len(routing) != len(queries):
                raise ValueError(
                    "routing_replay='R3' needs the sampler's routing: step() the Rollout returned by "
                    "generate(..., return_prompt=False) unchanged, with all its samples (or use routing_replay='R2')."
                )
            for i, (route, q, r) in enumerate(zip(routing, queries, responses)):
                if len(route) > len(q) + len(r) or len(rollout.queries[i]) != len(q):
                    raise ValueError(
                        f"routing_replay='R3': sample {i} passed to step() is not the one generate() produced, so its "
                        "recorded routing does not apply. Pass the generated queries and responses unchanged, in "
                        "order."
                    )
        return sampler_logprobs, routing

    def _resolve_token_rewards(self, deferred: Callable[[], Any], responses) -> Any:
        """Call deferred token rewards and check their lengths; a contract error (seen by this process only) stops
        every process."""

        def resolve() -> Any:
            rows = deferred()
            if rows is not None:
                self._check_per_token("token_rewards", rows, responses)
            return rows

        return call_on_every_process(self.accelerator, resolve)

    @staticmethod
    def _check_per_token(name: str, rows, responses) -> None:
        """One entry of `rows` per response token of each sample (token rewards, turn ids, sampler log-probs).

        For token rewards the errors are `RewardContractError` (a `ValueError`; `RewardTypeError` for a row that
        is no list), so deferred token rewards can stop every process with them."""
        rewards = name == "token_rewards"
        value_error, type_error = (RewardContractError, RewardTypeError) if rewards else (ValueError, TypeError)
        if not _is_sized(rows):
            raise type_error(f"step()'s {name} is {rows!r:.60} ({type(rows).__name__}); pass one row per sample.")
        if len(rows) != len(responses):
            raise value_error(f"step() got {len(rows)} {name} for {len(responses)} responses; pass one per sample.")
        what = "reward" if rewards else "entry"
        for i, (row, r) in enumerate(zip(rows, responses)):
            if not _is_sized(row):
                raise type_error(
                    f"{name}[{i}] is {row!r:.60} ({type(row).__name__}); give one {what} per response token (a list "
                    "or a 1-D tensor)."
                )
            if len(row) != len(r):
                raise value_error(
                    f"{name}[{i}] has {len(row)} entries but responses[{i}] has {len(r)} tokens; "
                    f"give one {what} per response token."
                )

    def _check_step_inputs(
        self, queries, responses, token_rewards, scores, turn_ids=None, sampler_logprobs=None, deferred=None
    ):
        n = len(queries)
        lengths = {"queries": n, "responses": len(responses)}
        for name, value in (
            ("token_rewards", token_rewards),
            ("scores", scores),
            ("turn_ids", turn_ids),
            ("sampler_logprobs", sampler_logprobs),
        ):
            if value is not None:
                if not _is_sized(value):
                    raise RewardTypeError(
                        f"step()'s {name} is {value!r:.60} ({type(value).__name__}); pass one entry per sample."
                    )
                lengths[name] = len(value)
        if len(set(lengths.values())) != 1:
            raise ValueError(f"step() got lists of different lengths: {lengths}; pass one entry per sample.")
        if n != self.args.batch_size:
            raise ValueError(f"step() got {n} samples but args.batch_size is {self.args.batch_size}.")
        if token_rewards is None and scores is None and deferred is None:
            raise ValueError("step() needs `token_rewards`, `scores` or both.")
        for i, (q, r) in enumerate(zip(queries, responses)):
            if not isinstance(q, torch.Tensor) or not isinstance(r, torch.Tensor) or q.dim() != 1 or r.dim() != 1:
                raise ValueError(f"queries[{i}] and responses[{i}] must be 1-D LongTensors.")
            if len(q) == 0 or len(r) == 0:
                raise ValueError(f"Sample {i} has an empty query or response.")
        for name, rows in (
            ("token_rewards", token_rewards),
            ("turn_ids", turn_ids),
            ("sampler_logprobs", sampler_logprobs),
        ):
            if rows is not None:
                self._check_per_token(name, rows, responses)

    def make_batch(self, queries, responses, turn_ids=None, routing=None) -> dict[str, torch.Tensor]:
        """Left-padded queries and right-padded responses in one [B, P + R] batch, with the response mask, the turn
        ids ([B, R], -1 on non-actions; action mask = response mask and turn id >= 0) and the R3 routing."""
        device = self.accelerator.device
        prompt_width = max(len(q) for q in queries)
        resp_width = max(len(r) for r in responses)
        n = len(queries)
        input_ids = torch.full((n, prompt_width + resp_width), self.pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros_like(input_ids)
        response_mask = torch.zeros(n, resp_width, device=device)
        for i, (q, r) in enumerate(zip(queries, responses)):
            input_ids[i, prompt_width - len(q) : prompt_width] = q.to(device)
            input_ids[i, prompt_width : prompt_width + len(r)] = r.to(device)
            attention_mask[i, prompt_width - len(q) : prompt_width + len(r)] = 1
            response_mask[i, : len(r)] = 1
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            # numbered from each row's first real token, as `generate` did: every pass agrees with the sampler
            "position_ids": position_ids_from_mask(attention_mask),
            "response_ids": input_ids[:, prompt_width:],
            "response_mask": response_mask,
            "response_lengths": torch.tensor([len(r) for r in responses], device=device),
        }
        if turn_ids is not None:
            turns = torch.full((n, resp_width), -1, dtype=torch.long, device=device)
            for i, row in enumerate(turn_ids):
                turns[i, : len(row)] = torch.as_tensor(row, dtype=torch.long).to(device)
            batch["turn_ids"] = turns
            batch["response_mask"] = response_mask * (turns >= 0)
        if routing is not None:
            batch[ROUTED_EXPERTS_KEY] = batch_routing(routing, attention_mask, prompt_width)
        return batch

    def _drop_broken_rewards(self, batch, token_rewards, scores) -> tuple[dict, dict[str, float]]:
        """Put the rewards in the batch (`dense` [B, R], `scores` [B] after score scaling, `valid` [B]) and take the
        samples with a NaN or infinite reward out of the action mask."""
        device = self.accelerator.device
        mask = batch["response_mask"]
        n, resp_width = mask.shape
        dense = torch.zeros(n, resp_width, device=device)
        score_t = None
        error = None
        try:  # the reward contract's number rule (`trl_stable.rewards.dense`); None, like NaN, marks no reward
            if token_rewards is not None:
                for i, row in enumerate(token_rewards):  # lengths checked by `_check_per_token`
                    values = reward_numbers(
                        row, "step()'s token_rewards", lambda t, i=i: f"token {t} of sample {i}", "a list per sample"
                    )
                    dense[i, : len(values)] = torch.tensor(values, dtype=torch.float32, device=device)
            if scores is not None:
                values = reward_numbers(scores, "step()'s scores", lambda i: f"sample {i}", "one score per sample")
                score_t = torch.tensor(values, dtype=torch.float32, device=device)
        except RewardContractError as err:
            error = err
        raise_on_every_process(error, self.accelerator)
        # NaN or a value out of range (the contract's bound, max_abs_reward; +-inf) marks a sample without a reward:
        # RELC-era loops put the score inside token_rewards, so a NaN token is a failed score rather than a token the
        # reward does not apply to (as it is for a dense reward function); an overflowing one would make the
        # advantages, value loss and gradients of the batch infinite
        bad = self._out_of_range(dense).any(1)
        if score_t is not None:
            bad |= self._out_of_range(score_t)
        drop = self.args.nan_reward_action == "drop"
        # decided on every process at once: a process that raised alone would leave the others hanging in a collective
        if drop and self.accelerator.reduce(bad.all().float(), reduction="sum").item() > 0:
            raise ValueError(
                "Every sample of the batch has a NaN or infinite reward (on at least one process); check the reward "
                "functions."
            )
        if bool(bad.any()) and drop:
            warnings.warn(
                f"Dropping {int(bad.sum())} of {n} samples with a NaN or infinite reward from this PPO step."
            )
            mask = mask * (~bad).unsqueeze(1)
            if "turn_ids" in batch:
                batch["turn_ids"] = torch.where(mask.bool(), batch["turn_ids"], torch.full_like(batch["turn_ids"], -1))
        elif bool(bad.any()):
            warnings.warn(
                f"{int(bad.sum())} of {n} samples have a NaN or infinite reward: trained with advantage 0 and no "
                "value loss (nan_reward_action='zero')."
            )
        valid = ~bad
        logs = {"ppo/dropped_samples" if drop else "ppo/zeroed_samples": Stat.total(bad.sum())}
        batch["response_mask"] = mask
        # the tokens with a value target: with 'zero' an unscored sample stays in the policy loss (advantage 0) only
        batch["value_mask"] = mask * valid.unsqueeze(1)
        batch["valid"] = valid
        # where, not a product: NaN * 0 is NaN. Rewards on tool-output tokens (turn id -1) count nowhere.
        batch["dense_rewards"] = torch.where(mask.bool(), dense, torch.zeros_like(dense))
        if score_t is not None:
            raw_scores = torch.where(valid, score_t, torch.zeros_like(score_t))
            batch["scores"] = self.scale_scores(raw_scores, valid) * valid
            # over every process's valid samples: the processes may have dropped different numbers of samples
            logs["env/reward_mean"] = Stat.mean(raw_scores, valid)
            logs["env/reward_std"] = Stat.std(raw_scores, valid)
        if self.args.use_score_scaling:
            logs["env/running_mean"], logs["env/running_std"] = self.running.mean, self.running.std
        return batch, reduce_metrics(logs, self.accelerator)

    def _out_of_range(self, rewards: torch.Tensor) -> torch.Tensor:
        """Where `rewards` hold no usable reward: NaN, +-inf, or beyond +-`max_abs_reward`."""
        bad = ~torch.isfinite(rewards)
        if self.args.max_abs_reward is not None:
            bad |= rewards.abs() > self.args.max_abs_reward
        return bad

    def scale_scores(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`core.scale_scores` after merging every process's valid scores into the running statistics (with
        `use_score_scaling`); `score_clip` last."""
        args = self.args
        running = None
        if args.use_score_scaling:
            all_scores = self.accelerator.gather(scores.to(self.accelerator.device).float())
            all_valid = self.accelerator.gather(valid.to(self.accelerator.device))
            if bool(all_valid.any()):
                self.running.update(all_scores[all_valid.bool()].cpu())
            running = self.running
        return scale_with_moments(scores, running, normalize=args.use_score_norm, clip=args.score_clip)

    # ------------------------------------------------------------------ 2. rollout pass
    def _forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], need_logits: bool = False
    ) -> tuple[ResponseScores, torch.Tensor]:
        """The response tokens' log-probs and entropies, and values [B, R + 1] (V(s_t) for each token, then the value
        after the last position). Through the fused LM head unless `need_logits` (then also the raw [B, R, V])."""
        ids, response_ids = batch["input_ids"], batch["response_ids"]
        resp_width = response_ids.shape[1]
        if self.fused_policy and not need_logits:
            out, values = model(
                ids,
                batch["attention_mask"],
                batch["position_ids"],
                logits_to_keep=resp_width + 1,
                labels=fused_logprob_labels(ids, response_ids),
            )
            return fused_scores(out, resp_width), values
        logits, values = model(ids, batch["attention_mask"], batch["position_ids"], logits_to_keep=resp_width + 1)
        logits = logits[:, :resp_width]
        logprobs, entropy = response_logprobs(logits, response_ids, self.args.temperature)
        return ResponseScores(logprobs, entropy, logits), values

    def _ref_scores(self, batch: dict[str, torch.Tensor], need_logits: bool = False) -> ResponseScores:
        """The reference model's view of the response tokens (the policy without its adapter under PEFT)."""
        ids, response_ids = batch["input_ids"], batch["response_ids"]
        resp_width = response_ids.shape[1]
        kwargs = dict(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
        fused = (self.fused_ref if self.ref_model is not None else self.fused_policy) and not need_logits
        if fused:
            kwargs.update(labels=fused_logprob_labels(ids, response_ids), fused_lm_head=True)
        else:
            kwargs.update(logits_to_keep=resp_width + 1, use_cache=False)
        if self.ref_model is not None:
            out = self.ref_model(**kwargs)
        elif self.engine.is_fsdp:  # through the FSDP root, which holds the embeddings and head (PolicyAndValue)
            ids, mask, positions = (kwargs.pop(k) for k in ("input_ids", "attention_mask", "position_ids"))
            out = self.model_wrapped(ids, mask, positions, reference_kwargs=kwargs)
        else:
            policy = self.unwrapped().policy
            with policy.disable_adapter():
                out = policy(**kwargs)
        if fused:
            return fused_scores(out, resp_width)
        logits = out.logits[:, :resp_width]
        logprobs, entropy = response_logprobs(logits, response_ids, self.args.temperature)
        return ResponseScores(logprobs, entropy, logits)

    def _apply_step_keep(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """With a step masker: `step_keep` [B, R] into `batch` (invalid agent steps 0) and its metrics (`Stat`s)."""
        if self.step_masker is None:
            return {}
        batch["step_keep"] = self.step_masker.keep_mask(
            batch["response_ids"], batch["response_mask"], self.processing_class
        )
        return step_mask_stats(self.step_masker.stats())  # this process's counts, reduced in step()

    @torch.no_grad()
    def rollout_pass(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Log-probs and values of the rollout policy, reference log-probs and the per-token KL, under no grad.

        Runs in chunks of `per_device_train_batch_size`; returns a copy of `batch` with `old_logprobs`,
        `ref_logprobs`, `values`, `bootstrap_values`, `kl` and `entropy` ([B, R] / [B]) and, for R2 routing replay,
        the routing this pass took; and the routing metrics. It reads ids and masks only, never the rewards.
        """
        args = self.args
        out: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("old_logprobs", "ref_logprobs", "values", "bootstrap_values", "kl", "entropy")
        }
        recorded = []
        n = batch["input_ids"].shape[0]
        for start in range(0, n, args.per_device_train_batch_size):
            mb = {k: v[start : start + args.per_device_train_batch_size] for k, v in batch.items()}
            full = args.kl_penalty == "full"  # the whole distributions: the only pass that needs the logits
            with self.accelerator.autocast():
                with self.routing.rollout_pass(mb["attention_mask"], mb.get(ROUTED_EXPERTS_KEY)) as rollout:
                    scores, values = self._forward(self.model_wrapped, mb, need_logits=full)
                ref = self._ref_scores(mb, need_logits=full)  # outside the routing point: never replayed
            logp, entropy, ref_logp = scores.logprobs, scores.entropy, ref.logprobs
            if full:
                kl = full_kl(scores.logits / args.temperature, ref.logits / args.temperature)
            else:
                kl = kl_estimate(logp, ref_logp, args.kl_penalty)
            values = values.float()
            out["old_logprobs"].append(logp)
            out["ref_logprobs"].append(ref_logp)
            out["values"].append(values[:, :-1])
            out["bootstrap_values"].append(values.gather(1, mb["response_lengths"].unsqueeze(1)).squeeze(1))
            out["kl"].append(kl)
            out["entropy"].append(entropy)
            if self.routing.mode == "R2":
                recorded.append(rollout.routing)
        result = {**batch, **{k: torch.cat(v) for k, v in out.items()}}
        if recorded:
            result[ROUTED_EXPERTS_KEY] = torch.cat(recorded)
        return result, self.routing.take_metrics("routing/rollout_", self.accelerator)

    # ------------------------------------------------------------------ 3. rewards and advantages
    def _lambda(self, lengths: torch.Tensor) -> float | torch.Tensor:
        if self.lam_fn is not None:
            return self.lam_fn(lengths)
        if self.args.lam_schedule == "vapo":
            return vapo_lambda(lengths, self.args.lam_alpha)
        if self.args.lam_schedule == "relative_position":
            return relative_position_lambda(lengths, self.args.lam_q)
        return self.args.lam

    def compute_advantages(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Per-token rewards (`core.compose_token_rewards`) and GAE over tokens, or over turns with `turn_ids`.

        The lambda schedule sees the number of steps its recursion runs over: action tokens, or turns in turn mode.
        Returns the batch with `advantages`, `returns` and masked `values`, and the step's objective statistics.
        """
        args = self.args
        mask, valid = batch["response_mask"], batch["valid"]
        kl = batch["kl"] * mask
        kl_coef = self.kl_ctl.value
        parts = compose_token_rewards(
            kl,
            kl_coef,
            batch["dense_rewards"],
            batch.get("scores"),
            mask,
            whiten=args.whiten_rewards,
            reduce_sum=self._reduce_sum,
        )
        values = batch["values"] * mask
        last = last_action_index(mask)
        ended = batch["response_ids"].gather(1, last.unsqueeze(1)).squeeze(1) == self.eos_token_id
        bootstrap = None
        if args.bootstrap_truncated:
            bootstrap = torch.where(ended, torch.zeros_like(batch["bootstrap_values"]), batch["bootstrap_values"])
        turns = batch.get("turn_ids")
        if turns is None:
            estimator, lam = "gae", self._lambda(mask.sum(1).long())
            inputs = AdvantageInputs(parts.rewards, mask=mask, values=values, bootstrap=bootstrap)
        else:  # the KL share stays out of the turn recursion and is added back per token
            estimator, lam = "turn_gae", self._lambda(count_turns(turns))
            inputs = AdvantageInputs(
                parts.env_part, values=values, bootstrap=bootstrap, turn_ids=turns, token_rewards=parts.kl_part
            )
        out = get_advantage_estimator(estimator)(inputs, gamma=args.gamma, lam=lam)
        advantages, returns = out.advantages, out.returns
        scored = batch["value_mask"]  # `mask` without the unscored samples nan_reward_action='zero' keeps
        if args.whiten_advantages:
            advantages = masked_whiten(advantages, scored, reduce_sum=self._reduce_sum)
        if not bool(valid.all()):
            advantages = advantages * valid.unsqueeze(1)
        batch = {**batch, "advantages": advantages.detach(), "returns": returns.detach(), "values": values.detach()}

        non_score = -kl_coef * kl
        dense = batch["dense_rewards"]
        # the reward before whitening: KL penalty + dense rewards + score
        rlhf_reward = non_score.sum(1) + dense.sum(1) + (batch["scores"] if "scores" in batch else 0.0)
        maskb = scored.bool()
        # sample means over every process's valid samples, token means over every process's action tokens
        stats = {
            "objective/kl": Stat.mean(kl.sum(1), valid),
            "objective/kl_coef": kl_coef,
            "objective/entropy": Stat.mean((batch["entropy"] * mask).sum(1), valid),
            "objective/non_score_reward": Stat.mean(non_score.sum(1), valid),
            "objective/rlhf_reward": Stat.mean(rlhf_reward, valid),
            "dense/reward_mean": Stat.mean(dense.sum(1), valid),
            "dense/token_reward_mean": Stat.mean(dense, maskb),
            "tokens/response_len_mean": Stat.mean(batch["response_lengths"], valid),
            # share of responses cut at the length cap (no EOS), read by the health monitor's length gauge
            "tokens/truncated_frac": Stat.mean(~ended, valid),
            "val/mean": Stat.mean(values, maskb),
            "returns/mean": Stat.mean(returns, maskb),
            "advantages/mean": Stat.mean(advantages, maskb),
        }
        if "scores" in batch:
            stats["objective/scores"] = Stat.mean(batch["scores"], valid)
        logs = reduce_metrics(stats, self.accelerator)
        return batch, logs

    def _behaviour_weights(self, batch: dict[str, torch.Tensor], sampler_logprobs) -> dict[str, float]:
        """Behaviour weight w = exp(logp_rollout_pass - logp_sampler) and the IcePop/KPop keep mask, into `batch`."""
        args = self.args
        prox, mask = batch["old_logprobs"], batch["response_mask"]
        behav = torch.zeros_like(prox)
        for i, row in enumerate(sampler_logprobs):
            behav[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32).to(behav.device)
        # a sampler that gave no log-prob for a token (vLLM's None) leaves it uncorrected: weight 1, not NaN
        behav = torch.where(torch.isnan(behav), prox, behav)
        lower, upper = args.filter_bounds
        raw = behaviour_weight(prox, behav, mask)
        weight, keep = filter_behaviour_weight(
            prox, behav, mask, args.token_filter, args.token_filter_action, lower, upper, args.token_filter_level
        )
        batch["behaviour_weight"] = weight
        batch["behaviour_keep"] = mask.bool() if keep is None else keep
        gather = self.accelerator.gather
        return {
            **behaviour_filter_metrics(mask, raw, weight, keep, args.token_filter, gather=gather),
            # |diff| mean/max, ratio spread and sequence perplexity ratio over all processes' tokens
            **mismatch_stats(behav, prox, mask, gather=gather).as_metrics(),
        }

    # ------------------------------------------------------------------ 4. update
    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """`ppo_epochs` passes over shuffled mini-batches; one optimiser step per `per_device_train_batch_size *
        gradient_accumulation_steps` samples; early stop when the policy KL exceeds 1.5 x `target_kl`."""
        args = self.args
        n = batch["input_ids"].shape[0]
        backward = args.per_device_train_batch_size * args.gradient_accumulation_steps
        sync_each_batch = self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        self.optimizer.train()  # schedule-free optimizers keep two weight sets (Trainer switches them too)
        records: dict[str, list[float]] = {}
        early_stopped = False
        epochs_done = 0
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(n, generator=self.shuffle_generator).to(self.accelerator.device)
            for start in range(0, n, backward):
                idx = perm[start : start + backward]
                policy_kl = torch.zeros((), device=self.accelerator.device)
                for micro_start in range(0, backward, args.per_device_train_batch_size):
                    mb = _trim_micro_batch(
                        {
                            k: v[idx[micro_start : micro_start + args.per_device_train_batch_size]]
                            for k, v in batch.items()
                        }
                    )
                    last_micro = micro_start + args.per_device_train_batch_size >= backward
                    # gradients are all-reduced once per optimizer step, not once per micro-batch (unless
                    # accelerator_config.gradient_accumulation_kwargs asks for sync_each_batch, as in Trainer)
                    sync = (
                        nullcontext()
                        if last_micro or sync_each_batch
                        else self.accelerator.no_sync(self.model_wrapped)
                    )
                    sync_gradients(self.accelerator, self.engine, last_micro)
                    with sync:
                        loss, mb_stats = self._loss(mb)
                        # DeepSpeed divides by its gradient_accumulation_steps itself (`configure_deepspeed`)
                        scale = 1 if self.engine.is_deepspeed else args.gradient_accumulation_steps
                        self.accelerator.backward(loss / scale)
                    policy_kl = policy_kl + mb_stats.pop("_policykl") / args.gradient_accumulation_steps
                    for k, v in mb_stats.items():
                        records.setdefault(k, []).append(v)
                if args.early_stopping and args.target_kl is not None:
                    global_kl = self.accelerator.reduce(policy_kl.detach(), reduction="mean").item()
                    if global_kl > 1.5 * args.target_kl:
                        self.optimizer.zero_grad()
                        early_stopped = True
                        break
                if args.max_grad_norm > 0:
                    norm = self._clip_grad_norm(self.model_wrapped)  # Trainer's clipping (accelerate, engines)
                    if norm is not None:  # DeepSpeed clipped inside its step; None before its first step
                        records.setdefault("policy/grad_norm", []).append(float(norm))
                self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
                self.optimizer.step()
                self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
                # as Trainer: no schedule step for a skipped (fp16 overflow) step; metric-driven schedules step on eval
                if not self.accelerator.optimizer_step_was_skipped and not isinstance(
                    self.lr_scheduler, _METRIC_SCHEDULES
                ):
                    self.lr_scheduler.step()
                self.optimizer.zero_grad()
            if early_stopped:
                break
            epochs_done += 1
        # means over every process's micro-batches (each process runs the same number of them)
        stats = {k: Stat.ratio(sum(v), len(v)) for k, v in records.items()}
        stats.update({"ppo/early_stop": float(early_stopped), "ppo/epochs_done": float(epochs_done)})
        return {**reduce_metrics(stats, self.accelerator), **self.routing.take_metrics("routing/", self.accelerator)}

    def _loss(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Clipped policy loss (or the decoupled loss) + vf_coef * clipped value loss on one micro-batch."""
        args = self.args
        mask = mb["response_mask"]
        with self.accelerator.autocast(), self.routing.update_pass(mb.get(ROUTED_EXPERTS_KEY)):
            scores, values = self._forward(self.model_wrapped, mb)
        logprobs, entropy = scores.logprobs, scores.entropy
        vpred = values[:, :-1].float()
        old_logprobs, advantages = mb["old_logprobs"], mb["advantages"]
        policy_mask = mask * mb["step_keep"] if "step_keep" in mb else mask  # invalid agent steps: no policy gradient
        if "behaviour_weight" in mb:
            pg_loss = decoupled_ppo_loss(
                logprobs,
                old_logprobs,
                mb["behaviour_weight"],
                advantages,
                policy_mask,
                mb["behaviour_keep"],
                eps_low=args.cliprange,
            )
        else:
            pg_loss = pre_mask_token_mean(
                ppo_clip_term(logprobs, old_logprobs, advantages, eps_low=args.cliprange), policy_mask
            )
        log_ratio = (logprobs - old_logprobs).detach()
        ratio = torch.exp(log_ratio)
        vf_loss, vf_clipfrac = clipped_value_loss(
            vpred, mb["values"], mb["returns"], mb["value_mask"], args.cliprange_value
        )
        avg_ratio = masked_mean(ratio, mask).item()
        scale = 0.0 if avg_ratio > args.ratio_threshold else 1.0  # a loss spike: skip this micro-batch
        loss = scale * (pg_loss + args.vf_coef * vf_loss)
        policykl = masked_mean(-log_ratio, mask)
        stats = {
            "_policykl": policykl,
            "loss/policy": pg_loss.item(),
            "loss/value": vf_loss.item(),
            "loss/total": loss.item(),
            "policy/approxkl": (0.5 * masked_mean(log_ratio.square(), mask)).item(),
            "policy/policykl": policykl.item(),
            "policy/clipfrac": policy_clip_fraction(ratio, advantages, policy_mask, args.cliprange).item(),
            "policy/entropy": masked_mean(entropy, mask).item(),
            "val/clipfrac": vf_clipfrac.item(),
            "val/ratio": avg_ratio,
            "val/vpred": masked_mean(vpred.detach(), mb["value_mask"]).item(),
            "val/error": masked_mean((vpred.detach() - mb["returns"]).square(), mb["value_mask"]).item(),
            "ppo/loss_zeroed": 1.0 - scale,
        }
        return loss, stats

    # ------------------------------------------------------------------ cross-process statistics
    def _reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(x, reduction="sum")

    def _reduce_to_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """`_reduce_sum` of a CPU tensor (the reward statistics), through the device the backend needs (NCCL)."""
        return self._reduce_sum(x.to(self.accelerator.device)).cpu()

    # ------------------------------------------------------------------ train() and evaluate()
    def _prompt_ids(
        self, rows: list[dict], indices: Sequence[int] | None = None, name: str = "train_dataset"
    ) -> tuple[list[Any], list[torch.Tensor]]:
        """The prompts of `rows` (rows `indices` of the dataset `name`, named in errors; a batch's own positions
        without them) and their token ids, cut to the last `max_prompt_length` tokens.

        Raises:
            ValueError: naming the row, when a prompt is missing (None) or empty.
        """
        tok = self.processing_class
        max_len = self.args.max_prompt_length
        wheres = [f"row {i} of this {name} batch" for i in range(len(rows))]
        if indices is not None:
            wheres = [f"{name} row {index}" for index in indices]
        prompts, ids = [], []
        for where, row in zip(wheres, rows):
            if "input_ids" in row and row["input_ids"] is not None:
                q = torch.as_tensor(row["input_ids"], dtype=torch.long).reshape(-1)
                prompt = row.get("prompt", tok.decode(q, skip_special_tokens=True))
            elif "prompt" in row:
                prompt = row["prompt"]
                error = empty_prompt_error(prompt, where)
                if error is not None:
                    raise error
                if isinstance(prompt, list):
                    q = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_tensors=None)
                    if isinstance(q, dict) or hasattr(q, "keys"):
                        q = q["input_ids"]
                    q = torch.as_tensor(q, dtype=torch.long).reshape(-1)
                else:
                    q = torch.as_tensor(tok(prompt)["input_ids"], dtype=torch.long)
            else:
                raise ValueError(f"{name} rows need a 'prompt' (text or messages) or an 'input_ids' column.")
            if len(q) == 0:
                raise ValueError(
                    f"The prompt of {where} has no tokens ({row.get('prompt', row.get('input_ids'))!r}); every sample "
                    "needs at least one token to generate from: drop the row or give it one (e.g. the BOS token)."
                )
            if max_len is not None and len(q) > max_len:
                q = q[-max_len:]
            prompts.append(prompt)
            ids.append(q)
        return prompts, ids

    def _check_prompts_at_start(self, train_dataset: Any) -> None:
        """Start-up checks: the generation length against each model's context, no missing or empty prompt in
        `train_dataset`, and, with a learned position table the config does not already keep prompts within, the
        length of every train prompt (each row tokenized once, here, rather than failing at its batch)."""
        args = self.args
        generation = (args.generation_kwargs or {}).get("max_new_tokens", args.max_new_tokens)
        for context in self.model_contexts:
            check_generation_budget(context, generation, "max_new_tokens", args.max_prompt_length)
        check_prompt_column(train_dataset)
        learned = [c for c in self.model_contexts if c.learned]
        if train_dataset is None or not learned or not hasattr(train_dataset, "__len__"):
            return
        context = min(learned, key=lambda c: c.limit)
        longest = context.limit - generation
        if args.max_prompt_length is not None and args.max_prompt_length <= longest:
            return  # train() cuts every prompt to a length that fits
        logger.info(
            "max_prompt_length=%s and max_new_tokens=%d can pass %s: checking the %d train prompts.",
            args.max_prompt_length,
            generation,
            context.describe(),
            len(train_dataset),
        )
        lengths = []
        for chunk in range(0, len(train_dataset), 256):
            indices = range(chunk, min(chunk + 256, len(train_dataset)))
            lengths += [len(q) for q in self._prompt_ids([train_dataset[i] for i in indices], indices)[1]]
        error = too_long_error(
            context,
            lengths,
            generation,
            lambda i: f"train_dataset row {i}",
            f"Set max_prompt_length={longest} (train() keeps a prompt's last tokens), lower max_new_tokens, or drop "
            "the long rows.",
        )
        if error is not None:
            raise error

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """The training dataloader, built as Trainer builds it (its sampler: `train_sampling_strategy`, `data_seed`;
        the `dataloader_*` settings; accelerate's sharding over processes), with `batch_size` prompts per process
        per batch, one batch a PPO step, and always full batches (a step takes exactly `batch_size` prompts)."""
        args = self.args
        dataset = self.train_dataset
        sampled = not isinstance(dataset, torch.utils.data.IterableDataset)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=self._get_train_sampler(dataset) if sampled else None,
            drop_last=True,
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            in_order=args.dataloader_in_order,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
            # the workers' seed from a stream of its own: drawn from the global RNG it would move every token
            # generate samples afterwards (the sampler's order is seeded on its own, by `data_seed` or `seed`)
            generator=torch.Generator().manual_seed(args.seed),
        )
        return self.accelerator.prepare(loader)

    def _get_train_sampler(self, train_dataset: Any | None = None) -> torch.utils.data.Sampler | None:
        """Trainer's training sampler; with ``train_sampling_strategy="group_by_length"`` grouped by the prompts that
        are generated and padded together, PPO's `batch_size`, instead of the micro-batch Trainer would take."""
        sampler = super()._get_train_sampler(train_dataset)
        if isinstance(sampler, LengthGroupedSampler):
            return LengthGroupedSampler(self.args.batch_size, lengths=sampler.lengths, generator=sampler.generator)
        return sampler

    def _max_steps(self, check: bool = True) -> int:
        """The PPO steps `train()` runs: `max_steps`, or `num_train_epochs` passes over the train dataloader. A
        dataset smaller than one step raises (`check`) or gives 0."""
        args = self.args
        if args.max_steps > 0:
            return args.max_steps
        steps_per_epoch = len(self.train_dataloader)
        if steps_per_epoch == 0 and not check:
            return 0
        if steps_per_epoch == 0:
            per_step = args.batch_size * self.accelerator.num_processes
            raise ValueError(
                f"train_dataset has {len(self.train_dataset)} rows, fewer than one step's batch_size x processes = "
                f"{per_step}; lower batch_size or add prompts."
            )
        return math.ceil(args.num_train_epochs * steps_per_epoch)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """Train over `train_dataset`: each batch of `batch_size` prompts is generated from, scored with
        `reward_funcs` and trained on with `step`, for `args.max_steps` steps (or `args.num_train_epochs` passes).
        Logging, evaluation and checkpoints follow `args` as in `transformers.Trainer`.

        Args:
            resume_from_checkpoint: A checkpoint directory, or True for the newest complete one in `args.output_dir`
                (newer incomplete ones are skipped and logged); None: `args.resume_from_checkpoint`. Restores
                weights, optimizer, scheduler, KL controller, running score statistics, RNG, data position, the health
                monitor and the reward functions' counters (see docs/reliability.md).
            trial: Not supported (PPOTrainer runs no hyperparameter search).
            ignore_keys_for_eval: Not used (PPO's evaluation returns reward metrics).
        """
        if trial is not None:
            raise ValueError("PPOTrainer does not run hyperparameter searches: call train() without `trial`.")
        args = self.args
        if self.train_dataloader is None:
            raise ValueError("train() needs a train_dataset; for custom loops use generate() and step().")
        if not len(self.rewards):
            raise ValueError("train() needs reward_funcs; for custom loops use generate() and step().")
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        self._memory_tracker.start()
        self.is_in_train = True
        max_steps = self._max_steps()
        info = self._resolve_checkpoint(resume_from_checkpoint)  # the newest complete one for True
        if info is not None:
            self._load_checkpoint(info)
        self._begin(max_steps)
        start_time, start_step = time.time(), self.state.global_step
        steps_per_epoch = len(self.train_dataloader)
        losses, step_logs = [], None
        if args.eval_on_start:
            self._evaluate(trial=None, ignore_keys_for_eval=None, skip_scheduler=True)
        epoch, within = divmod(start_step, steps_per_epoch)
        if args.ignore_data_skip:
            within = 0  # as Trainer: a resumed epoch starts from its first batch
        while self.state.global_step < max_steps and not self.control.should_training_stop:
            self.train_dataloader.set_epoch(epoch)  # the sampler's order of this epoch (seed + epoch)
            batches = skip_first_batches(self.train_dataloader, within) if within else self.train_dataloader
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            for rows in batches:
                within += 1
                self.state.epoch = epoch + within / steps_per_epoch
                step_logs = self._train_step(rows)
                losses.append(step_logs.get("loss/total", 0.0))
                if self.state.global_step >= max_steps or self.control.should_training_stop:
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            if self.control.should_log and step_logs is not None and not self._logged_this_step():
                self.log(dict(step_logs))  # logging_strategy="epoch": the epoch's last PPO step
            self._maybe_evaluate_and_save()
            epoch, within = epoch + 1, 0
        finite = [loss for loss in losses if math.isfinite(loss)] if args.logging_nan_inf_filter else losses
        # Trainer's end of training: speed metrics, the best model (load_best_model_at_end), on_train_end, hub push
        self._tr_loss = torch.tensor(0.0)
        self._total_loss_scalar = float(np.sum(finite)) * len(losses) / max(len(finite), 1)
        self._initial_global_step = start_step
        num_samples = max_steps * args.batch_size * self.accelerator.num_processes
        return self._finalize_training(None, num_samples, start_time)

    def _train_step(self, rows: list[dict]) -> dict[str, float]:
        """One PPO step of `train()` on a batch of dataset rows; returns its statistics (`step`'s)."""
        args = self.args
        prompts, queries = self._prompt_ids(rows)
        responses = self.generate(queries, return_prompt=False)
        # sequence rewards now; dense functions prefetched, called by step() after its forwards. A contract error is
        # seen by this process only: every process must stop with it
        pending = call_on_every_process(self.accelerator, self.rewards.start, rows, prompts, responses, self.state)
        self._guard_rewards(pending.names, pending.rewards_per_func, pending.failures, unscored_everywhere=True)
        if args.multi_objective_aggregation == "normalize_then_sum":
            pending.normalize_then_sum(self._reduce_to_cpu)
        stats = self.step(
            queries,
            responses,
            token_rewards=pending.token_rewards if pending.has_dense else None,
            scores=pending.scores,
            extra_logs=pending.stats,  # the dense metrics join it when step() collects them
        )
        dense = pending.result().dense
        if dense is not None:  # a dense function that raised on any process failed this step
            self._guard_rewards(self.rewards.dense_names, None, dense.failures, unscored_everywhere=False)
        if self._logged_this_step():
            self._log_completions(prompts, responses, pending.result())
        return stats

    def _logged_this_step(self) -> bool:
        """Whether `state.log_history` already holds an entry of the current step."""
        return bool(self.state.log_history) and self.state.log_history[-1].get("step") == self.state.global_step

    def _guard_rewards(
        self, names: Sequence[str], values: torch.Tensor | None, failures: dict[str, str], unscored_everywhere: bool
    ) -> None:
        """Count a step in which a reward function failed wholesale (`reward_max_failing_steps`): with `values`, when
        it gave no usable value for any completion of any process; otherwise when its call raised on some process.
        Decided on every process's outcome, so every process stops at the same step."""
        if not names:
            return
        if values is not None:
            local = torch.isnan(values).all(dim=0).float()
        else:
            local = torch.tensor([float(name in failures) for name in names])
        counts = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum")
        failed = counts >= self.accelerator.num_processes if unscored_everywhere else counts > 0
        record_reward_failures(self.reward_guards, dict(zip(names, failed.tolist())), failures)

    def evaluate(
        self, eval_dataset: Any | None = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Generate a completion for every prompt of `eval_dataset` (default `self.eval_dataset`; a dict is evaluated
        per name, its metrics prefixed ``{metric_key_prefix}_{name}``) and score it with the reward functions, as
        TRL's GRPO evaluates: no training step, the policy as it is.

        Logs and returns ``{prefix}_reward`` (the mean weighted sequence score plus dense reward of a completion, the
        number `metric_for_best_model="reward"` reads), ``{prefix}_rewards/<function>/mean``, ``{prefix}_dense/
        reward_mean`` with dense functions, ``{prefix}_completions/mean_length``, the critic's metrics
        (``{prefix}_critic/...``, means over the eval batches) when one is a reward function, and the speed metrics.
        Means are over every process's completions (the padding accelerate adds to the last batch excluded).
        `ignore_keys` is not used.
        """
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (PPOTrainer(eval_dataset=...) or the argument).")
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if not len(self.rewards):
            raise ValueError("evaluate() needs reward_funcs to score the completions.")
        self._memory_tracker.start()
        self.optimizer.eval()  # a schedule-free optimizer's evaluation weights, as Trainer's evaluate uses
        start = time.time()
        columns: dict[str, list[torch.Tensor]] = {}
        batch_metrics: dict[str, list[float]] = {}
        for rows in self.get_eval_dataloader(dataset):
            prompts, queries = self._prompt_ids(rows, name="eval_dataset")
            responses = self.generate(queries, return_prompt=False)
            rewards = call_on_every_process(self.accelerator, self.rewards.start, rows, prompts, responses, self.state)
            result = rewards.result()
            lengths = torch.tensor([float(len(r)) for r in responses])
            per_sample = {"reward": self._completion_rewards(result), "completions/mean_length": lengths}
            per_sample.update({f"rewards/{name}/mean": values for name, values in result.per_func.items()})
            if result.dense is not None:
                per_sample["dense/reward_mean"] = _dense_sums(result.dense.rows)
            for key, values in per_sample.items():
                gathered = self.accelerator.gather_for_metrics(values.float().to(self.accelerator.device))
                columns.setdefault(key, []).append(gathered.cpu())
            for key, value in reduce_metrics(result.stats, self.accelerator, names_may_differ=True).items():
                if key.startswith("critic/"):
                    batch_metrics.setdefault(key, []).append(float(value))
        metrics = {}
        for key, parts in columns.items():
            values = torch.cat(parts)
            finite = values[torch.isfinite(values)]
            metrics[f"{metric_key_prefix}_{key}"] = finite.mean().item() if len(finite) else float("nan")
        for key, values in batch_metrics.items():
            metrics[f"{metric_key_prefix}_{key}"] = float(np.mean(values))
        num_samples = len(torch.cat(columns["reward"])) if columns else 0
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=num_samples))
        self.optimizer.train()
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self._memory_tracker.stop_and_update_metrics(metrics)
        return metrics

    @staticmethod
    def _completion_rewards(rewards: Any) -> torch.Tensor:
        """Each completion's reward: its weighted sequence score (NaN where none applies) plus its dense sum."""
        scores = rewards.scores.float() if rewards.scores is not None else None
        dense = _dense_sums(rewards.dense.rows) if rewards.dense is not None else None
        if scores is None:
            return dense
        return scores if dense is None else scores + dense

    # ------------------------------------------------------------------ Trainer's loop events
    def _begin(self, max_steps: int) -> None:
        """What Trainer does before its first step: the run's length and logging/eval/save steps in the state, then
        on_train_begin. The step API calls it at its first step (0: no planned length)."""
        self.state.max_steps = max_steps
        self.state.compute_steps(self.args, max(max_steps, 1))
        self.state.init_training_references(self, max_steps, self.args.num_train_epochs, None)
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        self._train_begun = True

    def _end_step(self, logs: dict[str, float]) -> None:
        """What Trainer does after an optimizer step, after a PPO step: count it, on_step_end, then log, evaluate and
        save as the flags say."""
        self.state.global_step += 1
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        if self.state.max_steps <= 0:
            # the step API with no planned length: transformers' end-of-run flags (step >= max_steps) do not apply
            self.control.should_training_stop = False
            save_steps = self.args.save_strategy == SaveStrategy.STEPS and self.state.save_steps > 0
            self.control.should_save = save_steps and self.state.global_step % self.state.save_steps == 0
        if self.control.should_log:
            self.log(dict(logs))  # a copy: Trainer's `log` and the callbacks add to the dict they get
        steps = self.args.torch_empty_cache_steps
        if steps and self.state.global_step % steps == 0:
            clear_device_cache()
        self._maybe_evaluate_and_save()

    def _maybe_evaluate_and_save(self) -> None:
        """Evaluate and save when the callbacks asked for it (the second half of Trainer's
        `_maybe_log_save_evaluate`; PPO logs its own step statistics)."""
        if self.control.should_evaluate:
            metrics = self._evaluate(trial=None, ignore_keys_for_eval=None)
            is_best = self._determine_best_metric(metrics=metrics, trial=None)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_best
        if self.control.should_save:
            self._save_checkpoint(self.model_wrapped, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _count_input_tokens(self, attention_mask: torch.Tensor) -> None:
        """`include_num_input_tokens_seen`: count the step's prompt + response tokens over every process ("all":
        padding included)."""
        how = self.args.include_num_input_tokens_seen
        if how in ("no", False, None):
            return
        count = attention_mask.numel() if how == "all" else int(attention_mask.sum())
        total = self.accelerator.reduce(torch.tensor(count, device=self.accelerator.device), reduction="sum")
        self.state.num_input_tokens_seen += int(total)

    # ------------------------------------------------------------------ checkpoints (Trainer's, with our model layout)
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """What `save_model` and checkpoints write: the policy (`save_pretrained`: full model or LoRA adapter), the
        value head (`value_head.safetensors`, or the separate value model under `value_model/`), the tokenizer and
        the training arguments. `state_dict`: the gathered weights of the whole `PolicyAndValue` (ZeRO-3, FSDP)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        unwrapped = self.unwrapped()

        def part(prefix: str) -> dict[str, Any]:
            if state_dict is None:
                return {}
            return {"state_dict": {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}}

        unwrapped.policy.save_pretrained(output_dir, **part("policy."))
        unwrapped.value_head.save_pretrained(output_dir, **part("value_head."))
        if unwrapped.value_backbone is not None:
            unwrapped.value_backbone.save_pretrained(
                os.path.join(output_dir, VALUE_MODEL_DIR), **part("value_backbone.")
            )
        self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))  # `PPOConfig` pickles without secrets

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Load what `_save` wrote: the policy through Trainer's own loader (full weights, shards or the adapter),
        then the value head / value model. Under FSDP, Trainer's loader reads the engine's own files."""
        if self.is_fsdp_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model or self.model_wrapped)
        unwrapped = self.unwrapped()
        super()._load_from_checkpoint(resume_from_checkpoint, model=unwrapped.policy)
        head = os.path.join(resume_from_checkpoint, VALUE_HEAD_FILE)
        if not os.path.isfile(head):
            raise ValueError(f"{resume_from_checkpoint} has no {VALUE_HEAD_FILE}: it was not written by PPOTrainer.")
        unwrapped.value_head.load_state_dict(ValueHead.from_pretrained(resume_from_checkpoint).state_dict())
        if unwrapped.value_backbone is not None:
            super()._load_from_checkpoint(
                os.path.join(resume_from_checkpoint, VALUE_MODEL_DIR), unwrapped.value_backbone
            )
        return None

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint's policy and value head (the engines load their own files)."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_best_model()
        logger.info(
            f"Loading the best model from {self.state.best_model_checkpoint} (score: {self.state.best_metric})."
        )
        self._load_from_checkpoint(self.state.best_model_checkpoint)
        return None

    def _trainer_checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared, per-process) state for a checkpoint: the KL coefficient and running score statistics (the same
        on every process), this process's mini-batch shuffling stream."""
        guards = {name: guard.checkpoint_state() for name, guard in self.reward_guards.items()}
        shared = {"kl_coef": self.kl_ctl.value, "running": self.running.state_dict(), "reward_guards": guards}
        return shared, {"shuffle": self.shuffle_generator.get_state()}

    def _load_trainer_checkpoint_state(self, shared: dict[str, Any], per_process: dict[str, Any] | None) -> None:
        self.kl_ctl.value = shared["kl_coef"]
        self.running.load_state_dict(shared["running"])
        for name, state in shared.get("reward_guards", {}).items():
            if name in self.reward_guards:
                self.reward_guards[name].load_checkpoint_state(state)
        if per_process is not None:
            self.shuffle_generator.set_state(per_process["shuffle"])

    def _named_reward_funcs(self) -> list[tuple[str, Any]]:
        """(name, function) of the reward functions whose checkpoint state (e.g. critic counters) is saved: the
        trainer's and those a step-API loop registered with `save_checkpoint` / `load_checkpoint`."""
        extra = [(getattr(f, "__name__", type(f).__name__), f) for f in self._step_api_reward_funcs]
        return [*zip(self.rewards.names, self.rewards.funcs), *extra]

    def _track(self, reward_funcs: Sequence[Any]) -> None:
        for func in reward_funcs:
            if not any(func is known for known in self._step_api_reward_funcs):
                self._step_api_reward_funcs.append(func)

    def _resolve_checkpoint(self, resume_from_checkpoint: str | bool | None) -> CheckpointInfo | None:
        """The checkpoint to resume from: True takes the newest complete one in `args.output_dir` (logging the newer
        ones skipped, and why); a folder is checked. ValueError names the folder and the fix for an incomplete one."""
        return resolve_checkpoint(
            resume_from_checkpoint,
            self.args.output_dir,
            self.accelerator.num_processes,
            per_process=() if self.args.save_only_model else (rng_state_file(self),),
        )

    def _load_checkpoint(self, info: CheckpointInfo) -> None:
        """Restore everything a checkpoint holds, the way Trainer's resume reads it (weights, optimizer, scheduler,
        scaler, trainer state, callbacks' state, RNG), then trl_stable's state (KL controller, running moments,
        shuffling stream, health monitor, reward-function counters)."""
        path = info.path
        if self.is_deepspeed_enabled:
            deepspeed_load_checkpoint(self.model_wrapped, path, load_module_strict=not self.is_peft)
        else:
            self._load_from_checkpoint(path)
        self._load_optimizer_and_scheduler(path)
        self._load_scaler(path)
        loaded = TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_FILE))
        self.state = loaded
        self.state.init_training_references(self, loaded.max_steps, self.args.num_train_epochs, None)
        self._load_callback_state()
        if info.same_processes:
            self._load_rng_state(path)
        stable = load_stable_state(info, self.accelerator.process_index)
        if stable is not None:
            restore_stable_state(stable, self.health_monitor, self._named_reward_funcs(), self.args)
            self._load_trainer_checkpoint_state(stable["shared"], stable["per_process"])

    def save_checkpoint(self, output_dir: str | None = None, reward_funcs: Sequence[Any] = ()) -> str:
        """Save a resumable checkpoint now, as `train()` saves one per `save_strategy` (Trainer's `_save_checkpoint`:
        weights, optimizer, scheduler, RNG, trainer state, rotation by `save_total_limit`; plus trl_stable's state and
        the completeness marker); returns its folder, ``args.output_dir/checkpoint-{global_step}``. Call it on every
        process.

        Args:
            output_dir: Must be None or that folder (checkpoints live in `args.output_dir`, as in Trainer).
            reward_funcs: Reward functions the trainer does not hold (a step-API loop's critic) whose
                ``checkpoint_state()`` is saved too; they stay registered, and `load_checkpoint` restores them.
        """
        final = os.path.join(self._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if output_dir is not None and os.path.normpath(output_dir) != os.path.normpath(final):
            raise ValueError(
                f"save_checkpoint writes {final} (output_dir/checkpoint-<step>, as Trainer does), not {output_dir}: "
                "set PPOConfig.output_dir to the folder the checkpoints should go to."
            )
        self._track(reward_funcs)
        self._save_checkpoint(self.model_wrapped, trial=None)
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return final

    def load_checkpoint(self, checkpoint_dir: str | CheckpointInfo, reward_funcs: Sequence[Any] = ()) -> None:
        """Restore everything `save_checkpoint` wrote (for the step API; `train(resume_from_checkpoint=...)` does it
        itself), `reward_funcs` as in `save_checkpoint`. The folder must be a complete checkpoint (its RNG file
        included); ValueError names the folder, what is missing and the fix."""
        self._track(reward_funcs)
        info = checkpoint_dir
        if not isinstance(info, CheckpointInfo):
            if not checkpoint_dir:
                raise ValueError(f"load_checkpoint needs a checkpoint folder, got {checkpoint_dir!r}.")
            info = self._resolve_checkpoint(checkpoint_dir)
        self._load_checkpoint(info)

    # ------------------------------------------------------------------ the Hub
    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """TRL's model card (as TRL's trainers write it) plus a section on the value head and how to load the policy
        (adapter or full model). Main process only."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        if self.is_peft:
            tags.append("peft")
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        policy = (
            "a LoRA adapter: load it with `peft.AutoPeftModelForCausalLM.from_pretrained`"
            if self.is_peft
            else "a full causal LM: load it with `transformers.AutoModelForCausalLM.from_pretrained`"
        )
        critic = (
            f"on the policy's last hidden state (`{VALUE_HEAD_FILE}`)"
            if self.unwrapped().value_backbone is None
            else f"on a separate critic, saved under `{VALUE_MODEL_DIR}/` with its head in `{VALUE_HEAD_FILE}`"
        )
        with open(os.path.join(self.args.output_dir, "README.md"), "a", encoding="utf-8") as f:
            f.write(
                "\n\n## PPO value head\n\n"
                f"The policy is {policy}. The trained value head is a scalar head {critic}, kept to resume PPO or to "
                "score states; load it with `trl_stable.trainers.ppo.value_head.ValueHead.from_pretrained(folder)`.\n"
            )

    # ------------------------------------------------------------------ tables and RELC-era compatibility
    @property
    def policy(self) -> nn.Module:
        """The policy model (the one passed as `model`, with its adapter under PEFT); `self.model` is Trainer's model,
        the `PolicyAndValue` wrapper that also holds the value head."""
        return self.unwrapped().policy

    def log_table(self, name: str, columns: dict[str, list[Any]]) -> None:
        """Log a table (equal-length columns, already gathered from every process) the way TRL's GRPO logs its
        `completions` table: on the main process, straight to the wandb / trackio run when `report_to` names one
        (tables do not fit `on_log`'s scalar dicts), and kept in `self.tables[name]` for other consumers."""
        if not self.accelerator.is_main_process:
            return
        self.tables[name] = {"step": [self.state.global_step] * len(next(iter(columns.values()), [])), **columns}
        report_to = self.args.report_to or []
        backends = []
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                backends.append(wandb)
        if "trackio" in report_to:
            import trackio

            backends.append(trackio)
        if backends:
            import pandas as pd

            frame = pd.DataFrame(self.tables[name])
            for backend in backends:
                backend.log({name: backend.Table(dataframe=frame)})

    def _log_completions(self, prompts: list[Any], responses: list[torch.Tensor], rewards: Any) -> None:
        """The `completions` table of a logged `train()` step (prompt, completion, reward from every process), as
        TRL's GRPO logs it. Only on logged steps: gathering the texts costs one `gather_object` per logged step."""
        n = len(responses)
        dense = rewards.dense.rows if rewards.dense is not None else [None] * n
        scores = rewards.scores.tolist() if rewards.scores is not None else [0.0] * n
        totals = [float(s) + (0.0 if d is None else float(torch.as_tensor(d).nansum())) for s, d in zip(scores, dense)]
        completions = self.processing_class.batch_decode([r.tolist() for r in responses], skip_special_tokens=True)
        self.log_table(
            "completions",
            {
                "prompt": gather_object([p if isinstance(p, str) else str(p) for p in prompts]),
                "completion": gather_object(completions),
                "reward": gather_object(totals),
            },
        )

    def log_stats(
        self,
        stats: dict[str, float],
        batch: dict | None = None,
        rewards: Any | None = None,
        columns_to_log: Sequence[str] = ("query", "response"),
    ) -> None:
        """Old TRL's `log_stats`: `step()` already logged `stats`; this logs the `rewards` of every process
        (env/reward_mean, env/reward_std) and the game log, a table of `columns_to_log` from `batch` and the reward
        of each sample, gathered from every process (`self.tables["game_log"]`, and wandb / trackio when
        `report_to` names one). Call it on every process: it gathers."""
        if rewards is None:
            return
        local = [float(torch.as_tensor(r, dtype=torch.float32).sum()) if r is not None else math.nan for r in rewards]
        values = torch.tensor(gather_object(local), dtype=torch.float32)
        finite = values[~torch.isnan(values)]
        self.log(
            {
                "env/reward_mean": finite.mean().item() if len(finite) else math.nan,
                "env/reward_std": finite.std().item() if len(finite) > 1 else 0.0,
            }
        )
        if batch is not None:
            columns = {c: gather_object([str(v) for v in batch[c]]) for c in columns_to_log if c in batch}
            self.log_table("game_log", {**columns, "reward": values.tolist()})


def _refuse_unused_arguments(args: PPOConfig, model: Any, ref_model: Any, lam_fn: Any) -> None:
    """Refuse a `PPOConfig` setting that a `PPOTrainer` argument makes the trainer ignore, naming both."""
    if args.model_init_kwargs is not None and not isinstance(model, str):
        raise ValueError(
            f"model_init_kwargs={args.model_init_kwargs!r} are keyword arguments for loading the policy by name, but "
            f"`model` is a {type(model).__name__} object, which is used as is: pass the model's name or path, or "
            "leave model_init_kwargs=None."
        )
    if args.num_shared_layers is not None and ref_model is not None:
        raise ValueError(
            f"num_shared_layers={args.num_shared_layers} shares layers of the reference the trainer copies from the "
            "policy, but `ref_model` was given and is used as is: leave num_shared_layers=None, or drop ref_model "
            "(trl_stable.trainers.ppo.models.create_reference_model builds a sharing one)."
        )
    if lam_fn is not None and (args.lam_schedule is not None or args.lam != field_default(args, "lam")):
        shown = f"lam_schedule={args.lam_schedule!r}" if args.lam_schedule is not None else f"lam={args.lam}"
        raise ValueError(
            f"{shown} and `lam_fn` both set GAE's lambda, and lam_fn would win: leave {shown.split('=')[0]} at its "
            "default, or drop lam_fn."
        )


def _dense_sums(rows: Sequence[Any]) -> torch.Tensor:
    """Each completion's summed dense reward (NaN tokens count 0, as in `step`)."""
    return torch.tensor(
        [0.0 if row is None else float(torch.as_tensor(row, dtype=torch.float64).nansum()) for row in rows]
    )


def _is_sized(value: Any) -> bool:
    """Whether `value` holds entries (a list, tuple, >= 1-D tensor or array), not a string or a number."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim > 0
    return not isinstance(value, (str, bytes)) and hasattr(value, "__len__")


def _trim_micro_batch(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the trailing response columns that are padding in every row of the micro-batch (saves compute)."""
    width = int(mb["response_lengths"].max())
    full = mb["response_ids"].shape[1]
    if width == full:
        return mb
    cut = full - width
    seq = mb["input_ids"].shape[1]  # > full: every query has a token
    out = {}
    for k, v in mb.items():
        if v.dim() >= 2 and v.shape[1] == seq:  # sequence-aligned (ids, masks, routing, any per-position extra)
            out[k] = v[:, : seq - cut]
        elif v.dim() >= 2 and v.shape[1] == full:  # response-aligned
            out[k] = v[:, :width]
        else:
            out[k] = v
    return out
