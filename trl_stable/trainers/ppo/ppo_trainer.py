"""PPO with a value model and per-token (dense) rewards, a `transformers.Trainer` (through TRL's base trainer).

The PPO iteration and its loop are ours, the rest is `Trainer`'s; it runs through `train()` or the RELC-era step API
(``generate`` then ``step``). One step, top to bottom in `step` (docs/ppo.md, "How one PPO step works"): rollout
(`generate`), rollout pass (`rollout_pass`: old, reference log-probs, values, KL), rewards and advantages
(`compute_advantages`), update (`update`: `ppo_epochs` passes of clipped policy and value losses).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from accelerate.data_loader import skip_first_batches
from accelerate.utils import set_seed
from torch import nn
from transformers import TrainerCallback
from transformers.optimization import GreedyLR
from transformers.trainer_utils import TrainOutput
from trl.trainer.base_trainer import _BaseTrainer

from trl_stable.core.estimators import AdvantageInputs, get_advantage_estimator
from trl_stable.core.gae import count_turns, relative_position_lambda, vapo_lambda
from trl_stable.core.kl import AdaptiveKLController, FixedKLController, full_kl, kl_estimate
from trl_stable.core.masked_stats import masked_mean, masked_whiten
from trl_stable.core.policy_loss import decoupled_ppo_loss, policy_clip_fraction, ppo_clip_term, pre_mask_token_mean
from trl_stable.core.score_scaling import RunningMoments
from trl_stable.core.token_rewards import compose_token_rewards, last_action_index
from trl_stable.core.value_loss import clipped_value_loss
from trl_stable.masking.completion_steps import CompletionStepMasker
from trl_stable.moe.hook import ROUTED_EXPERTS_KEY, RoutingHook
from trl_stable.monitoring.integration import attach_health_monitor
from trl_stable.monitoring.reduction import Stat, reduce_metrics
from trl_stable.rewards.failure_guard import FailureGuard
from trl_stable.settings.checks import field_default
from trl_stable.trainers.checkpoints import MarkedCheckpoints, check_checkpoint_names
from trl_stable.trainers.ppo.engines import (
    check_engine,
    configure_deepspeed,
    prepare_reference,
    require_deepspeed_if_asked,
)
from trl_stable.trainers.ppo.evaluation import Evaluation
from trl_stable.trainers.ppo.loop_events import LoopEvents
from trl_stable.trainers.ppo.models import (
    PolicyAndValue,
    ResponseForwards,
    add_fused_logprob_head,
    build_models,
    embedding_rows,
    is_quantized,
)
from trl_stable.trainers.ppo.ppo_config import PPOConfig
from trl_stable.trainers.ppo.prompts import PromptData, collate_rows
from trl_stable.trainers.ppo.rewards import RewardFunctions
from trl_stable.trainers.ppo.rollout import LengthSampler, Rollout, hf_sampler, trim_response
from trl_stable.trainers.ppo.saving import SaveAndResume
from trl_stable.trainers.ppo.step_inputs import (
    check_step_inputs,
    check_token_ids,
    make_batch,
    resolve_token_rewards,
    trim_micro_batch,
)
from trl_stable.trainers.ppo.step_rewards import StepRewards
from trl_stable.trainers.ppo.vllm import VLLMRollouts, vllm_sampler
from trl_stable.trainers.processes import call_on_every_process, guard_reward_failures
from trl_stable.trainers.prompt_checks import model_context

logger = logging.getLogger(__name__)

__all__ = ["PPOTrainer"]


PPO_CITATION = """\
@article{schulman2017proximal,
    title        = {{Proximal Policy Optimization Algorithms}},
    author       = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
    year         = 2017,
    eprint       = {arXiv:1707.06347}
}"""
# schedules that step on evaluation metrics, not per optimizer step (as in Trainer's loop)
_METRIC_SCHEDULES = (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)


class PPOTrainer(
    ResponseForwards,
    StepRewards,
    PromptData,
    LoopEvents,
    Evaluation,
    SaveAndResume,
    MarkedCheckpoints,
    _BaseTrainer,
):
    """PPO trainer with a value model, a reference model and per-token rewards; a `transformers.Trainer`, `args`
    honored as `Trainer` honors them (`docs/ppo.md` describes every argument).

    Args:
        model: The policy: a causal LM or its name/path (loaded with `args.model_init_kwargs`; None: `model_name`).
        reward_funcs: For `train()` / `evaluate()`: sequence-classification models (or names), callables with TRL's
            signature, or dense callables (`trl_stable.rewards.dense_reward`), weighted by `args.reward_weights`.
        args: A `PPOConfig`. None: defaults with `output_dir="ppo_output"`.
        train_dataset: Prompts for `train()`: a "prompt" or "input_ids" column; other columns go to the rewards.
        eval_dataset: Prompts for `evaluate()`, or a dict of them (each evaluated under its name).
        processing_class: The tokenizer (left padding for generation). None: loaded from the model name.
        ref_model: The frozen reference. None: the adapter-free policy under PEFT, else a frozen copy of the policy.
        value_model: None: a value head on the policy's last hidden state; a `ValueHead`; or a separate critic.
        reward_processing_classes: Tokenizers of the reward models, in `reward_funcs` order (None: loaded by name).
        callbacks: `transformers.TrainerCallback`s, called as `Trainer` calls them.
        optimizers: (optimizer, lr_scheduler); None entries are built by `Trainer` from `args`.
        peft_config: A `peft.PeftConfig`: train a LoRA adapter (+ the value head) instead of the full policy.
        lam_fn: ``lam_fn(lengths: LongTensor[B]) -> Tensor[B]``, GAE's lambda per sequence, instead of `args.lam`.
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

        model = args.model_name if model is None else model
        if model is None:
            raise ValueError("Pass `model` (a causal LM or its name) or set `PPOConfig.model_name`.")
        if lam_fn is not None and (args.lam_schedule is not None or args.lam != field_default(args, "lam")):
            shown = f"lam_schedule={args.lam_schedule!r}" if args.lam_schedule is not None else f"lam={args.lam}"
            raise ValueError(
                f"{shown} and `lam_fn` both set GAE's lambda: leave {shown.split('=')[0]} alone or drop lam_fn."
            )
        models = build_models(model, args, processing_class, ref_model, value_model, peft_config)
        model, ref_model, processing_class = models.wrapper.policy, models.ref_model, models.tokenizer
        self.pad_token_id, self.eos_token_id = processing_class.pad_token_id, processing_class.eos_token_id
        self.is_peft = models.is_peft
        super().__init__(
            model=models.wrapper,
            args=args,
            data_collator=collate_rows,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        check_checkpoint_names(self.args.output_dir)
        check_engine(self, quantized=is_quantized(model))
        # Log-probs through TRL's fused LM head (no [B, R, V] logits) where it saves memory: on CUDA, or when asked
        fused = args.fused_lm_head if args.fused_lm_head is not None else self.accelerator.device.type == "cuda"
        self.fused_policy = fused and add_fused_logprob_head(model, args.temperature)
        self.fused_ref = fused and ref_model is not None and add_fused_logprob_head(ref_model, args.temperature)

        # --- rewards; the engine set-up, optimizer and scheduler are Trainer's (the step API needs them now) ---
        self.rewards = RewardFunctions(
            reward_funcs, args.reward_weights, reward_processing_classes, processing_class, args.max_abs_reward
        ).to(self.accelerator.device)
        self.reward_guards = {
            name: FailureGuard(f"Reward function '{name}'", args.reward_max_failing_steps, "reward_max_failing_steps")
            for name in self.rewards.names
        }
        # The data order is the sampler's (seeded with `data_seed` or `seed`): built before the per-process seeding
        # below, which the sampler would otherwise read as its seed.
        self.train_dataloader = self.get_train_dataloader() if train_dataset is not None else None
        if self.is_deepspeed_enabled:
            configure_deepspeed(self.accelerator)
        # from the return value the registry pins (integration.trl_members), not from what the call also sets
        self.model_wrapped, _ = self._prepare_for_training(self._scheduler_horizon(), None, None)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped
        self.ref_model = None if ref_model is None else prepare_reference(self, ref_model)
        coef, adaptive = args.init_kl_coef, args.adap_kl_ctrl
        self.kl_ctl = AdaptiveKLController(coef, args.target, args.horizon) if adaptive else FixedKLController(coef)
        self.running = RunningMoments()
        self.lam_fn = lam_fn
        self.current_device = self.accelerator.device  # old TRL's attribute, read by RELC-era scripts
        # Invalid agent steps leave the policy loss (assign `trainer.step_masker` for environment-reported steps).
        self.step_masker = CompletionStepMasker(tools=args.step_mask_tools) if args.step_loss_mask else None
        self.routing = RoutingHook(self.unwrapped().policy, args.routing_replay)
        # The context of every model the sequences go through (a separate value model or reference may differ):
        # a length they cannot take fails here or before `generate`, not as an IndexError inside a forward.
        contexts = (model, models.wrapper.value_backbone, ref_model)
        self.model_contexts = [model_context(m) for m in contexts if m is not None]
        # likewise a token id none of their embedding tables holds (`check_token_ids`)
        self.vocab_size = min((n for n in map(embedding_rows, contexts) if n is not None), default=None)
        self._check_prompts_at_start(train_dataset)
        # vLLM rollouts (TRL's helper): after `prepare`, so the helper sees the engine's (possibly sharded) policy
        self.vllm_rollouts = None
        if args.use_vllm:
            self.vllm_rollouts = VLLMRollouts(self.policy, self.accelerator, processing_class, args, models.model_id)
        # per-process streams: mini-batch shuffling, and sampling in generate (seeded per rank below)
        self.shuffle_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        set_seed(args.seed, device_specific=True)
        self._train_begun = False
        self._step_api_reward_funcs: list[Any] = []  # stateful reward functions a step-API loop checkpoints
        self.tables: dict[str, dict[str, list[Any]]] = {}  # latest table per name (main process), see log_table
        self.health_monitor = attach_health_monitor(self)  # reads the logs only
        logger.info(self.describe())

    @property
    def policy(self) -> nn.Module:
        """The policy (with its adapter under PEFT); `self.model` is Trainer's, the `PolicyAndValue` wrapper."""
        return self.unwrapped().policy

    def unwrapped(self) -> PolicyAndValue:
        """The `PolicyAndValue` module (policy, value head, optional value backbone) without its engine wrapper."""
        return self.accelerator.unwrap_model(self.model_wrapped)

    def describe(self) -> str:
        """One line naming the active advantage, KL, loss, filter and routing path (logged once at start-up)."""
        args = self.args
        lam = "lam_fn" if self.lam_fn else args.lam_schedule or f"lam={args.lam}"
        kl = f"{args.kl_penalty}, {'adaptive' if args.adap_kl_ctrl else 'fixed'} coef {args.init_kl_coef}"
        loss = "decoupled" if args.use_decoupled_loss else "clip"
        if args.token_filter:
            bounds, how = list(args.filter_bounds), f"{args.token_filter_level}/{args.token_filter_action}"
            loss += f", filter={args.token_filter}{bounds} {how}"
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
            length_sampler: Called per generation chunk for its `max_new_tokens` (None: `args.min_new_tokens`).
            return_prompt: Prepend the query to each returned sequence (the old TRL default); RELC passes False.
            batch_size: Generate in chunks of this many queries (None: `args.generation_batch_size` or all).
            generation_kwargs: Override `generate` arguments (top_k, top_p, temperature, do_sample, ...).

        Returns:
            For a list, a `Rollout`: the responses (cut after EOS) with the sampler's log-probs and routing `step`
            reads. For one query, its tensor.
        """
        single = isinstance(query_tensor, torch.Tensor) and query_tensor.dim() == 1
        queries = [query_tensor] if single else list(query_tensor)
        for i, q in enumerate(queries):
            check_token_ids(q, "query_tensor" if single else f"query_tensor[{i}]", self.vocab_size)
            if len(q) == 0:
                raise ValueError("Every query needs at least one token (e.g. a BOS token).")
        args = self.args
        if length_sampler is None and args.min_new_tokens is not None:
            length_sampler = LengthSampler(args.min_new_tokens, args.max_new_tokens)
        chunk = batch_size or args.generation_batch_size or len(queries)
        if self.vllm_rollouts is not None and generation_kwargs:
            raise ValueError(f"generate() got {sorted(generation_kwargs)} with use_vllm: set sampling on PPOConfig.")
        sampler = vllm_sampler(self) if self.vllm_rollouts is not None else hf_sampler(self, generation_kwargs)
        sequences, logps, routing = [], [], []
        with sampler as sample:
            for start in range(0, len(queries), chunk):
                batch = [q.to(self.accelerator.device).long() for q in queries[start : start + chunk]]
                cap = max(1, int(length_sampler())) if length_sampler is not None else None
                completions, chunk_logps, routes = sample(start, batch, cap)
                responses = [trim_response(c, self.eos_token_id) for c in completions]
                if chunk_logps is not None:
                    logps += [torch.tensor(lp[: len(r)], dtype=torch.float32) for lp, r in zip(chunk_logps, responses)]
                if routes is not None:
                    routing += [torch.as_tensor(x)[: len(q) + len(r)] for x, q, r in zip(routes, batch, responses)]
                sequences += [torch.cat([q, r]) if return_prompt else r for q, r in zip(batch, responses)]
        rollout = Rollout(sequences, queries, logps or None, routing or None, with_prompt=return_prompt)
        return rollout[0] if single else rollout

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
        """Run one PPO iteration on `args.batch_size` samples and return its statistics (docs/ppo.md, "Driving it
        step by step"): per-token reward ``-kl_coef * KL + token_rewards + score@last``; a NaN, None or infinite
        reward marks a sample without one (`args.nan_reward_action`).

        Args:
            queries: Prompt ids, one 1-D LongTensor per sample.
            responses: Response ids, one per sample: the `Rollout` of ``generate(return_prompt=False)``, or tensors.
            token_rewards: One row of ``len(responses[i])`` rewards per sample, or a zero-argument callable returning
                them, called after the rollout pass.
            scores: One sequence-level score per sample, added on the last response token after score scaling.
            turn_ids: Per response token its assistant turn (0, 1, ..., -1: no action); switches to turn-level GAE.
            sampler_logprobs: With `use_decoupled_loss`, the sampler's log-prob per response token (None: `Rollout`'s).
            extra_logs: Merged into the step's logs after deferred rewards are resolved (`Stat` values are reduced).
        """
        args = self.args
        sampler_logprobs, routing, deferred = check_step_inputs(
            self, queries, responses, token_rewards, scores, turn_ids, sampler_logprobs
        )
        if not self._train_begun:
            self._begin(max_steps=max(args.max_steps, 0))
        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        step_start = time.time()

        batch = self.make_batch(queries, responses, turn_ids, routing)
        self._track_num_input_tokens(batch)  # Trainer's include_num_input_tokens_seen, over every process
        self.model_wrapped.eval()
        # The forwards first: they read ids and masks only, never the rewards, so deferred rewards (a critic's
        # requests in flight) are waited for after them.
        batch, rollout_logs = self.rollout_pass(batch)
        if deferred is not None:
            # checked; a contract error seen by one process stops every process
            token_rewards = call_on_every_process(self.accelerator, resolve_token_rewards, deferred, responses)
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

        logs = {**advantage_logs, **reward_logs, "ppo/learning_rate": self.optimizer.param_groups[0]["lr"]}
        logs.update({**update_logs, **rollout_logs, **behaviour_logs, **(extra_logs or {})})
        logs["time/ppo_step"] = Stat.max(time.time() - step_start)
        # the step mask's counts, the reward functions' metrics and the step time are this process's own; a reward
        # function may log a metric on some processes only
        logs = reduce_metrics(logs, self.accelerator, names_may_differ=True)
        self._end_step(logs)
        return logs

    def make_batch(self, queries, responses, turn_ids=None, routing=None) -> dict[str, torch.Tensor]:
        """`step`'s batch (`trl_stable.trainers.ppo.step_inputs.make_batch`) on the trainer's pad token and device."""
        return make_batch(queries, responses, self.pad_token_id, self.accelerator.device, turn_ids, routing)

    # ------------------------------------------------------------------ 2. rollout pass
    @torch.no_grad()
    def rollout_pass(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Log-probs and values of the rollout policy, reference log-probs and the per-token KL, under no grad.

        Runs in chunks of `per_device_train_batch_size`; returns a copy of `batch` with `old_logprobs`,
        `ref_logprobs`, `values`, `bootstrap_values`, `kl` and `entropy` ([B, R] / [B]) and, for R2 routing replay,
        the routing this pass took; and the routing metrics. It reads ids and masks only, never the rewards.
        """
        args = self.args
        parts, recorded = [], []
        full = args.kl_penalty == "full"  # the whole distributions: the only pass that needs the logits
        for start in range(0, batch["input_ids"].shape[0], args.per_device_train_batch_size):
            mb = {k: v[start : start + args.per_device_train_batch_size] for k, v in batch.items()}
            with self.accelerator.autocast():
                with self.routing.rollout_pass(mb["attention_mask"], mb.get(ROUTED_EXPERTS_KEY)) as rollout:
                    scores, values = self._forward(self.model_wrapped, mb, need_logits=full)
                ref = self._ref_scores(mb, need_logits=full)  # outside the routing point: never replayed
            if full:
                kl = full_kl(scores.logits / args.temperature, ref.logits / args.temperature)
            else:
                kl = kl_estimate(scores.logprobs, ref.logprobs, args.kl_penalty)
            bootstrap = values.gather(1, mb["response_lengths"].unsqueeze(1)).squeeze(1)
            parts.append((scores.logprobs, ref.logprobs, values[:, :-1], bootstrap, kl, scores.entropy))
            if self.routing.mode == "R2":
                recorded.append(rollout.routing)
        keys = ("old_logprobs", "ref_logprobs", "values", "bootstrap_values", "kl", "entropy")
        result = {**batch, **{k: torch.cat(v) for k, v in zip(keys, zip(*parts))}}
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
        whiten = dict(whiten=args.whiten_rewards, reduce_sum=self._reduce_sum)
        parts = compose_token_rewards(kl, kl_coef, batch["dense_rewards"], batch.get("scores"), mask, **whiten)
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
        advantages = advantages * valid.unsqueeze(1)  # unscored samples: advantage 0 (all 'zero' keeps in the loss)
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
        return batch, reduce_metrics(stats, self.accelerator)

    def _reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(x, reduction="sum")

    # ------------------------------------------------------------------ 4. update
    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """`ppo_epochs` passes over shuffled mini-batches; one optimizer step per `per_device_train_batch_size *
        gradient_accumulation_steps` samples; early stop when the policy KL exceeds 1.5 x `target_kl`."""
        args = self.args
        n = batch["input_ids"].shape[0]
        backward = args.per_device_train_batch_size * args.gradient_accumulation_steps
        sync_each_batch = self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        self.optimizer.train()  # schedule-free optimizers keep two weight sets (Trainer switches them too)
        records: dict[str, list[float]] = {}
        early_stopped, epochs_done = False, 0
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(n, generator=self.shuffle_generator).to(self.accelerator.device)
            for start in range(0, n, backward):
                idx = perm[start : start + backward]
                policy_kl = torch.zeros((), device=self.accelerator.device)
                for micro_start in range(0, backward, args.per_device_train_batch_size):
                    micro = idx[micro_start : micro_start + args.per_device_train_batch_size]
                    mb = trim_micro_batch({k: v[micro] for k, v in batch.items()})
                    last_micro = micro_start + args.per_device_train_batch_size >= backward
                    # gradients are all-reduced once per optimizer step, not once per micro-batch (unless
                    # accelerator_config.gradient_accumulation_kwargs asks for sync_each_batch, as in Trainer)
                    all_reduce = last_micro or sync_each_batch
                    sync = nullcontext() if all_reduce else self.accelerator.no_sync(self.model_wrapped)
                    if self.is_deepspeed_enabled:  # PPO counts its micro-batches itself, without `accumulate`
                        self.accelerator.gradient_state._set_sync_gradients(last_micro)
                    with sync:
                        loss, mb_stats = self._loss(mb)
                        # DeepSpeed divides by its gradient_accumulation_steps itself (`configure_deepspeed`)
                        scale = 1 if self.is_deepspeed_enabled else args.gradient_accumulation_steps
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
                stepped = not self.accelerator.optimizer_step_was_skipped
                if stepped and not isinstance(self.lr_scheduler, _METRIC_SCHEDULES):
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
        vpred = values[:, :-1]
        old_logprobs, advantages = mb["old_logprobs"], mb["advantages"]
        policy_mask = mask * mb["step_keep"] if "step_keep" in mb else mask  # invalid agent steps: no policy gradient
        if "behaviour_weight" in mb:
            weight, keep = mb["behaviour_weight"], mb["behaviour_keep"]
            pg_loss = decoupled_ppo_loss(
                logprobs, old_logprobs, weight, advantages, policy_mask, keep, eps_low=args.cliprange
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

    # ------------------------------------------------------------------ train()
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """Train over `train_dataset` (generate, score with `reward_funcs`, `step`) for `args.max_steps` steps or
        `args.num_train_epochs` passes, logging, evaluating and saving as `transformers.Trainer` does.
        `resume_from_checkpoint` (True: the newest complete one) continues bit for bit (docs/reliability.md); `trial`
        is refused and `ignore_keys_for_eval` unused."""
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
        prompts, queries = self._prompt_ids(rows)
        responses = self.generate(queries, return_prompt=False)
        # sequence rewards now; dense functions prefetched, called by step() after its forwards. A contract error is
        # seen by this process only: every process must stop with it
        pending = call_on_every_process(self.accelerator, self.rewards.start, rows, prompts, responses, self.state)
        guard_reward_failures(
            self.accelerator, self.reward_guards, pending.names, pending.rewards_per_func, pending.failures
        )
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            pending.normalize_then_sum(lambda x: self._reduce_sum(x.to(self.accelerator.device)).cpu())
        stats = self.step(
            queries,
            responses,
            token_rewards=pending.token_rewards if pending.pending_dense is not None else None,
            scores=pending.scores,
            extra_logs=pending.stats,  # the dense metrics join it when step() collects them
        )
        dense = pending.result().dense
        if dense is not None:  # a dense function that raised on any process failed this step
            guard_reward_failures(
                self.accelerator, self.reward_guards, self.rewards.dense_names, None, dense.failures, everywhere=False
            )
        if self._logged_this_step():
            self._log_completions(prompts, responses, pending.result())
        return stats
