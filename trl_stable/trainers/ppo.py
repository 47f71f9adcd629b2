"""PPO with a value model and per-token (dense) rewards, written on transformers, accelerate and peft.

TRL 1.16 ships no PPO; this is trl_stable's own. Two ways to drive it:

- `trainer.train()`: over a prompt dataset, with reward functions (sequence-level reward models / callables and
  dense callables marked with `trl_stable.rewards.dense_reward`).
- the step API of the RELC-era scripts: ``responses = trainer.generate(queries)``, compute rewards, then
  ``stats = trainer.step(queries, responses, token_rewards)``.

One PPO step: rollout (`_old_logprob_pass`: policy/reference log-probs and values under no grad), per-token
rewards (-kl_coef * KL + dense + score on the last token), GAE (`trl_stable.core.compute_gae`), then `ppo_epochs`
passes over shuffled mini-batches (`_update_forward`) with the clipped policy and value losses.
"""

from __future__ import annotations

import copy
import math
import os
import random
import re
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    TrainerCallback,
    get_scheduler,
)
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    ExportableState,
    ProgressCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_utils import TrainOutput

from trl_stable.core.gae import compute_gae, compute_turn_gae, relative_position_lambda, vapo_lambda
from trl_stable.core.masks import filter_behaviour_weight
from trl_stable.core.policy_loss import decoupled_ppo_loss, ppo_clip_term, pre_mask_token_mean
from trl_stable.masking.rl import CompletionStepMasker
from trl_stable.moe.trainer_hooks import with_routing_replay
from trl_stable.monitoring.integration import attach_health_monitor
from trl_stable.monitoring.mismatch import mismatch_stats
from trl_stable.rewards.dense import is_dense_reward, validate_dense_rewards
from trl_stable.trainers.ppo_config import PPOConfig
from trl_stable.trainers.value_head import ValueHead

__all__ = ["AdaptiveKLController", "FixedKLController", "LengthSampler", "PPOConfig", "PPOTrainer", "RunningMoments"]

_STATE_FILE = "ppo_state.pt"
_TRAINABLE_FILE = "trainable_weights.pt"


class LengthSampler:
    """Draw a generation length uniformly from [min_value, max_value] (inclusive), as RELC's scripts did."""

    def __init__(self, min_value: int, max_value: int, generator: torch.Generator | None = None):
        if not 0 <= min_value <= max_value:
            raise ValueError(f"LengthSampler needs 0 <= min_value <= max_value, got {min_value}, {max_value}.")
        self.min_value, self.max_value, self.generator = min_value, max_value, generator

    def __call__(self) -> int:
        return int(torch.randint(self.min_value, self.max_value + 1, (1,), generator=self.generator).item())


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593):

    e = clip(KL / target - 1, -0.2, 0.2),    kl_coef <- kl_coef * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class RunningMoments:
    """Running mean and (unbiased) std of a stream of scores, merged batch by batch (Chan et al. parallel update):

        delta = mean_b - mean,  n' = n + n_b,  mean' = mean + delta n_b / n',
        M2' = M2 + M2_b + delta^2 n n_b / n',  std' = sqrt(M2' / (n' - 1))

    The std stays 1 until two scores have been seen (a zero std would blow the first scaled score up).
    """

    def __init__(self):
        self.mean, self.std, self.var, self.count = 0.0, 1.0, 0.0, 0.0

    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Merge `xs` (1-D) into the statistics; returns the batch mean and std."""
        xs = xs.double()
        xs_count = xs.numel()
        if xs_count == 0:
            return float("nan"), float("nan")
        xs_mean = xs.mean().item()
        xs_var = xs.var(unbiased=False).item() if xs_count > 1 else 0.0
        delta = xs_mean - self.mean
        total = self.count + xs_count
        m2 = self.var * self.count + xs_var * xs_count + delta**2 * self.count * xs_count / total
        self.mean += delta * xs_count / total
        self.var = m2 / total
        self.std = math.sqrt(m2 / (total - 1)) if total > 1 else 1.0
        self.count = total
        return xs_mean, math.sqrt(xs_var * xs_count / max(xs_count - 1, 1))

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.std, self.var, self.count = state["mean"], state["std"], state["var"], state["count"]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * masked_mean(max((V - R)^2, (clip(V, V_old +- clip) - R)^2)); returns (loss, clip fraction)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss1, loss2 = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * _masked_mean(torch.max(loss1, loss2), mask), _masked_mean((loss2 > loss1).float(), mask)


def _clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    behaviour_weight: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token mean of the clipped PPO term (`core.ppo_clip_term`), or with a behaviour weight the decoupled loss
    (`core.decoupled_ppo_loss`: w * PPO term, IcePop/KPop `keep` filter, pre-filter token count); returns
    (loss, clip fraction, ratio)."""
    if behaviour_weight is None:
        loss = pre_mask_token_mean(ppo_clip_term(logprobs, old_logprobs, advantages, eps_low=clip), mask)
    else:
        loss = decoupled_ppo_loss(logprobs, old_logprobs, behaviour_weight, advantages, mask, keep, eps_low=clip)
    ratio = torch.exp(logprobs - old_logprobs).detach()
    # the clip is active (zero gradient) where the ratio left the band in the direction the advantage pushes
    clipped = ((ratio - 1.0).abs() > clip) & ((advantages * (ratio - 1.0)) > 0)
    return loss, _masked_mean(clipped.float(), mask), ratio


def _logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = F.log_softmax(logits.float(), dim=-1)
    token_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _backbone(model: nn.Module) -> nn.Module:
    """The transformer body (no LM/classification head) of a (possibly PEFT-wrapped) HF model."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, "base_model", inner)


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if size is None:
        raise ValueError(f"Cannot read the hidden size of {type(model).__name__}: its config has no hidden_size.")
    return int(size)


def _layer_index(name: str) -> int | None:
    match = re.search(r"\.(?:h|layers|layer|blocks)\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _create_reference_model(policy: PreTrainedModel, num_shared_layers: int | None) -> PreTrainedModel:
    """A frozen copy of `policy`. With `num_shared_layers`, the embeddings and the first layers are the policy's own
    parameters (frozen in the policy too) instead of copies, as RELC's `create_reference_model` did."""
    ref = copy.deepcopy(policy)
    for param in ref.parameters():
        param.requires_grad_(False)
    if num_shared_layers is None:
        return ref.eval()
    names = [name for name, _ in policy.named_parameters()]
    layer_ids = [_layer_index(n) for n in names]
    num_layers = 1 + max((i for i in layer_ids if i is not None), default=-1)
    if num_shared_layers > num_layers:
        raise ValueError(f"num_shared_layers={num_shared_layers} but the policy has only {num_layers} layers.")
    first_layer = next((k for k, i in enumerate(layer_ids) if i is not None), len(names))
    shared = {
        n
        for k, (n, i) in enumerate(zip(names, layer_ids))
        if (i is None and k < first_layer) or (i is not None and i < num_shared_layers)
    }
    policy_params = dict(policy.named_parameters())
    for name in shared:
        param = policy_params[name]
        param.requires_grad_(False)
        module_name, _, attr = name.rpartition(".")
        setattr(ref.get_submodule(module_name), attr, param)
    return ref.eval()


class _PolicyAndValue(nn.Module):
    """The trainable modules in one `nn.Module`, so that DDP (accelerate) wraps and synchronises them together.

    forward returns the logits and values of the last `logits_to_keep` positions.
    """

    def __init__(self, policy: nn.Module, value_head: ValueHead, value_backbone: nn.Module | None):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.value_backbone = value_backbone

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int):
        captured: dict[str, torch.Tensor] = {}
        handle = None
        if self.value_backbone is None:

            def grab(module, args, output):
                captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

            handle = _backbone(self.policy).register_forward_hook(grab)
        try:
            out = self.policy(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=logits_to_keep,
                use_cache=False,
            )
        finally:
            if handle is not None:
                handle.remove()
        if self.value_backbone is None:
            hidden = captured["hidden"]
        else:
            hidden = self.value_backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        values = self.value_head(hidden[:, -logits_to_keep:])
        return out.logits[:, -logits_to_keep:], values


