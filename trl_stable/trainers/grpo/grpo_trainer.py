"""trl_stable's GRPOTrainer: TRL's, plus the stability options; with every option at its default, TRL's step for step
(each override calls ``super()`` and only post-processes when an option asks). docs/grpo.md ("Extending the
trainer") has the override points; the private TRL members used are in `trl_stable.integration.trl_members`.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import trl

from trl_stable.core import overlong_penalty, zero_variance_groups
from trl_stable.masking.completion_steps import CompletionStepMasker
from trl_stable.moe.hook import ROUTED_EXPERTS_KEY, RoutingHook, batch_routing
from trl_stable.monitoring.integration import attach_health_monitor
from trl_stable.monitoring.reduction import has_own_reduction, reduce_metrics, step_mask_stats
from trl_stable.rewards.dense import (
    PendingDenseRewards,
    bound_rewards,
    has_prefetch,
    is_dense_reward,
    record_reward_failures,
    weighted_reward_sum,
)
from trl_stable.rewards.failure_guard import FailureGuard
from trl_stable.settings.checks import Dependent, check_dependents, ignored_setting
from trl_stable.trainers.checkpoints import check_checkpoint_names
from trl_stable.trainers.grpo.advantages import SequenceAdvantages
from trl_stable.trainers.grpo.checkpoints import GRPOCheckpoints
from trl_stable.trainers.grpo.decoupled_loss import DecoupledLoss
from trl_stable.trainers.grpo.dense_rewards import DenseRewards
from trl_stable.trainers.grpo.dynamic_sampling import DynamicSamplingRefill
from trl_stable.trainers.grpo.forward_passes import is_reference_pass, with_mask_position_ids
from trl_stable.trainers.grpo.grpo_config import _STABLE_DEFAULTS, GRPOConfig
from trl_stable.trainers.grpo.trl_batch import multimodal_forward_keys, num_items_in_batch, process_slice, tokenizer_of
from trl_stable.trainers.grpo.trl_logs import (
    flush_reward_metrics,
    log_generation_mismatch,
    log_metric,
    log_metrics,
    replace_logged_advantages,
    train_mode,
)
from trl_stable.trainers.grpo.trl_rewards import ContractCheckedRewards
from trl_stable.trainers.processes import call_on_every_process, raise_on_every_process
from trl_stable.trainers.prompt_checks import (
    check_generation_budget,
    check_prompt_column,
    empty_prompt_error,
    first_error,
    model_context,
    too_long_error,
)
from trl_stable.trainers.sampler_logprobs import record_sampler_logps

logger = logging.getLogger(__name__)


def _overlong_penalty_reward(args: GRPOConfig):
    settings = (args.max_completion_length, args.overlong_penalty_tokens, args.overlong_penalty_factor)

    def overlong_penalty_reward(completion_ids, **kwargs):
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return overlong_penalty(lengths, *settings).tolist()

    overlong_penalty_reward.__name__ = "overlong_penalty"
    return overlong_penalty_reward


@dataclass
class RolloutRecord:
    """What TRL's hooks inside one `_generate_and_score_completions` call hand back to trl_stable (one record per
    call, opened by `_generate_and_score_round`).

    Attributes:
        inputs: The call's input rows (for rewards scored early).
        early_rewards: (completion ids, [N_global, K] rewards) scored in `_generate`, so the dense prefetch starts
            before TRL's no-grad passes; TRL's later `_calculate_rewards` call gets them.
        rewards_per_func: [N_global, K] sequence rewards.
        pending_dense: The prefetched dense reward functions, collected in `_postprocess_generation`.
        dense_rewards: [B, T_max] weighted dense rewards of the local completions once collected.
        sampled_routing: R3: per-sequence sampler routing ([p_i + c_i, layers, k]).
        routing: The batch's routing in trainer layout ([B, P + T, layers, k]) once a rollout pass has run.
    """

    inputs: list[dict[str, Any]] | None = None
    early_rewards: tuple[list[list[int]], torch.Tensor] | None = None
    rewards_per_func: torch.Tensor | None = None
    pending_dense: PendingDenseRewards | None = None
    dense_rewards: torch.Tensor | None = None
    sampled_routing: list[torch.Tensor] | None = None
    routing: torch.Tensor | None = None


class GRPOTrainer(
    GRPOCheckpoints, SequenceAdvantages, DenseRewards, DynamicSamplingRefill, DecoupledLoss, trl.GRPOTrainer
):
    """Drop-in replacement for `trl.GRPOTrainer` with trl_stable's options (docs/grpo.md); same arguments, `args` a
    `trl_stable.GRPOConfig` or a plain `trl.GRPOConfig` (every option off)."""

    _tag_names = ["trl", "grpo", "trl_stable"]

    def __init__(self, model, reward_funcs=None, args=None, *more, **kwargs):
        funcs = reward_funcs if isinstance(reward_funcs, list) else ([] if reward_funcs is None else [reward_funcs])
        if args is not None and args.reward_weights is not None and len(args.reward_weights) != len(funcs):
            raise ValueError(
                f"reward_weights has {len(args.reward_weights)} entries but {len(funcs)} reward functions were "
                "passed in reward_funcs (dense ones included); give one weight per reward function."
            )
        if isinstance(args, GRPOConfig) and not any(is_dense_reward(func) for func in funcs):
            dense = "a dense reward function in reward_funcs (marked with trl_stable.rewards.dense_reward)"
            check_dependents(args, (Dependent(("dense_reward_coef", "dense_reward_gamma"), False, dense),))
        self._rollout: RolloutRecord | None = None  # set only inside `_generate_and_score_round`
        super().__init__(model, reward_funcs, args, *more, **kwargs)
        tools = "tools (GRPOTrainer(tools=...), or an environment_factory with tool methods)"
        check_dependents(
            self.args, (Dependent(("max_tool_calling_iterations",), bool(self.tools), tools),), ignored_setting
        )
        check_checkpoint_names(self.args.output_dir)
        self._nan_dropped_total = 0
        self._split_dense_reward_funcs()
        self._num_user_reward_funcs = len(self.reward_funcs)
        if self._opt("overlong_penalty_tokens") is not None:
            func = _overlong_penalty_reward(self.args)
            self.reward_funcs.append(func)
            self.reward_func_names.append(func.__name__)
            self.reward_processing_classes.append(None)
            self.reward_weights = torch.cat([self.reward_weights, torch.ones(1)])
        # TRL's `_calculate_rewards` calls `reward_funcs`: from here on, the contract-checked ones (built once)
        self._reward_contract = ContractCheckedRewards(self.reward_funcs, self.reward_func_names)
        self.reward_funcs = self._reward_contract.funcs
        limit = self._opt("reward_max_failing_steps")
        self.reward_guards = {
            name: FailureGuard(f"Reward function '{name}'", limit, "reward_max_failing_steps")
            for name in [*self.reward_func_names, *self.dense_reward_func_names]
        }
        self.routing = RoutingHook(self.accelerator.unwrap_model(self.model), self._opt("routing_replay"))
        # Start-up checks (each generation batch's prompts are checked in `_tokenize_prompts`): a completion length
        # the model's context cannot take, and a missing or empty prompt, fail now rather than inside a forward.
        self.model_context = model_context(self.accelerator.unwrap_model(self.model))
        check_generation_budget(self.model_context, self.max_completion_length, "max_completion_length")
        if self.rollout_func is None and self.environment_factories is None:  # else the prompts are theirs to make
            check_prompt_column(self.train_dataset)
        if self.routing.mode == "R3" and self.use_vllm and self.rollout_func is None:
            raise ValueError(
                "routing_replay='R3' with vLLM needs the sampler's routing: pass a rollout_func whose output has "
                "'routed_experts' (one [tokens, layers, k] array per sequence, as vLLM returns them), or use "
                "routing_replay='R2'."
            )
        if self.routing.mode == "R3" and (self.use_transformers_continuous_batching or self.tools):
            raise ValueError(
                "routing_replay='R3' supports single-turn HF generate or a rollout_func; it does not support "
                "continuous batching or tool calling. Fix: use routing_replay='R2'."
            )
        # Reads the logs only (no forward, no RNG): a default run stays identical to TRL's.
        self.health_monitor = attach_health_monitor(self)
        # the configuration the virtual-samples remedy trains with, validated as a config (None without the remedy)
        self._virtual_samples_args = self.args.virtual_samples_config() if isinstance(self.args, GRPOConfig) else None
        self.step_masker = (
            CompletionStepMasker(tools=self._opt("step_mask_tools")) if self._opt("step_loss_mask") else None
        )
        logger.info(self.describe())

    # ------------------------------------------------------------------ options
    def _opt(self, name: str) -> Any:
        """A trl_stable option, with its default when `args` is a plain `trl.GRPOConfig`."""
        return getattr(self.args, name, _STABLE_DEFAULTS[name])

    def advantage_args(self) -> Any:
        """`args`, or while the virtual-samples remedy is on, `args.virtual_samples_config()`."""
        if self._virtual_samples_args is not None and self.health_monitor.remedy_active:
            return self._virtual_samples_args
        return self.args

    def _advantage_settings(self) -> dict[str, Any] | None:
        args = self.advantage_args()
        return args.advantage_settings if isinstance(args, GRPOConfig) else None

    def describe(self) -> str:
        """One line naming the active advantage, loss, decoupled-loss, filter and routing paths (logged at start)."""
        settings = self._advantage_settings()
        estimator = self._opt("advantage_estimator")
        advantages = f"{estimator} (TRL)" if settings is None else f"{settings['estimator']} (trl_stable)"
        sequence_is = ", sequence-level IS" if self.importance_sampling_level == "sequence" else ""
        name, token_filter = self._opt("token_filter"), "off"
        if name is not None:
            band = ",".join(str(bound) for bound in self.args.filter_bounds if bound is not None)
            token_filter = f"{name}[{band}] {self._opt('token_filter_level')}/{self._opt('token_filter_action')}"
        decoupled = "on" if self._opt("use_decoupled_loss") else "off"
        return (
            f"trl_stable GRPO: advantages={advantages}, loss={self.loss_type} (TRL{sequence_is}), "
            f"decoupled={decoupled}, filter={token_filter}, routing={self.routing.mode}"
        )

    def _needs_sampler_logps(self) -> bool:
        """Whether HF generation must record the sampler's log-probs (extend in subclasses that need them)."""
        return bool(
            self._opt("use_decoupled_loss")
            or self._opt("capture_sampler_logps")
            or (self._opt("health_monitor") and self._opt("health_mismatch_monitor"))
        )

    def _log_routing(self, prefix: str) -> None:
        log_metrics(self, self.routing.take_metrics(prefix, self.accelerator))

    # ------------------------------------------------------------------ generation (routing point: sampling)
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        hf_generate = not (self.use_vllm or self.use_transformers_continuous_batching)
        record_logps = hf_generate and self._needs_sampler_logps()
        record_routing = hf_generate and self.routing.mode == "R3" and self._rollout is not None
        if not (record_logps or record_routing):
            return super()._generate_single_turn(*args)
        model = self.accelerator.unwrap_model(self.model_wrapped)
        with (
            record_sampler_logps(model) if record_logps else nullcontext() as recorder,
            self.routing.sampling() if record_routing else nullcontext() as sampled,
        ):
            completion_ids, logprobs = super()._generate_single_turn(*args)
        if sampled is not None:
            self._rollout.sampled_routing = sampled.per_sequence(
                [len(p) for p in prompt_ids], [len(c) for c in completion_ids]
            )
        if recorder is not None:
            logprobs = recorder.per_token_logps(completion_ids)
        return completion_ids, logprobs

    def _tokenize_prompts(self, prompts):
        # A missing, empty or too long prompt is refused here, naming it, rather than failing inside `generate`
        # (IndexError, or a float-typed empty tensor); every process raises together, since each checks its own.
        where = "row {} of this process's generation batch".format
        error = first_error(empty_prompt_error(prompt, where(i)) for i, prompt in enumerate(prompts))
        result = None
        if error is None:
            result = super()._tokenize_prompts(prompts)
            lengths = [len(ids) for ids in result[0]]
            if 0 in lengths:
                i = lengths.index(0)
                error = ValueError(
                    f"The prompt of {where(i)} has no tokens ({prompts[i]!r}); every sample needs at least one token "
                    "to generate from: drop or fill such rows."
                )
            elif self.max_completion_length is not None:
                error = too_long_error(
                    self.model_context,
                    lengths,
                    self.max_completion_length,
                    where,
                    "Drop or shorten the long prompts (e.g. dataset.filter on their token count), or lower "
                    "max_completion_length.",
                )
        raise_on_every_process(
            error,
            self.accelerator,
            lambda: ValueError("A prompt of another process's batch was refused; that process's error names it."),
        )
        return result

    def _generate(self, prompts):
        result = super()._generate(prompts)
        if self.routing.mode == "R3" and self._rollout is not None:
            extra_fields = result[5]  # see trl_members.GRPO_MEMBERS: `_generate` returns an 8-tuple
            routed = extra_fields.pop(ROUTED_EXPERTS_KEY, None) if isinstance(extra_fields, dict) else None
            if routed is not None:
                self._rollout.sampled_routing = [torch.as_tensor(r) for r in routed]
            if self._rollout.sampled_routing is None:
                raise RuntimeError(
                    "routing_replay='R3' got no routing from the sampler: the rollout_func must return "
                    f"'{ROUTED_EXPERTS_KEY}'."
                )
        if self._scores_early(result):
            # TRL scores after its old-logprob and reference passes; scoring (and so starting the critic) here
            # lets the critic's latency overlap those passes. Same functions, same arguments: same numbers.
            _, completion_ids_list, _, completions = result[:4]
            rewards = self._calculate_rewards(self._rollout.inputs, prompts, completions, completion_ids_list)
            self._rollout.early_rewards = ([list(ids) for ids in completion_ids_list], rewards)
        return result

    def _scores_early(self, generated: tuple) -> bool:
        """Whether this round's rewards are scored right after generation: only when a dense reward function has
        work to start early (a prefetch), and not when a rollout_func returned extra fields (TRL merges those into
        the reward functions' inputs only after `_generate`)."""
        return (
            self._rollout is not None
            and self._rollout.inputs is not None
            and any(has_prefetch(f) for f in self.dense_reward_funcs)
            and not generated[5]  # extra_fields
        )

    # ------------------------------------------------------------------ TRL's no-grad passes (routing point: rollout)
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        record = self._rollout
        forward = self._policy_forward(model, args, kwargs)
        if (
            record is None  # outside TRL's batch building: the updates (replayed in `_compute_loss`)
            or not self.routing.active
            or torch.is_grad_enabled()
            or is_reference_pass(self, model)  # the KL reference keeps its own routing
        ):
            return super()._get_per_token_logps_and_entropies(
                forward, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        # TRL's old-logprob pass of the policy on this call's batch: R2 records, R3 replays the sampler's routing
        sampled = None
        if record.sampled_routing is not None:
            sampled = batch_routing(record.sampled_routing, attention_mask, input_ids.shape[1] - logits_to_keep)
        with self.routing.rollout_pass(attention_mask, sampled) as rollout:
            out = super()._get_per_token_logps_and_entropies(
                forward, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        record.routing = rollout.routing
        if sampled is not None:
            self._log_routing("routing/rollout_")
        return out

    def _policy_forward(self, model, args: tuple, kwargs: dict[str, Any]):
        """`model`, or while `_needs_sampler_logps()` (text batches) one numbered from the attention mask as the
        sampler numbers it (`with_mask_position_ids`), for every pass alike; multimodal models (M-RoPE) number
        their own. With every option off, TRL's numbers."""
        if not self._needs_sampler_logps():
            return model
        if len(args) > 3 or any(kwargs.get(key) is not None for key in multimodal_forward_keys()):
            return model
        return with_mask_position_ids(self, model)

    # ------------------------------------------------------------------ rewards
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        record = self._rollout
        if record is not None and record.early_rewards is not None:
            # scored in `_generate` (every process did: a trainer setting), the dense functions prefetched already
            early_ids, early = record.early_rewards
            record.early_rewards = None
            changed = None
            if early_ids != [list(ids) for ids in completion_ids_list]:
                changed = RuntimeError(
                    "trl.GRPOTrainer called _calculate_rewards with other completions than _generate returned, so "
                    "the rewards scored right after generation do not apply; this TRL version breaks the contract "
                    "in trl_stable.integration.trl_members (GRPO_MEMBERS, _generate)."
                )
            raise_on_every_process(  # every process is here: no one is left in a gather
                changed, self.accelerator, lambda: RuntimeError("Another process found TRL's reward call changed.")
            )
            return early
        # TRL calls the functions; `trl_stable.rewards.dense`'s contract reads their answers (`ContractCheckedRewards`)
        try:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            errors, failures = self._reward_contract.take_errors()  # this call's, also when TRL raised
        # after TRL's gather, which every process reached: a broken answer on one process stops them all here
        raise_on_every_process(errors[0] if errors else None, self.accelerator)
        # the bound on every function's values (reward models' logits included) before TRL sums them
        rewards_per_func, out_of_range = bound_rewards(
            rewards_per_func, self.reward_func_names, self._opt("max_abs_reward")
        )
        for name, count in zip(self.reward_func_names, out_of_range.tolist()):
            if count:  # only when a value was clipped, so that a run without one logs exactly what TRL logs
                log_metric(self, f"rewards/{name}/out_of_range", float(count))
        if self.model.training:  # a function with no usable value for any completion of the gathered batch
            unscored = torch.isnan(rewards_per_func).all(dim=0).tolist()
            record_reward_failures(self.reward_guards, dict(zip(self.reward_func_names, unscored)), failures)
        if self._opt("nan_reward_action") == "drop" and torch.isnan(rewards_per_func).all(dim=1).all():
            raise ValueError(
                f"Every reward function ({', '.join(self.reward_func_names)}) returned None/NaN/inf for every "
                "completion of this batch, so there is nothing to learn from; fix the reward function(s) (a NaN "
                "usually comes from a failed parse or API call)."
            )
        # counts and fractions trl_stable's reward functions logged (e.g. arena/judge_calls), summed over processes
        # here; TRL's flush, which follows, averages the rest over processes as it always does
        flush_reward_metrics(self, select=has_own_reduction)
        if self._rollout is not None:
            self._rollout.rewards_per_func = rewards_per_func
            if self.dense_reward_funcs:
                # on this process's completions only: a broken answer must stop every process at once
                self._rollout.pending_dense = call_on_every_process(
                    self.accelerator,
                    self._start_dense_rewards,
                    *(inputs, prompts, completions, completion_ids_list, rewards_per_func),
                )
        return rewards_per_func

    # ------------------------------------------------------------------ batch building
    def _generate_and_score_completions(self, inputs):
        output, keep = self._generate_and_score_round(inputs)
        if self._opt("dynamic_sampling_max_refills") > 0 and self.model.training and keep is not None:
            output = self._refill_dynamic_sampling(output, keep, len(inputs))
        if self._opt("use_decoupled_loss"):
            self._apply_decoupled_loss(output)
        log_generation_mismatch(self, output)  # no-op unless the batch carries sampler log-probs
        return output

    def _generate_and_score_round(self, inputs) -> tuple[dict[str, Any], torch.Tensor | None]:
        """One TRL generation + scoring round, post-processed; returns the batch and dynamic sampling's [B] keep."""
        record = self._rollout = RolloutRecord(inputs=inputs)  # TRL's hooks fill it, during this call only
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._rollout = None
        return self._postprocess_generation(output, record)

    def _postprocess_generation(
        self, output: dict[str, Any], record: RolloutRecord
    ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """trl_stable's steps on one round of TRL's batch (each a no-op while its option is off); returns the batch
        and, with dynamic sampling, the [B] mask of the rows it keeps."""
        self._attach_routing(output, record)
        rewards_per_func = record.rewards_per_func
        if rewards_per_func is None:  # a subclass or rollout path that bypassed _calculate_rewards
            return output, None
        num_generations = self.num_generations if train_mode(self) == "train" else self.num_generations_eval
        local = process_slice(self.accelerator, output["completion_ids"].size(0))
        group_ids = torch.arange(rewards_per_func.size(0), device=rewards_per_func.device) // num_generations
        unscorable = torch.isnan(rewards_per_func).all(dim=1)

        settings = self._advantage_settings()
        if settings is not None:
            advantages = self._compute_sequence_advantages(rewards_per_func, group_ids, settings)
            advantages = torch.nan_to_num(advantages, nan=0.0)
            output["advantages"] = advantages[local].to(output["advantages"].dtype)
            # TRL logged its own advantages for the completions table; show the ones that are trained on
            replace_logged_advantages(self, advantages.tolist())
        elif getattr(self.advantage_args(), "advantage_estimator", None) == "gdpo":
            self._log_per_reward_advantages(rewards_per_func, group_ids)

        drop = torch.zeros_like(unscorable)
        if self._opt("nan_reward_action") == "drop":
            count = int(unscorable.sum().item())
            if count:
                self._nan_dropped_total += count
                logger.warning(
                    f"{count} completion(s) got NaN/None from every reward function; they are dropped from the "
                    f"loss ({self._nan_dropped_total} so far)."
                )
                drop |= unscorable
            log_metric(self, "rewards/nan_dropped", float(count))
            log_metric(self, "rewards/nan_dropped_total", float(self._nan_dropped_total))
        keep = None
        if self._opt("dynamic_sampling"):
            zero_var = zero_variance_groups(weighted_reward_sum(rewards_per_func, self.reward_weights), group_ids)
            log_metric(
                self, "dynamic_sampling/frac_groups_dropped", zero_var.view(-1, num_generations)[:, 0].float().mean()
            )
            drop |= zero_var
            keep = ~zero_var[local]
            if zero_var.all():
                logger.warning("Dynamic sampling dropped every group of this batch (all rewards equal within groups).")
        if drop.any():  # decided on the gathered rewards, so every process takes this branch together
            self._apply_loss_mask(output, ~drop[local])
        if self.step_masker is not None:  # a config option, so every process takes this branch together
            self._apply_step_mask(output)

        if record.pending_dense is not None:
            # collected only now, after TRL's scoring round: prefetched critic requests had that long to answer
            record.dense_rewards = self._collect_dense_rewards(record.pending_dense)
        if record.dense_rewards is not None:
            output["advantages"] = self._add_dense_advantages(output, record.dense_rewards)
        return output, keep

    def _attach_routing(self, output: dict[str, Any], record: RolloutRecord) -> None:
        """Put the round's routing in the batch (``routed_experts``), where shuffling and splitting keep it aligned."""
        routing = record.routing
        if routing is None and record.sampled_routing is not None:  # R3 without a TRL old-logprob pass
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            routing = batch_routing(record.sampled_routing, attention_mask, output["prompt_ids"].shape[1])
        if routing is not None:
            output[ROUTED_EXPERTS_KEY] = routing

    # ------------------------------------------------------------------ loss masks
    def _apply_loss_mask(self, output: dict[str, Any], keep: torch.Tensor, renormalize: bool = True) -> None:
        """Remove samples ([B] keep) or tokens ([B, T] keep) from the loss through TRL's `tool_mask` (the attention
        mask is kept); with `renormalize` also from `num_items_in_batch` (a collective)."""
        mask = output["completion_mask"]
        if keep.dim() == 1:
            keep = keep.unsqueeze(1).expand_as(mask)
        keep = keep.to(device=mask.device, dtype=mask.dtype)
        tool_mask = output.get("tool_mask")
        output["tool_mask"] = keep if tool_mask is None else tool_mask * keep
        if renormalize:
            output["num_items_in_batch"] = num_items_in_batch(output, self.accelerator)

    def _apply_step_mask(self, output: dict[str, Any]) -> None:
        """Drop the tokens of invalid agent steps from the loss (`trl_stable.masking.CompletionStepMasker`)."""
        keep = self.step_masker.keep_mask(output["completion_ids"], output["completion_mask"], tokenizer_of(self))
        stats = step_mask_stats(self.step_masker.stats())  # each process logs the reasons it saw
        log_metrics(self, reduce_metrics(stats, self.accelerator, names_may_differ=True))
        self._apply_loss_mask(output, keep)

    # ------------------------------------------------------------------ checkpoints (`GRPOCheckpoints`)
    def _named_reward_funcs(self) -> list[tuple[str, Any]]:
        return [
            *zip(self.reward_func_names, self._reward_contract.originals),
            *zip(self.dense_reward_func_names, self.dense_reward_funcs),
        ]

    def _trainer_checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared, per-process) state for a checkpoint: the NaN-reward count (of the gathered batch, the same on
        every process) and this process's refill RNG (None until the first refill draws from it)."""
        refill = getattr(self, "_refill_generator", None)
        shared = {"nan_dropped_total": self._nan_dropped_total}
        return shared, {"refill_generator": None if refill is None else refill.get_state()}

    def _load_trainer_checkpoint_state(self, shared: dict[str, Any], per_process: dict[str, Any] | None) -> None:
        self._nan_dropped_total = int(shared["nan_dropped_total"])
        if per_process is not None and per_process["refill_generator"] is not None:
            generator = torch.Generator()
            generator.set_state(per_process["refill_generator"])
            self._refill_generator = generator  # `_refill_prompts` draws from it instead of seeding a new one

    # ------------------------------------------------------------------ the updates (routing point: update)
    def _compute_loss(self, model, inputs):
        routing = inputs.get(ROUTED_EXPERTS_KEY)
        with self.routing.update_pass(routing):
            loss = super()._compute_loss(model, inputs)
        if self.routing.active and routing is not None:
            self._log_routing("routing/")
        return loss
