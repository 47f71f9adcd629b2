"""The registry's second table: the TRL / transformers logic trl_stable mirrors or relies on ([`MIRRORED`]), and the
lines of TRL's log-prob pass the position-id wrapper relies on (docs/development.md, "TRL internals")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mirrored:
    """TRL / transformers logic trl_stable repeats (TRL offers no helper for it) or relies on; the contract test
    checks that every `snippets` line is still in `trl_member`'s source and, with `calls`, its exact calls.

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


# TRL / transformers logic trl_stable repeats (`_MIRRORS`) or relies on (`_RELIES_ON`), by the method that holds it:
# {trl_member: {ours: snippets}}; `_CALLS` lists every call of a method trl_stable repeats step by step.
_MIRRORS: dict[str, dict[str, tuple[str, ...]]] = {
    "trl.GRPOTrainer._calculate_rewards": {
        "trl_stable.trainers.grpo.trl_rewards.reward_kwargs": (
            'keys = [key for key in inputs[0] if key not in ["prompt", "completion", "completion_ids"]]',
            'reward_kwargs["trainer_state"] = self.state',
            'reward_kwargs["log_extra"] = self._log_completion_extra',
            'reward_kwargs["log_metric"] = self._log_metric',
            'reward_kwargs["environments"] = self.environments',
        ),
        "trl_stable.integration.reward_calls.call_reward_func": (
            "asyncio.run_coroutine_threadsafe(_run_async_funcs(), self.async_loop).result()",
        ),
        "trl_stable.trainers.grpo.trl_rewards.ContractCheckedRewards": (
            "zip(self.reward_funcs, self.reward_processing_classes, self.reward_func_names, strict=True)",
            "if isinstance(reward_func, nn.Module):",
            "elif is_async_callable(reward_func):",
            "prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs",
            "rewards_per_func = gather(rewards_per_func)",
        ),
    },
    "trl.GRPOTrainer._generate_and_score_completions": {
        "trl_stable.trainers.grpo.trl_logs.flush_reward_logs": (
            "for column in sorted(set(gather_object(list(self._pending_extra_logs)))):",
            "values = self._pending_extra_logs.get(column, [None] * len(prompts))",
            'self._logs["extra"][column].extend(gather_object(values))',
        ),
        # TRL's mean over every call, kept for the metrics trl_stable has no other reduction for
        "trl_stable.trainers.grpo.trl_logs.flush_reward_metrics": (
            "for name in sorted(set(gather_object(list(self._pending_metrics)))):",
            "local_stats = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=device)",
            "total, count = self.accelerator.gather(local_stats).view(-1, 2).sum(dim=0).tolist()",
            "self._metrics[mode][name].append(total / count)",
        ),
        "trl_stable.rewards.dense.weighted_reward_sum": (
            "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
            "rewards[unscorable_mask] = torch.nan",
        ),
        "trl_stable.trainers.grpo.trl_batch.loss_mask": (
            "loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask",
        ),
        # recomputed wherever trl_stable removes tokens from the loss (`_apply_loss_mask`) or rebuilds the batch
        # (dynamic sampling's refill), so TRL's normaliser counts the tokens that are trained on
        "trl_stable.trainers.grpo.trl_batch.num_items_in_batch": (
            "num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()",
        ),
        "trl_stable.trainers.grpo.trl_batch.process_slice": (
            "process_slice = slice(",
            "self.accelerator.process_index * len(prompts),",
            "(self.accelerator.process_index + 1) * len(prompts),",
            "advantages = advantages[process_slice]",
        ),
        # a group is `num_generations` consecutive rows of the gathered batch (in eval: `num_generations_eval`), and an
        # unscorable row's advantage is 0
        "trl_stable.trainers.grpo.GRPOTrainer._postprocess_generation": (
            'num_generations = self.num_generations if mode == "train" else self.num_generations_eval',
            "mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)",
            "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)",
            "advantages = torch.nan_to_num(advantages, nan=0.0)",
        ),
        "trl_stable.trainers.grpo.trl_logs.train_mode": ('mode = "train" if self.model.training else "eval"',),
        # the proximal pass is TRL's old-logprob pass, run by trl_stable when TRL skipped it
        "trl_stable.trainers.grpo.decoupled_loss.DecoupledLoss._compute_proximal_logps": (
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
        # the exact table is checked against TRL's `pad` calls by the contract test
        "trl_stable.trainers.grpo.trl_batch.concat_rows": (
            "padding_value=self._tokenizer.pad_token_id,",
            'padding_side="left",',
            'padding_side="right",',
        ),
        # each reward's own group z-score, logged as GDPO's per-reward advantage
        "trl_stable.trainers.grpo.advantages.SequenceAdvantages._log_per_reward_advantages": (
            "mean_k = torch.nanmean(grouped, dim=1, keepdim=True)",
            "std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)",
            "reward_k = (grouped - mean_k) / (std_k + 1e-4)",
        ),
    },
    "transformers.Trainer._save_checkpoint": {
        # the steps of transformers' `_save_checkpoint` in `_write_checkpoint_files`; its push and rotation in
        # `_save_checkpoint`, once the folder is marked complete
        "trl_stable.trainers.checkpoints.MarkedCheckpoints._write_checkpoint_files": (
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
    },
    "trl.GRPOTrainer._save_checkpoint": {
        "trl_stable.trainers.grpo.checkpoints.GRPOCheckpoints._write_checkpoint_files": (
            "if self.args.hub_model_id is None:",
            "model_name = Path(self.args.output_dir).name",
            'model_name = self.args.hub_model_id.split("/")[-1]',
            "self.create_model_card(model_name=model_name)",
            "super()._save_checkpoint(model, trial)",
            "if self.use_adaptive_entropy and self.args.should_save:",
            'with open(os.path.join(output_dir, "entropy_ctrl_state.json"), "w") as f:',
            'json.dump({"entropy_coef": self.entropy_coef, "last_world_entropy": self._last_world_entropy}, f)',
        ),
    },
    # PPOTrainer runs its own loop on Trainer's machinery: where it repeats a step of Trainer's loop or relies on
    # what a Trainer method reads
    "transformers.Trainer._maybe_log_save_evaluate": {
        "trl_stable.trainers.ppo.loop_events.LoopEvents._maybe_evaluate_and_save": (
            "if self.control.should_evaluate:",
            "metrics = self._evaluate(trial, ignore_keys_for_eval)",
            "is_new_best_metric = self._determine_best_metric(metrics=metrics, trial=trial)",
            "if self.args.save_strategy == SaveStrategy.BEST:",
            "self.control.should_save = is_new_best_metric",
            "self._save_checkpoint(model, trial)",
            "self.control = self.callback_handler.on_save(self.args, self.state, self.control)",
        ),
    },
    "transformers.Trainer._run_epoch": {
        "trl_stable.trainers.ppo.ppo_trainer.PPOTrainer.update": (
            "grad_norm = self._clip_grad_norm(model)",
            "self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)",
            "self.optimizer.step()",
            "self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)",
            "if not self.accelerator.optimizer_step_was_skipped:",
            "if not isinstance(self.lr_scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)):",
            "self.lr_scheduler.step()",
            "self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)",
            "self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)",
            'self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)',
        ),
    },
    "transformers.Trainer._get_dataloader": {
        "trl_stable.trainers.ppo.prompts.PromptData.get_train_dataloader": (
            '"num_workers": self.args.dataloader_num_workers,',
            '"pin_memory": self.args.dataloader_pin_memory,',
            '"persistent_workers": self.args.dataloader_persistent_workers,',
            '"multiprocessing_context": self.args.dataloader_multiprocessing_context,',
            '"prefetch_factor": self.args.dataloader_prefetch_factor,',
            '"in_order": self.args.dataloader_in_order,',
            "seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index",
            "dataloader = self.accelerator.prepare(DataLoader(dataset, **dataloader_params))",
        ),
    },
    "transformers.Trainer._init_training_state": {
        "trl_stable.trainers.ppo.loop_events.LoopEvents._begin": (
            "self.state.compute_steps(self.args, max_steps)",
            "self.state.init_training_references(self, max_steps, num_train_epochs, trial)",
        ),
    },
    "transformers.Trainer._prepare_for_training": {
        "trl_stable.trainers.ppo.saving.SaveAndResume._load_checkpoint": (
            "deepspeed_load_checkpoint(",
            "self._load_optimizer_and_scheduler(resume_from_checkpoint)",
            "self._load_scaler(resume_from_checkpoint)",
        ),
    },
    "transformers.Trainer.train": {
        "trl_stable.trainers.ppo.models.enable_activation_checkpointing": (
            'every_n_layers = gc_kwargs.pop("every_n_layers", 1)',
            'offload = gc_kwargs.pop("offload", False)',
            "self.model.activation_checkpointing_enable(",
        ),
    },
    "transformers.Trainer._save_rng_state": {
        "trl_stable.integration.hf_names.rng_state_file": (
            "if self.args.world_size <= 1:",
            'torch.save(rng_states, os.path.join(output_dir, "rng_state.pth"))',
            'torch.save(rng_states, os.path.join(output_dir, f"rng_state_{self.args.process_index}.pth"))',
        ),
    },
}
_RELIES_ON: dict[str, dict[str, tuple[str, ...]]] = {
    "transformers.Trainer._finalize_training": {
        "trl_stable.trainers.ppo.ppo_trainer.PPOTrainer.train": (
            "self._total_loss_scalar += self._tr_loss.item()",
            "num_steps_trained = self.state.global_step - self._initial_global_step",
            "train_loss = self._total_loss_scalar / max(num_steps_trained, 0.001)  # Avoid ZeroDivisionError",
            "if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:",
            "self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)",
        ),
    },
    "transformers.trainer_jit_checkpoint.CheckpointManager.execute_jit_checkpoint": {
        "trl_stable.trainers.checkpoints.JIT_SENTINEL_FILE": (
            'sentinel_file = os.path.join(output_dir, checkpoint_folder, "checkpoint-is-incomplete.txt")',
            "self.trainer._save_checkpoint(self.trainer.model, trial=None)",
        ),
    },
    "transformers.Trainer._track_num_input_tokens": {
        "trl_stable.trainers.ppo.ppo_trainer.PPOTrainer.step": (
            'main_input_name = getattr(self.model, "main_input_name", "input_ids")',
            'if self.args.include_num_input_tokens_seen == "non_padding":',
            'if "attention_mask" in inputs:',
            'input_tokens = inputs["attention_mask"].sum()',
            "input_tokens = inputs[main_input_name].numel()",
        ),
    },
    "trl.GRPOTrainer._compute_loss": {
        "trl_stable.trainers.grpo.trl_batch.loss_mask": (
            'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]',
        ),
        "trl_stable.trainers.grpo.trl_batch.num_items_in_batch": (
            'elif self.loss_type in ["cispo", "dapo", "vespo"]:',
            'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes',
            "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
            "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)",
        ),
        # the behaviour weight and the token filter reach TRL's loss folded into (B, T) advantages
        "trl_stable.trainers.grpo.decoupled_loss.DecoupledLoss._apply_decoupled_loss": (
            "if advantages.dim() == 1:",
            "advantages = advantages.unsqueeze(1)",
        ),
        # the dense reward-to-go reaches TRL's loss as (B, T) advantages
        "trl_stable.trainers.grpo.GRPOTrainer._postprocess_generation": (
            "if advantages.dim() == 1:",
            "advantages = advantages.unsqueeze(1)",
        ),
    },
    "trl.GRPOTrainer._prepare_inputs": {
        # trl_stable's own batch-first key (``routed_experts``) is shuffled and split with the rest
        "trl_stable.trainers.grpo.GRPOTrainer._attach_routing": (
            "generation_batch = shuffle_sequence_dict(generation_batch)",
            "generation_batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)",
        ),
    },
    "trl.trainer.utils.shuffle_sequence_dict": {
        "trl_stable.trainers.grpo.GRPOTrainer._attach_routing": (
            "if isinstance(v, torch.Tensor) and v.ndim >= 1:",
            "return v[permutation]",
        ),
    },
    "trl.trainer.utils.split_tensor_dict": {
        "trl_stable.trainers.grpo.GRPOTrainer._attach_routing": (
            "chunk_dict[key] = tensor[i * chunk_size : (i + 1) * chunk_size]",
        ),
    },
    "trl.GRPOTrainer._generate_and_score_completions": {
        # TRL's last write to the completions table's advantage column in the call is all of this call's
        # advantages (gathered), so the last N entries are this call's; the contract test checks there is one
        "trl_stable.trainers.grpo.trl_logs.replace_logged_advantages": (
            'self._logs["advantages"].extend(all_process_advantages.tolist())',
        ),
        # the optional keys trl_stable reads, and where TRL puts each in the batch
        "trl_stable.integration.trl_members.GRPO_OPTIONAL_BATCH_KEYS": (
            'output["old_per_token_logps"] = old_per_token_logps',
            'output["sampling_per_token_logps"] = sampling_per_token_logps',
            'output["ref_per_token_logps"] = ref_per_token_logps',
            'output["tool_mask"] = tool_mask',
            'output["importance_sampling_ratio"] = vllm_importance_sampling_ratio',
        ),
        # the reference pass: `ref_model`, or the policy with TRL's "ref" adapter / its adapters disabled
        "trl_stable.trainers.grpo.forward_passes.is_reference_pass": (
            "if self.ref_model is not None:",
            "ref_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(",
            'with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):',
        ),
        # scoring right after generation gives TRL's later call the same arguments; not when a rollout_func's
        # extra fields, merged into the inputs only after `_generate`, could reach the reward functions
        "trl_stable.trainers.grpo.GRPOTrainer._scores_early": (
            "if extra_fields:",
            "inp[key] = values[i]",
            "rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids_list)",
        ),
        "trl_stable.trainers.grpo.dense_rewards.DenseRewards._split_dense_reward_funcs": (
            "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
            "for i, reward_func_name in enumerate(self.reward_func_names):",
        ),
    },
    "trl.GRPOTrainer._generate": {
        # the HF sampler's recorded log-probs, returned as `_generate_single_turn`'s logprobs, become TRL's
        # `sampling_per_token_logps`
        "trl_stable.trainers.grpo.GRPOTrainer._generate_single_turn": (
            "completion_ids, logprobs = self._generate_single_turn(",
            "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images",
        ),
    },
    "trl.GRPOTrainer._calculate_rewards": {
        "trl_stable.trainers.grpo.dense_rewards.DenseRewards._split_dense_reward_funcs": (
            "rewards_per_func = torch.zeros(len(prompts), len(self.reward_funcs), device=device)",
        ),
    },
}
_CALLS: dict[str, tuple[str, ...]] = {
    "transformers.Trainer._save_checkpoint": (
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
    "trl.GRPOTrainer._save_checkpoint": (
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
}

MIRRORED: tuple[Mirrored, ...] = tuple(
    Mirrored(ours, trl_member, snippets, relation, _CALLS.get(trl_member, ()))
    for relation, table in (("mirrors", _MIRRORS), ("relies on", _RELIES_ON))
    for trl_member, sides in table.items()
    for ours, snippets in sides.items()
)

# The lines of `trl.GRPOTrainer._get_per_token_logps_and_entropies` that `with_mask_position_ids` relies on: the
# model is called with the chunk's ids and mask as keywords; the contract test also checks that TRL sets no
# `position_ids` of its own.
LOGPS_FORWARD_SNIPPETS = (
    'model_inputs = {"input_ids": input_ids_batch, "attention_mask": attention_mask_batch}',
    "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)",
)