class PPOTrainer:
    """PPO trainer with a value model, a reference model and per-token rewards.

    Args:
        model: The policy: a causal LM, or its name/path (loaded with `args.model_init_kwargs`). None: use
            `args.model_name`.
        reward_funcs: Reward function(s) for `train()`: a sequence-classification model (nn.Module) or its name,
            a callable ``f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]`` (TRL's
            reward-function signature; None = "not applicable", counts 0; NaN drops the sample), or a dense
            callable marked with `trl_stable.rewards.dense_reward` that returns per-token rewards aligned to the
            completion tokens (called after the sequence-level ones with ``env_rewards=``, the weighted sum of
            sequence rewards per sample). Several are combined with `args.reward_weights`. Not needed for the step
            API.
        args: A `PPOConfig`. None: defaults with `output_dir="ppo_output"`.
        train_dataset: Prompts for `train()`: a "prompt" column (text or chat messages) or an "input_ids" column
            (token ids). Other columns are passed to the reward functions as keyword lists.
        processing_class: The tokenizer (left padding is used for generation). None: loaded from the model name.
        ref_model: The frozen reference model. None: with `peft_config` (or a PEFT policy) the policy with its
            adapter disabled; else a frozen copy of the policy sharing its first `args.num_shared_layers` layers.
        value_model: None: a scalar value head on the policy's last hidden state (shared backbone, RELC style).
            A `ValueHead`: that head on the policy backbone (its hidden size must match). A `PreTrainedModel`
            (causal LM, base model or 1-label sequence classifier): a separate critic; a 1-output `score` head is
            reused, otherwise a new value head is put on its backbone.
        reward_processing_classes: Tokenizers of the reward models (same order as `reward_funcs`; None entries:
            the policy tokenizer when the vocabularies agree, else loaded from the reward model's name).
        callbacks: `transformers.TrainerCallback`s; they get on_train_begin/on_step_end/on_log/on_save/on_train_end
            with a `TrainerState` whose `log_history` holds every logged dict.
        optimizers: (optimizer, lr_scheduler); None entries are built from `args` (AdamW over trainable params).
        peft_config: A `peft.PeftConfig`: train a LoRA adapter (+ the value head) instead of the full policy.
        lam_fn: A callable ``lam_fn(lengths: LongTensor[B]) -> Tensor[B]`` giving a GAE lambda per sequence from
            its effective length (the number of action tokens: response tokens minus tool-output tokens, 0 for a
            dropped sample); overrides `args.lam` / `args.lam_schedule`.

    Example:
        ```python
        trainer = PPOTrainer(model, args=PPOConfig(output_dir="out", batch_size=8, mini_batch_size=8))
        responses = trainer.generate(queries, return_prompt=False)
        token_rewards = [[0.0] * (len(r) - 1) + [score] for r, score in zip(responses, scores)]
        stats = trainer.step(queries, responses, token_rewards)
        ```
    """

    def __init__(
        self,
        model: str | nn.Module | None = None,
        reward_funcs: Any | Sequence[Any] | None = None,
        args: PPOConfig | None = None,
        train_dataset: Any | None = None,
        processing_class: Any | None = None,
        ref_model: nn.Module | None = None,
        value_model: nn.Module | None = None,
        reward_processing_classes: Any | Sequence[Any] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any | None] = (None, None),
        peft_config: Any | None = None,
        lam_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if args is None:
            args = PPOConfig(output_dir="ppo_output")
        self.args = args
        # None (not "no") lets `accelerate launch --mixed_precision bf16` choose when the config does not.
        mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else None
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=bool(getattr(args, "use_cpu", False)))
        set_seed(args.seed)  # identical value-head init and model copies on every process

        # --- policy ---
        if model is None:
            model = args.model_name
        if model is None:
            raise ValueError("Pass `model` (a causal LM or its name) or set `PPOConfig.model_name`.")
        model_id = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        if isinstance(model, str):
            model = self._load_policy(model, peft_config)
        elif args.load_in_4bit or args.load_in_8bit:
            raise ValueError("load_in_4bit/load_in_8bit apply to a model given by name; pass `model` as a str.")
        if processing_class is None:
            if not model_id:
                raise ValueError("Pass `processing_class` (a tokenizer): it cannot be loaded for an unnamed model.")
            processing_class = AutoTokenizer.from_pretrained(model_id)
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        self.processing_class = processing_class
        self.pad_token_id = processing_class.pad_token_id
        self.eos_token_id = processing_class.eos_token_id
        # Invalid agent steps leave the policy loss (assign `trainer.step_masker` for environment-reported steps).
        self.step_masker = (
            CompletionStepMasker(tools=args.step_mask_tools) if getattr(args, "step_loss_mask", False) else None
        )

        is_peft = hasattr(model, "peft_config") and hasattr(model, "disable_adapter")
        if peft_config is not None and not is_peft:
            from peft import get_peft_model, prepare_model_for_kbit_training

            if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
                model = prepare_model_for_kbit_training(
                    model, use_gradient_checkpointing=bool(args.gradient_checkpointing)
                )
            model = get_peft_model(model, peft_config)
            is_peft = True
        self.is_peft = is_peft
        if args.disable_dropout:
            _disable_dropout(model)

        # --- reference model ---
        if ref_model is not None:
            self.ref_model = ref_model.eval().requires_grad_(False)
        elif is_peft:
            if args.num_shared_layers is not None:
                warnings.warn("num_shared_layers is ignored with PEFT: the reference is the adapter-free policy.")
            self.ref_model = None  # the policy with its adapter disabled
        else:
            self.ref_model = _create_reference_model(model, args.num_shared_layers)
        if self.ref_model is not None:
            _disable_dropout(self.ref_model)

        # --- value model ---
        value_backbone = None
        if value_model is None:
            value_head = ValueHead(_hidden_size(model))
        elif isinstance(value_model, ValueHead):
            if value_model.hidden_size != _hidden_size(model):
                raise ValueError(
                    f"The value head reads hidden states of size {value_model.hidden_size} but the policy's hidden "
                    f"size is {_hidden_size(model)}; build it as ValueHead({_hidden_size(model)})."
                )
            value_head = value_model
        elif isinstance(value_model, nn.Module):
            value_backbone = _backbone(value_model)
            score = getattr(value_model, "score", None)
            hidden = _hidden_size(value_model)
            if isinstance(score, nn.Linear) and score.out_features == 1:
                if score.in_features != hidden:
                    raise ValueError(
                        f"The value model's score head reads size {score.in_features} but its hidden size is "
                        f"{hidden}; fix the value model's config."
                    )
                value_head = ValueHead(hidden)
                value_head.summary = score
            else:
                value_head = ValueHead(hidden)
            if args.disable_dropout:
                _disable_dropout(value_backbone)
        else:
            raise ValueError("value_model must be None, a ValueHead or a transformers PreTrainedModel.")
        if args.gradient_checkpointing:
            kwargs = args.gradient_checkpointing_kwargs or {"use_reentrant": False}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if is_peft and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
            if value_backbone is not None and hasattr(value_backbone, "gradient_checkpointing_enable"):
                value_backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            # accelerate does not move quantised (device-mapped) models: put the head where the policy lives
            value_head.to(next(model.parameters()).device)
        self.model = model
        wrapper = _PolicyAndValue(model, value_head, value_backbone)

        # --- rewards ---
        self.reward_funcs, self.reward_func_names, self.reward_processing_classes = self._setup_rewards(
            reward_funcs, reward_processing_classes
        )
        weights = args.reward_weights
        if weights is not None and len(weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(weights)} entries for {len(self.reward_funcs)} reward functions; "
                "give one weight per reward function."
            )
        self.reward_weights = [1.0] * len(self.reward_funcs) if weights is None else [float(w) for w in weights]

        # --- optimisation ---
        optimizer, scheduler = optimizers
        if optimizer is None:
            params = [p for p in wrapper.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(
                params,
                lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                weight_decay=args.weight_decay,
            )
        self.optimizer = optimizer
        self.lr_scheduler = scheduler
        self.model_wrapped, self.optimizer = self.accelerator.prepare(wrapper, self.optimizer)
        if self.ref_model is not None:
            self.ref_model = self.ref_model.to(self.accelerator.device)
        for func in self.reward_funcs:
            if isinstance(func, nn.Module):
                func.to(self.accelerator.device).eval().requires_grad_(False)

        self.kl_ctl = (
            AdaptiveKLController(args.init_kl_coef, args.target, args.horizon)
            if args.adap_kl_ctrl
            else FixedKLController(args.init_kl_coef)
        )
        self.running = RunningMoments()
        self.lam_fn = lam_fn
        self.train_dataset = train_dataset
        self.current_device = self.accelerator.device  # old TRL's attribute, read by RELC-era scripts
        # per-process streams: mini-batch shuffling, and sampling in generate (seeded per rank below)
        self._shuffle_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        set_seed(args.seed, device_specific=True)

        # --- state and callbacks ---
        self.state = TrainerState(
            is_local_process_zero=self.accelerator.is_local_main_process,
            is_world_process_zero=self.accelerator.is_main_process,
            stateful_callbacks=[],
        )
        self.control = TrainerControl()
        default = [DefaultFlowCallback] + get_reporting_integration_callbacks(args.report_to)
        if not args.disable_tqdm:
            default.append(ProgressCallback)
        self.callback_handler = CallbackHandler(
            default + list(callbacks or []), self.model, self.processing_class, self.optimizer, self.lr_scheduler
        )
        self.health_monitor = attach_health_monitor(self)  # reads the logs only
        self._train_begun = False
        self._start_time = None

    # ------------------------------------------------------------------ setup helpers
    def _load_policy(self, name: str, peft_config: Any | None) -> PreTrainedModel:
        args = self.args
        kwargs = dict(args.model_init_kwargs or {})
        if args.load_in_4bit or args.load_in_8bit:
            import importlib.util

            if importlib.util.find_spec("bitsandbytes") is None or not torch.cuda.is_available():
                raise ValueError(
                    "load_in_4bit/load_in_8bit need bitsandbytes and a CUDA GPU; install bitsandbytes "
                    "(pip install 'trl_stable[quantization]') or turn the option off."
                )
            if peft_config is None:
                raise ValueError("A quantised policy can only be trained through an adapter: pass `peft_config`.")
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=args.load_in_4bit,
                load_in_8bit=args.load_in_8bit,
                bnb_4bit_compute_dtype=torch.bfloat16 if args.bf16 else torch.float16,
                bnb_4bit_quant_type="nf4",
            )
            kwargs.setdefault("device_map", {"": self.accelerator.local_process_index})
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)

    def _setup_rewards(self, reward_funcs, reward_processing_classes):
        if reward_funcs is None:
            return [], [], []
        if not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        funcs, names = [], []
        for func in reward_funcs:
            if isinstance(func, str):
                func = AutoModelForSequenceClassification.from_pretrained(func, num_labels=1)
            if isinstance(func, nn.Module):
                names.append(getattr(getattr(func, "config", None), "_name_or_path", "") or type(func).__name__)
            elif callable(func):
                names.append(getattr(func, "__name__", type(func).__name__))
            else:
                raise ValueError(f"A reward function must be a callable, an nn.Module or a model name; got {func!r}.")
            funcs.append(func)
        if reward_processing_classes is None:
            reward_processing_classes = [None] * len(funcs)
        elif not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]
        if len(reward_processing_classes) != len(funcs):
            raise ValueError("reward_processing_classes must have one entry per reward function.")
        classes = []
        for func, proc in zip(funcs, reward_processing_classes):
            if isinstance(func, nn.Module) and proc is None:
                vocab = getattr(getattr(func, "config", None), "vocab_size", None)
                name = getattr(getattr(func, "config", None), "_name_or_path", "")
                if vocab == len(self.processing_class) or not name:
                    proc = self.processing_class
                else:
                    proc = AutoTokenizer.from_pretrained(name)
                if proc.pad_token_id is None:
                    proc.pad_token = proc.eos_token
            classes.append(proc)
        return funcs, names, classes

    def _unwrapped(self) -> _PolicyAndValue:
        return self.accelerator.unwrap_model(self.model_wrapped)

    # ------------------------------------------------------------------ callbacks and logging
    def add_callback(self, callback: TrainerCallback | type) -> None:
        """Add a `TrainerCallback` (class or instance)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type) -> TrainerCallback | None:
        """Remove a callback and return it."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type) -> None:
        """Remove a callback."""
        self.callback_handler.remove_callback(callback)

    def log(self, logs: dict[str, float]) -> None:
        """Record `logs` in `state.log_history` and send them to the callbacks (on_log), like `Trainer.log`."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def _begin(self, max_steps: int) -> None:
        self.state.max_steps = max_steps
        self.state.compute_steps(self.args, max(max_steps, 1))
        self._start_time = time.time()
        self.control = TrainerControl()  # flags left over from step()-API use must not trigger saves
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        self._train_begun = True

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        query_tensor: torch.Tensor | list[torch.Tensor],
        length_sampler: Callable[[], int] | None = None,
        return_prompt: bool = True,
        batch_size: int | None = None,
        **generation_kwargs: Any,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Sample responses from the policy.

        Args:
            query_tensor: One 1-D LongTensor of prompt ids, or a list of them (no padding).
            length_sampler: Called once per generation chunk for its `max_new_tokens` (e.g. `LengthSampler`).
                None: `args.min_new_tokens`/`args.max_new_tokens`.
            return_prompt: Prepend the query to each returned sequence (the old TRL default); RELC passes False.
            batch_size: Generate in chunks of this many queries (None: `args.generation_batch_size` or all).
            generation_kwargs: Override `generate` arguments (top_k, top_p, temperature, do_sample, ...).

        Returns:
            A list of 1-D LongTensors (or one tensor for one query): each response without padding, cut after its
            EOS (kept), on the trainer's device.
        """
        single = isinstance(query_tensor, torch.Tensor) and query_tensor.dim() == 1
        queries = [query_tensor] if single else list(query_tensor)
        if any(len(q) == 0 for q in queries):
            raise ValueError("Every query needs at least one token (e.g. a BOS token).")
        args = self.args
        if length_sampler is None and args.min_new_tokens is not None:
            length_sampler = LengthSampler(args.min_new_tokens, args.max_new_tokens)
        chunk = batch_size or args.generation_batch_size or len(queries)
        policy = self._unwrapped().policy
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
        if capture:
            kwargs.update(output_scores=True, return_dict_in_generate=True)
        outputs: list[torch.Tensor] = []
        sampler_logps: list[torch.Tensor] = []
        was_training = policy.training
        policy.eval()
        with torch.no_grad(), self.accelerator.autocast():
            for start in range(0, len(queries), chunk):
                batch = [q.to(self.accelerator.device).long() for q in queries[start : start + chunk]]
                if length_sampler is not None:
                    kwargs["max_new_tokens"] = max(1, int(length_sampler()))
                input_ids, attention_mask = self._left_pad(batch)
                generated = policy.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
                sequences = generated.sequences if capture else generated
                width = input_ids.shape[1]
                if capture:
                    # the sampler's distribution is the softmax of the processed scores (temperature, top-k/p)
                    step_scores = torch.stack(generated.scores, dim=1).float()
                    chosen = sequences[:, width:].unsqueeze(-1)
                    behav = step_scores.log_softmax(-1).gather(-1, chosen).squeeze(-1)
                for i, (q, seq) in enumerate(zip(batch, sequences)):
                    response = self._trim_response(seq[width:])
                    outputs.append(torch.cat([q, response]) if return_prompt else response)
                    if capture:
                        sampler_logps.append(behav[i, : len(response)])
        policy.train(was_training)
        # read by step() when it gets these very response tensors (see `step(sampler_logprobs=...)`)
        self.last_sampler_logprobs = (outputs, sampler_logps) if capture else None
        return outputs[0] if single else outputs

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

    # ------------------------------------------------------------------ rewards (train())
    def _compute_rewards(
        self, rows: list[dict], prompts: list[Any], queries: list[torch.Tensor], responses: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, list[list[float]] | None, dict[str, float]]:
        """Sequence scores (weighted sum, NaN marks a broken sample) and summed dense rewards of a batch."""
        tok = self.processing_class
        completion_ids = [r.tolist() for r in responses]
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "input_ids")}
        n = len(responses)
        metrics: dict[str, float] = {}
        seq = [
            (f, w, name, proc)
            for f, w, name, proc in zip(
                self.reward_funcs, self.reward_weights, self.reward_func_names, self.reward_processing_classes
            )
            if not is_dense_reward(f)
        ]
        dense = [
            (f, w, name)
            for f, w, name in zip(self.reward_funcs, self.reward_weights, self.reward_func_names)
            if is_dense_reward(f)
        ]
        scores = None
        if seq:
            scores = torch.zeros(n, dtype=torch.float64)
            for func, weight, name, proc in seq:
                if isinstance(func, nn.Module):
                    values = self._score_with_model(func, proc, prompts, texts)
                else:
                    out = func(
                        prompts=prompts,
                        completions=completions,
                        completion_ids=completion_ids,
                        trainer_state=self.state,
                        **columns,
                    )
                    if len(out) != n:
                        raise ValueError(f"Reward function {name} returned {len(out)} scores for {n} completions.")
                    values = torch.tensor([0.0 if v is None else float(v) for v in out], dtype=torch.float64)
                finite = values[~torch.isnan(values)]
                metrics[f"rewards/{name}/mean"] = finite.mean().item() if len(finite) else float("nan")
                scores += weight * values
        dense_rows = None
        if dense:
            env = scores.tolist() if scores is not None else [0.0] * n
            dense_rows = [[0.0] * len(r) for r in responses]
            for func, weight, name in dense:
                out = func(
                    prompts=prompts,
                    completions=completions,
                    completion_ids=completion_ids,
                    env_rewards=env,
                    trainer_state=self.state,
                    log_metric=metrics.__setitem__,  # TRL's hook: e.g. the critic's critic/* per-step metrics
                    **columns,
                )
                rows_out = validate_dense_rewards(out, [len(r) for r in responses], name=name)
                metrics[f"rewards/{name}/mean"] = float(np.mean([sum(r) for r in rows_out]))
                for acc, row in zip(dense_rows, rows_out):
                    for t, v in enumerate(row):
                        acc[t] += weight * v
        return scores, dense_rows, metrics

    def _score_with_model(self, model: nn.Module, proc: Any, prompts: list[Any], texts: list[str]) -> torch.Tensor:
        conversational = isinstance(prompts[0], list)
        if conversational:
            full = [
                proc.apply_chat_template(p + [{"role": "assistant", "content": t}], tokenize=False)
                for p, t in zip(prompts, texts)
            ]
        else:
            full = [p + t for p, t in zip(prompts, texts)]
        side = proc.padding_side
        proc.padding_side = "right"
        try:
            # chat templates carry their special tokens; plain text gets the classifier's own ([CLS]/[SEP], ...)
            enc = proc(
                full, return_tensors="pt", padding=True, truncation=True, add_special_tokens=not conversational
            ).to(self.accelerator.device)
        finally:
            proc.padding_side = side
        with torch.no_grad():
            logits = model(**enc).logits
        return logits[:, 0].double().cpu()

    # ------------------------------------------------------------------ the PPO step
    def step(
        self,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        token_rewards: list[torch.Tensor | Sequence[float]] | None = None,
        scores: list[float] | torch.Tensor | None = None,
        turn_ids: list[torch.Tensor | Sequence[int]] | None = None,
        sampler_logprobs: list[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Run one PPO iteration on a batch of `args.batch_size` samples and return its statistics.

        Args:
            queries: Prompt ids, one 1-D LongTensor per sample.
            responses: Response ids (as returned by `generate(return_prompt=False)`), one per sample.
            token_rewards: Per-token rewards, one list/tensor per sample with exactly ``len(responses[i])`` entries
                (dense rewards; RELC puts the environment score on the last token itself). Optional if `scores`.
            scores: One sequence-level score per sample, added on the last response token after optional
                score scaling/normalisation/clipping (`use_score_scaling`, `use_score_norm`, `score_clip`).
            turn_ids: Multi-turn agents: per sample, one id per response token, the assistant turn index (0, 1, ...,
                non-decreasing) or -1 for tokens that are no action (tool output). Switches to turn-level GAE
                (`core.compute_turn_gae`: each turn one macro step, token KL added back per token); -1 tokens get
                no loss, and the score goes on the last assistant token.
            sampler_logprobs: With `use_decoupled_loss`, the sampler's log-prob of each response token. None: taken
                from the last `generate` call when `responses` are the tensors it returned.

        The per-token PPO reward is ``-kl_coef * KL + token_rewards + score@last``. Samples with a NaN (or infinite)
        reward are dropped with a warning (error when all are). The step is logged (`self.state.log_history`,
        callbacks).

        Returns:
            The step's statistics (objective/kl, loss/policy, loss/value, policy/clipfrac, ...).
        """
        return self._step(
            queries, responses, token_rewards, scores, turn_ids=turn_ids, sampler_logprobs=sampler_logprobs
        )

    def _check_step_inputs(self, queries, responses, token_rewards, scores, turn_ids=None, sampler_logprobs=None):
        n = len(queries)
        lengths = {"queries": n, "responses": len(responses)}
        if token_rewards is not None:
            lengths["token_rewards"] = len(token_rewards)
        if scores is not None:
            lengths["scores"] = len(scores)
        if turn_ids is not None:
            lengths["turn_ids"] = len(turn_ids)
        if sampler_logprobs is not None:
            lengths["sampler_logprobs"] = len(sampler_logprobs)
        if len(set(lengths.values())) != 1:
            raise ValueError(f"step() got lists of different lengths: {lengths}; pass one entry per sample.")
        if n != self.args.batch_size:
            raise ValueError(f"step() got {n} samples but args.batch_size is {self.args.batch_size}.")
        if token_rewards is None and scores is None:
            raise ValueError("step() needs `token_rewards`, `scores` or both.")
        for i, (q, r) in enumerate(zip(queries, responses)):
            if not isinstance(q, torch.Tensor) or not isinstance(r, torch.Tensor) or q.dim() != 1 or r.dim() != 1:
                raise ValueError(f"queries[{i}] and responses[{i}] must be 1-D LongTensors.")
            if len(q) == 0 or len(r) == 0:
                raise ValueError(f"Sample {i} has an empty query or response.")
            if token_rewards is not None and len(token_rewards[i]) != len(r):
                raise ValueError(
                    f"token_rewards[{i}] has {len(token_rewards[i])} entries but responses[{i}] has {len(r)} tokens; "
                    "give one reward per response token."
                )
            for name, rows in (("turn_ids", turn_ids), ("sampler_logprobs", sampler_logprobs)):
                if rows is not None and len(rows[i]) != len(r):
                    raise ValueError(
                        f"{name}[{i}] has {len(rows[i])} entries but responses[{i}] has {len(r)} tokens; "
                        "give one entry per response token."
                    )

    def _build_batch(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> dict[str, torch.Tensor]:
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
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_ids": input_ids[:, prompt_width:],
            "response_mask": response_mask,
            "response_lengths": torch.tensor([len(r) for r in responses], device=device),
        }

    def _forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, R, V] for the response tokens and values [B, R + 1] (V(s_t) for each token, then the value
        after the last position)."""
        resp_width = batch["response_ids"].shape[1]
        logits, values = model(
            batch["input_ids"], batch["attention_mask"], batch["position_ids"], logits_to_keep=resp_width + 1
        )
        return logits[:, :resp_width] / self.args.temperature, values

    def _ref_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        resp_width = batch["response_ids"].shape[1]
        kwargs = dict(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            logits_to_keep=resp_width + 1,
            use_cache=False,
        )
        if self.ref_model is not None:
            logits = self.ref_model(**kwargs).logits
        else:
            policy = self._unwrapped().policy
            with policy.disable_adapter():
                logits = policy(**kwargs).logits
        return logits[:, :resp_width] / self.args.temperature

    @torch.no_grad()
    def _old_logprob_pass(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rollout pass: log-probs and values of the rollout policy, reference log-probs and the token KL.

        Runs in chunks of `mini_batch_size`; adds `old_logprobs`, `ref_logprobs`, `values`, `bootstrap_values`,
        `kl` and `entropy` ([B, R] / [B]) to a copy of `batch`.
        """
        out: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("old_logprobs", "ref_logprobs", "values", "next_v", "kl", "entropy")
        }
        n = batch["input_ids"].shape[0]
        step = self.args.mini_batch_size
        for start in range(0, n, step):
            mb = {k: v[start : start + step] for k, v in batch.items()}
            with self.accelerator.autocast():
                logits, values = self._rollout_forward(mb)
                ref_logits = self._ref_logits(mb)
            logp, entropy = _logprobs_and_entropy(logits, mb["response_ids"])
            ref_logp, _ = _logprobs_and_entropy(ref_logits, mb["response_ids"])
            if self.args.kl_penalty == "full":
                full_p = F.log_softmax(logits.float(), -1)
                full_q = F.log_softmax(ref_logits.float(), -1)
                kl = (full_p.exp() * (full_p - full_q)).sum(-1)
            else:
                kl = self._kl_estimate(logp, ref_logp)
            lengths = mb["response_lengths"]
            out["old_logprobs"].append(logp)
            out["ref_logprobs"].append(ref_logp)
            out["values"].append(values[:, :-1].float())
            out["next_v"].append(values.float().gather(1, lengths.unsqueeze(1)).squeeze(1))
            out["kl"].append(kl)
            out["entropy"].append(entropy)
        result = dict(batch)
        for k, v in out.items():
            result[k] = torch.cat(v)
        result["bootstrap_values"] = result.pop("next_v")
        return result

    def _cached_sampler_logprobs(self, responses) -> list[torch.Tensor]:
        cached = getattr(self, "last_sampler_logprobs", None)
        if cached is not None:
            by_id = {id(r): lp for r, lp in zip(*cached)}
            if all(id(r) in by_id for r in responses):
                return [by_id[id(r)] for r in responses]
        raise ValueError(
            "use_decoupled_loss needs the sampler's log-probs: pass step(sampler_logprobs=...) or step the responses "
            "returned by the last trainer.generate(..., return_prompt=False) call."
        )

    def _behaviour_weights(self, batch: dict[str, torch.Tensor], sampler_logprobs, mask) -> dict[str, float]:
        """Behaviour weight w = exp(logp_rollout_pass - logp_sampler) and the IcePop/KPop keep mask, into `batch`."""
        args = self.args
        behav = torch.zeros_like(batch["old_logprobs"])
        for i, row in enumerate(sampler_logprobs):
            behav[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32).to(behav.device)
        prox = batch["old_logprobs"]
        lower, upper = args.filter_bounds
        weight, keep = filter_behaviour_weight(
            prox, behav, mask, args.token_filter, args.token_filter_action, lower, upper, args.token_filter_level
        )
        if keep is None:
            keep = mask.bool()
        batch["behaviour_weight"] = weight
        batch["behaviour_keep"] = keep
        # statistics over all processes' tokens: sums and counts are reduced, the maximum gathered
        maskb = mask.bool()
        seqs = maskb.any(1)
        sums = torch.stack(
            [
                torch.where(maskb, weight, torch.zeros_like(weight)).sum(),
                (maskb & ~keep).float().sum(),
                maskb.float().sum(),
                (seqs & ~(keep & maskb).any(1)).float().sum(),  # sequences with every token filtered out
                seqs.float().sum(),
            ]
        )
        sums = self.accelerator.reduce(sums, reduction="sum")
        weight_max = self.accelerator.gather(torch.where(maskb, weight, torch.ones_like(weight)).max().unsqueeze(0))
        tokens, num_seqs = sums[2].clamp(min=1), sums[4].clamp(min=1)
        return {
            "behaviour/weight_mean": (sums[0] / tokens).item() if sums[2] > 0 else 1.0,
            "behaviour/weight_max": weight_max.max().item(),
            "behaviour/masked_token_frac": (sums[1] / tokens).item(),
            "behaviour/masked_seq_frac": (sums[3] / num_seqs).item(),
            # |diff| mean/max, ratio spread and sequence perplexity ratio over all processes' tokens
            **mismatch_stats(behav, prox, mask, gather=self.accelerator.gather).as_metrics(),
        }

    def _rollout_forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy/value forward of the rollout pass (no grad; the proximal log-probs come from it). A hook that
        must see exactly this pass (e.g. routing replay recording) wraps this method; `_update_forward` is the
        update-side twin."""
        return self._forward(self.model_wrapped, batch)

    def _kl_estimate(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        diff = logp - ref_logp
        if self.args.kl_penalty == "kl":
            return diff
        if self.args.kl_penalty == "abs":
            return diff.abs()
        return 0.5 * diff.square()

    def _update_forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The update pass (with grad) on a micro-batch: current log-probs, entropy and values of its responses."""
        with self.accelerator.autocast():
            logits, values = self._forward(self.model_wrapped, batch)
        logprobs, entropy = _logprobs_and_entropy(logits, batch["response_ids"])
        return {"logprobs": logprobs, "entropy": entropy.detach(), "values": values[:, :-1].float()}

    def _global_moments(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked mean and sqrt(unbiased variance + 1e-8) of `x` over all processes' tokens."""
        stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()
        stats = self.accelerator.reduce(stats, reduction="sum")
        mean = stats[0] / stats[2].clamp(min=1)
        var = (stats[1] / stats[2].clamp(min=1) - mean**2).clamp(min=0)
        if stats[2] > 1:
            var = var * stats[2] / (stats[2] - 1)
        return mean.float(), torch.sqrt(var.float() + 1e-8)

    def _global_whiten(self, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        """(x - mean) / std over the batch's tokens (all processes); `shift_mean=False` adds the mean back."""
        mean, std = self._global_moments(x, mask)
        out = (x - mean) / std
        if not shift_mean:
            out = out + mean
        return out * mask

    def _lambda(self, lengths: torch.Tensor) -> float | torch.Tensor:
        if self.lam_fn is not None:
            return self.lam_fn(lengths)
        if self.args.lam_schedule == "vapo":
            return vapo_lambda(lengths, self.args.lam_alpha)
        if self.args.lam_schedule == "relative_position":
            return relative_position_lambda(lengths, self.args.lam_q)
        return self.args.lam

    def _scale_scores(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        args = self.args
        if args.use_score_scaling:
            all_scores = self.accelerator.gather(scores.to(self.accelerator.device).float())
            all_valid = self.accelerator.gather(valid.to(self.accelerator.device))
            if bool(all_valid.any()):
                self.running.update(all_scores[all_valid.bool()].cpu())
            # A constant score stream has std 0: scaling it would multiply scores by ~1e8, so leave it unscaled.
            factor = self.running.std + 1e-8 if self.running.std > 1e-6 else 1.0
            scores = (scores - self.running.mean) / factor if args.use_score_norm else scores / factor
        if args.score_clip is not None:
            scores = scores.clamp(-args.score_clip, args.score_clip)
        return scores

    def _step(
        self,
        queries,
        responses,
        token_rewards=None,
        scores=None,
        extra_logs=None,
        turn_ids=None,
        sampler_logprobs=None,
    ) -> dict[str, float]:
        if self.args.use_decoupled_loss and sampler_logprobs is None:
            sampler_logprobs = self._cached_sampler_logprobs(responses)
        self._check_step_inputs(queries, responses, token_rewards, scores, turn_ids, sampler_logprobs)
        args = self.args
        if not self._train_begun:
            self._begin(max_steps=max(args.max_steps, 0))
        step_start = time.time()
        device = self.accelerator.device
        n = len(queries)
        batch = self._build_batch(queries, responses)
        resp_width = batch["response_ids"].shape[1]
        mask = batch["response_mask"]
        lengths = batch["response_lengths"]
        turns = None
        if turn_ids is not None:
            turns = torch.full((n, resp_width), -1, dtype=torch.long, device=device)
            for i, row in enumerate(turn_ids):
                turns[i, : len(row)] = torch.as_tensor(row, dtype=torch.long).to(device)
            mask = mask * (turns >= 0)

        # --- rewards in, NaN samples out ---
        dense = torch.zeros(n, resp_width, device=device)
        if token_rewards is not None:
            for i, row in enumerate(token_rewards):
                row_t = torch.as_tensor(row, dtype=torch.float32).reshape(-1)
                dense[i, : len(row_t)] = row_t.to(device)
        score_t = None
        if scores is not None:
            score_t = torch.as_tensor(
                [float(s) for s in (scores.tolist() if isinstance(scores, torch.Tensor) else scores)],
                dtype=torch.float32,
                device=device,
            )
        bad = ~torch.isfinite(dense).all(1)
        if score_t is not None:
            bad |= ~torch.isfinite(score_t)
        # decided on every process at once: a process that raised alone would leave the others hanging in a collective
        if self.accelerator.reduce(bad.all().float(), reduction="sum").item() > 0:
            raise ValueError(
                "Every sample of the batch has a NaN (or infinite) reward (on at least one process); check the reward "
                "functions."
            )
        if bool(bad.any()):
            warnings.warn(
                f"Dropping {int(bad.sum())} of {n} samples with a NaN (or infinite) reward from this PPO step."
            )
            mask = mask * (~bad).unsqueeze(1)
            if turns is not None:
                turns = torch.where(mask.bool(), turns, torch.full_like(turns, -1))
        valid = ~bad
        # where, not a product: NaN * 0 is NaN. Rewards on tool-output tokens (turn id -1) count nowhere.
        dense = torch.where(mask.bool(), dense, torch.zeros_like(dense))
        if score_t is not None:
            raw_scores = torch.where(valid, score_t, torch.zeros_like(score_t))
            score_t = self._scale_scores(raw_scores, valid) * valid

        # --- rollout pass, per-token rewards, GAE ---
        self.model_wrapped.eval()
        batch = self._old_logprob_pass(batch)
        batch["response_mask"] = mask
        step_logs = {}
        if self.step_masker is not None:
            batch["step_keep"] = self.step_masker.keep_mask(batch["response_ids"], mask, self.processing_class)
            step_logs = self.step_masker.stats()
        kl = batch["kl"] * mask
        kl_coef = self.kl_ctl.value
        non_score = -kl_coef * kl
        env_part = dense.clone()
        positions = torch.arange(resp_width, device=device).expand(n, resp_width)
        last = torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(1).values  # last action token
        if score_t is not None:
            env_part[torch.arange(n, device=device), last] += score_t
        env_part = env_part * mask
        rewards = non_score + env_part
        rlhf_reward = rewards.sum(1)
        kl_part = non_score
        if args.whiten_rewards:
            # one map x -> (x - m) / s + m of the whole reward (old TRL's whiten(shift_mean=False)); the KL share takes
            # the 1/s and the rest the shift, so the parts turn-level GAE keeps apart still add up to it
            mean, std = self._global_moments(rewards, mask)
            kl_part = non_score / std * mask
            env_part = ((env_part - mean) / std + mean) * mask
            rewards = kl_part + env_part
        values = batch["values"] * mask
        bootstrap = None
        ended = batch["response_ids"].gather(1, last.unsqueeze(1)).squeeze(1) == self.eos_token_id
        if args.bootstrap_truncated:
            bootstrap = torch.where(ended, torch.zeros_like(batch["bootstrap_values"]), batch["bootstrap_values"])
        lam = self._lambda(mask.sum(1).long())  # effective length: the action tokens
        if turns is None:
            advantages, returns = compute_gae(rewards, values, mask, args.gamma, lam, bootstrap)
        else:
            advantages, returns = compute_turn_gae(
                env_part, values, turns, args.gamma, lam, token_rewards=kl_part, bootstrap=bootstrap
            )
        if args.whiten_advantages:
            advantages = self._global_whiten(advantages, mask)
        batch.update(advantages=advantages.detach(), returns=returns.detach(), values=values.detach())
        behaviour_logs = {}
        if args.use_decoupled_loss:
            behaviour_logs = self._behaviour_weights(batch, sampler_logprobs, mask)

        # --- optimisation ---
        self.model_wrapped.train()
        stats, early_stopped, epochs_done = self._optimise(batch)
        mean_kl = self.accelerator.reduce(kl.sum(1)[valid].mean().detach(), reduction="mean").item()
        self.kl_ctl.update(mean_kl, args.batch_size * self.accelerator.num_processes)

        # --- statistics ---
        def gmean(x: torch.Tensor) -> float:
            return self.accelerator.reduce(x.detach().float().mean(), reduction="mean").item()

        seq_non_score = non_score.sum(1)[valid]
        logs = {
            "objective/kl": mean_kl,
            "objective/kl_coef": kl_coef,
            "objective/entropy": gmean((batch["entropy"] * mask).sum(1)[valid]),
            "objective/non_score_reward": gmean(seq_non_score),
            "objective/rlhf_reward": gmean(rlhf_reward[valid]),
            "dense/reward_mean": gmean(dense.sum(1)[valid]),
            "dense/token_reward_mean": gmean(dense[mask.bool()]) if bool(mask.any()) else 0.0,
            "tokens/response_len_mean": gmean(lengths[valid].float()),
            # share of responses cut at the length cap (no EOS), read by the health monitor's length gauge
            "tokens/truncated_frac": gmean((~ended)[valid].float()),
            "val/mean": gmean(values[mask.bool()]),
            "returns/mean": gmean(returns[mask.bool()]),
            "advantages/mean": gmean(advantages[mask.bool()]),
            "ppo/early_stop": float(early_stopped),
            "ppo/epochs_done": float(epochs_done),
            "ppo/dropped_samples": float(self.accelerator.reduce(bad.float().sum(), reduction="sum").item()),
            "ppo/learning_rate": self.optimizer.param_groups[0]["lr"],
            **stats,
            **behaviour_logs,
            **step_logs,
            **(extra_logs or {}),
        }
        if score_t is not None:
            logs["objective/scores"] = gmean(score_t[valid])
            logs["env/reward_mean"] = gmean(raw_scores[valid])
            logs["env/reward_std"] = self._gstd(raw_scores, valid)
        if args.use_score_scaling:
            logs["env/running_mean"], logs["env/running_std"] = self.running.mean, self.running.std
        logs["time/ppo_step"] = time.time() - step_start
        self.state.global_step += 1
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        if self.control.should_log or self._in_step_api_mode():
            self.log(logs)
            self.control.should_log = False
        return logs

    def _in_step_api_mode(self) -> bool:
        # outside train() there is no max_steps; honour logging_steps ourselves
        return self.state.max_steps <= 0 and self.state.global_step % max(int(self.state.logging_steps), 1) == 0

    def _gstd(self, x: torch.Tensor, valid: torch.Tensor) -> float:
        # gather full-size tensors (same shape on every process), then drop the invalid entries
        values = self.accelerator.gather(x.detach().float().reshape(-1))
        keep = self.accelerator.gather(valid.reshape(-1).to(x.device)).bool()
        values = values[keep]
        return values.std().item() if values.numel() > 1 else 0.0

    def _optimise(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], bool, int]:
        args = self.args
        n = batch["input_ids"].shape[0]
        backward = args.mini_batch_size * args.gradient_accumulation_steps
        records: dict[str, list[float]] = {}
        early_stopped = False
        epochs_done = 0
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(n, generator=self._shuffle_generator).to(self.accelerator.device)
            for start in range(0, n, backward):
                idx = perm[start : start + backward]
                policy_kl = torch.zeros((), device=self.accelerator.device)
                for micro_start in range(0, backward, args.mini_batch_size):
                    mb_idx = idx[micro_start : micro_start + args.mini_batch_size]
                    mb = {k: v[mb_idx] for k, v in batch.items()}
                    mb = self._trim_micro_batch(mb)
                    last_micro = micro_start + args.mini_batch_size >= backward
                    # gradients are all-reduced once per optimizer step, not once per micro-batch
                    sync = nullcontext() if last_micro else self.accelerator.no_sync(self.model_wrapped)
                    with sync:
                        loss, mb_stats = self._loss(mb)
                        self.accelerator.backward(loss / args.gradient_accumulation_steps)
                    policy_kl = policy_kl + mb_stats.pop("_policykl") / args.gradient_accumulation_steps
                    for k, v in mb_stats.items():
                        records.setdefault(k, []).append(v)
                stop = False
                if args.early_stopping and args.target_kl is not None:
                    global_kl = self.accelerator.reduce(policy_kl.detach(), reduction="mean").item()
                    stop = global_kl > 1.5 * args.target_kl
                if stop:
                    self.optimizer.zero_grad()
                    early_stopped = True
                    break
                if args.max_grad_norm is not None and args.max_grad_norm > 0:
                    norm = self.accelerator.clip_grad_norm_(self.model_wrapped.parameters(), args.max_grad_norm)
                    records.setdefault("policy/grad_norm", []).append(float(norm))
                self.optimizer.step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                self.optimizer.zero_grad()
            if early_stopped:
                break
            epochs_done += 1
        stats = {k: float(np.mean(v)) for k, v in records.items()}
        if stats:
            keys = sorted(stats)
            reduced = self.accelerator.reduce(
                torch.tensor([stats[k] for k in keys], device=self.accelerator.device), reduction="mean"
            )
            stats = dict(zip(keys, reduced.tolist()))
        return stats, early_stopped, epochs_done

    @staticmethod
    def _trim_micro_batch(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # drop response columns that are padding for every row of the micro-batch (saves compute)
        lengths = mb["response_lengths"]
        width = int(lengths.max())
        full = mb["response_ids"].shape[1]
        if width == full:
            return mb
        cut = full - width
        seq = mb["input_ids"].shape[1]  # > full: every query has a token
        out = {}
        for k, v in mb.items():
            if v.dim() >= 2 and v.shape[1] == seq:  # sequence-aligned (ids, masks, any per-position extra)
                out[k] = v[:, : seq - cut]
            elif v.dim() >= 2 and v.shape[1] == full:  # response-aligned
                out[k] = v[:, :width]
            else:
                out[k] = v
        return out

    def _loss(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        args = self.args
        mask = mb["response_mask"]
        out = self._update_forward(mb)
        logprobs, vpred = out["logprobs"], out["values"]
        pg_loss, pg_clipfrac, ratio = _clipped_policy_loss(
            logprobs,
            mb["old_logprobs"],
            mb["advantages"],
            mask * mb["step_keep"] if "step_keep" in mb else mask,  # invalid agent steps: no policy gradient
            args.cliprange,
            behaviour_weight=mb.get("behaviour_weight"),
            keep=mb.get("behaviour_keep"),
        )
        vf_loss, vf_clipfrac = _clipped_value_loss(vpred, mb["values"], mb["returns"], mask, args.cliprange_value)
        avg_ratio = _masked_mean(ratio, mask).item()
        scale = 0.0 if avg_ratio > args.ratio_threshold else 1.0
        loss = scale * (pg_loss + args.vf_coef * vf_loss)
        log_ratio = (logprobs - mb["old_logprobs"]).detach()
        policykl = _masked_mean(-log_ratio, mask)
        stats = {
            "_policykl": policykl,
            "loss/policy": pg_loss.item(),
            "loss/value": vf_loss.item(),
            "loss/total": loss.item(),
            "policy/approxkl": (0.5 * _masked_mean(log_ratio.square(), mask)).item(),
            "policy/policykl": policykl.item(),
            "policy/clipfrac": pg_clipfrac.item(),
            "policy/entropy": _masked_mean(out["entropy"], mask).item(),
            "val/clipfrac": vf_clipfrac.item(),
            "val/ratio": avg_ratio,
            "val/vpred": _masked_mean(vpred.detach(), mask).item(),
            "val/error": _masked_mean((vpred.detach() - mb["returns"]).square(), mask).item(),
            "ppo/loss_zeroed": 1.0 - scale,
        }
        return loss, stats

    # ------------------------------------------------------------------ train()
    def _prompt_ids(self, rows: list[dict]) -> tuple[list[Any], list[torch.Tensor]]:
        tok = self.processing_class
        max_len = self.args.max_prompt_length
        prompts, ids = [], []
        for row in rows:
            if "input_ids" in row and row["input_ids"] is not None:
                q = torch.as_tensor(row["input_ids"], dtype=torch.long).reshape(-1)
                prompt = row.get("prompt", tok.decode(q, skip_special_tokens=True))
            elif "prompt" in row:
                prompt = row["prompt"]
                if isinstance(prompt, list):
                    q = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_tensors=None)
                    if isinstance(q, dict) or hasattr(q, "keys"):
                        q = q["input_ids"]
                    q = torch.as_tensor(q, dtype=torch.long).reshape(-1)
                else:
                    q = torch.as_tensor(tok(prompt)["input_ids"], dtype=torch.long)
            else:
                raise ValueError("train_dataset rows need a 'prompt' (text or messages) or an 'input_ids' column.")
            if max_len is not None and len(q) > max_len:
                q = q[-max_len:]
            if len(q) == 0:
                q = torch.tensor([tok.bos_token_id if tok.bos_token_id is not None else self.eos_token_id])
            prompts.append(prompt)
            ids.append(q)
        return prompts, ids

    def _steps_per_epoch(self) -> int:
        per_step = self.args.batch_size * self.accelerator.num_processes
        steps = len(self.train_dataset) // per_step
        if steps == 0:
            raise ValueError(
                f"train_dataset has {len(self.train_dataset)} rows, fewer than one step's "
                f"batch_size x processes = {per_step}; lower batch_size or add prompts."
            )
        return steps

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train over `train_dataset`: generate, score with `reward_funcs`, and `step`, for `args.max_steps` steps
        (or `args.num_train_epochs` passes). Saves checkpoints per `args.save_strategy`/`save_steps`.

        Args:
            resume_from_checkpoint: A checkpoint directory, or True for the latest in `args.output_dir`. Restores
                weights, optimizer, scheduler, KL controller, running score statistics, RNG and data position.
        """
        args = self.args
        if self.train_dataset is None:
            raise ValueError("train() needs a train_dataset; for custom loops use generate() and step().")
        if not self.reward_funcs:
            raise ValueError("train() needs reward_funcs; for custom loops use generate() and step().")
        steps_per_epoch = self._steps_per_epoch()
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        if self.lr_scheduler is None:
            updates = (
                max_steps
                * args.ppo_epochs
                * (args.batch_size // (args.mini_batch_size * args.gradient_accumulation_steps))
            )
            self.lr_scheduler = get_scheduler(
                args.lr_scheduler_type,
                self.optimizer,
                num_warmup_steps=args.get_warmup_steps(updates),
                num_training_steps=updates,
                scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
            )
            self.callback_handler.lr_scheduler = self.lr_scheduler
        if resume_from_checkpoint:
            if resume_from_checkpoint is True:
                resume_from_checkpoint = self._latest_checkpoint()
            self.load_checkpoint(resume_from_checkpoint)
        self._begin(max_steps)
        total_per_step = args.batch_size * self.accelerator.num_processes
        rank = self.accelerator.process_index
        losses = []
        while self.state.global_step < max_steps:
            epoch, within = divmod(self.state.global_step, steps_per_epoch)
            order = torch.randperm(len(self.train_dataset), generator=torch.Generator().manual_seed(args.seed + epoch))
            global_idx = order[within * total_per_step : (within + 1) * total_per_step]
            local_idx = global_idx[rank * args.batch_size : (rank + 1) * args.batch_size].tolist()
            rows = [self.train_dataset[i] for i in local_idx]
            prompts, queries = self._prompt_ids(rows)
            responses = self.generate(queries, return_prompt=False)
            scores, dense_rows, metrics = self._compute_rewards(rows, prompts, queries, responses)
            self.state.epoch = (self.state.global_step + 1) / steps_per_epoch
            stats = self._step(queries, responses, token_rewards=dense_rows, scores=scores, extra_logs=metrics)
            losses.append(stats.get("loss/total", 0.0))
            if self.control.should_save:
                self.save_checkpoint()
                self.control.should_save = False
            if self.control.should_training_stop and self.state.global_step < max_steps:
                break
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        metrics = {"train_runtime": time.time() - self._start_time, "train_loss": float(np.mean(losses or [0.0]))}
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None) -> None:
        """Save the policy (`save_pretrained`: full model or LoRA adapter), its tokenizer, and the value head
        (`value_head.safetensors`, or the separate value model under `value_model/`)."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            unwrapped = self._unwrapped()
            os.makedirs(output_dir, exist_ok=True)
            unwrapped.policy.save_pretrained(output_dir)
            self.processing_class.save_pretrained(output_dir)
            unwrapped.value_head.save_pretrained(output_dir)
            if unwrapped.value_backbone is not None:
                unwrapped.value_backbone.save_pretrained(os.path.join(output_dir, "value_model"))
        self.accelerator.wait_for_everyone()

    def _latest_checkpoint(self) -> str:
        out = self.args.output_dir
        found = [d for d in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", d)] if os.path.isdir(out) else []
        if not found:
            raise ValueError(f"resume_from_checkpoint=True but {out} holds no checkpoint-N directory.")
        return os.path.join(out, max(found, key=lambda d: int(d.split("-")[1])))

    def save_checkpoint(self, output_dir: str | None = None) -> str:
        """Save a resumable checkpoint (weights, optimizer, scheduler, KL controller, score statistics, RNG, state);
        returns its directory (default `output_dir/checkpoint-{global_step}`)."""
        output_dir = output_dir or os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        self.save_model(output_dir)
        rank = self.accelerator.process_index
        if self.accelerator.is_main_process:
            unwrapped = self._unwrapped()
            trainable = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
            weights = {k: v.detach().cpu() for k, v in unwrapped.state_dict().items() if k in trainable}
            torch.save(weights, os.path.join(output_dir, _TRAINABLE_FILE))
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, "optimizer.pt"))
            if self.lr_scheduler is not None:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
            torch.save(
                {"kl_coef": self.kl_ctl.value, "running": self.running.state_dict()},
                os.path.join(output_dir, _STATE_FILE),
            )
            self.state.stateful_callbacks = {
                type(cb).__name__: cb.state()
                for cb in self.callback_handler.callbacks
                if isinstance(cb, ExportableState)
            }
            self.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "shuffle": self._shuffle_generator.get_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, os.path.join(output_dir, f"rng_state_{rank}.pth"))
        self.accelerator.wait_for_everyone()
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return output_dir

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Restore everything `save_checkpoint` wrote (for the step API; `train(resume_from_checkpoint=...)` calls
        it)."""
        if not os.path.isfile(os.path.join(checkpoint_dir, _STATE_FILE)):
            raise ValueError(f"{checkpoint_dir} is not a PPOTrainer checkpoint (no {_STATE_FILE}).")
        unwrapped = self._unwrapped()
        weights = torch.load(os.path.join(checkpoint_dir, _TRAINABLE_FILE), map_location="cpu")
        missing = {n for n, p in unwrapped.named_parameters() if p.requires_grad} - set(weights)
        if missing:
            raise ValueError(f"Checkpoint {checkpoint_dir} lacks trainable weights such as {sorted(missing)[:3]}.")
        unwrapped.load_state_dict(weights, strict=False)
        self.optimizer.load_state_dict(
            torch.load(os.path.join(checkpoint_dir, "optimizer.pt"), map_location="cpu", weights_only=False)
        )
        sched_path = os.path.join(checkpoint_dir, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(sched_path):
            self.lr_scheduler.load_state_dict(torch.load(sched_path, weights_only=False))
        ppo_state = torch.load(os.path.join(checkpoint_dir, _STATE_FILE), weights_only=False)
        self.kl_ctl.value = ppo_state["kl_coef"]
        self.running.load_state_dict(ppo_state["running"])
        loaded = TrainerState.load_from_json(os.path.join(checkpoint_dir, "trainer_state.json"))
        self.state.global_step = loaded.global_step
        self.state.epoch = loaded.epoch
        self.state.log_history = loaded.log_history
        rng_path = os.path.join(checkpoint_dir, f"rng_state_{self.accelerator.process_index}.pth")
        if os.path.isfile(rng_path):
            rng = torch.load(rng_path, weights_only=False)
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            self._shuffle_generator.set_state(rng["shuffle"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    # ------------------------------------------------------------------ RELC-era compatibility
    def log_stats(self, stats: dict[str, float], batch: dict | None = None, rewards: Any | None = None) -> None:
        """Old-TRL compatibility: `step()` already logs its statistics; this logs the given `rewards` summary."""
        if rewards is None:
            return
        values = torch.as_tensor([float(r) for r in rewards], dtype=torch.float32)
        self.log(
            {
                "env/reward_mean": values.mean().item(),
                "env/reward_std": values.std().item() if len(values) > 1 else 0.0,
            }
        )


# MoE routing replay (PPOConfig.routing_replay): the hooks wrap this class's own methods, so they sit in a subclass
# that keeps the name; with routing_replay="off" every hook is a plain super() call.
PPOTrainer = with_routing_replay(PPOTrainer)
