"""PPO's model wiring, built once in `PPOTrainer.__init__`: the policy, its tokenizer, the value model, the frozen
reference, and their log-prob forward."""

from __future__ import annotations

import copy
import importlib.util
import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import PartialState
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel
from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model, selective_log_softmax_and_entropy

from trl_stable.integration.hf_names import model_name_of
from trl_stable.trainers.ppo.value_head import ValueHead


def backbone(model: nn.Module) -> nn.Module:
    """The transformer body (no head) of a (possibly PEFT-wrapped) HF model."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, "base_model", inner)


def hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if size is None:
        raise ValueError(f"Cannot read the hidden size of {type(model).__name__}: its config has no hidden_size.")
    return int(size)


def embedding_rows(model: nn.Module | None) -> int | None:
    """The rows of `model`'s input embedding table (the token ids it takes), None when it has no readable one."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def load_policy(name: str, args: Any, peft_config: Any | None, device_index: int) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(name)` with `args.model_init_kwargs`, 4/8-bit when asked."""
    kwargs = dict(args.model_init_kwargs or {})
    if args.load_in_4bit or args.load_in_8bit:
        if importlib.util.find_spec("bitsandbytes") is None or not torch.cuda.is_available():
            raise ValueError(
                "load_in_4bit/load_in_8bit need bitsandbytes and a CUDA GPU; install bitsandbytes "
                "(pip install 'trl_stable[quantization]') or turn the option off."
            )
        if peft_config is None:
            raise ValueError("A quantized policy can only be trained through an adapter: pass `peft_config`.")
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=args.load_in_4bit,
            load_in_8bit=args.load_in_8bit,
            bnb_4bit_compute_dtype=torch.bfloat16 if args.bf16 else torch.float16,
            bnb_4bit_quant_type="nf4",
        )
        kwargs.setdefault("device_map", {"": device_index})
    return AutoModelForCausalLM.from_pretrained(name, **kwargs)


def create_reference_model(policy: PreTrainedModel, num_shared_layers: int | None = None) -> PreTrainedModel:
    """A frozen copy of `policy`. With `num_shared_layers`, the embeddings and the first layers are the policy's own
    parameters (frozen in the policy too) instead of copies, as RELC's `create_reference_model` did."""
    ref = copy.deepcopy(policy).requires_grad_(False)
    if num_shared_layers is None:
        return ref.eval()
    params = dict(policy.named_parameters())
    matches = [re.search(r"\.(?:h|layers|layer|blocks)\.(\d+)\.", n) for n in params]
    layer_ids = [int(m.group(1)) if m else None for m in matches]
    num_layers = 1 + max((i for i in layer_ids if i is not None), default=-1)
    if num_shared_layers > num_layers:
        raise ValueError(f"num_shared_layers={num_shared_layers} but the policy has only {num_layers} layers.")
    first_layer = next((k for k, i in enumerate(layer_ids) if i is not None), len(params))
    # shared: what comes before the first layer (the embeddings) and the first `num_shared_layers` layers
    for k, (name, i) in enumerate(zip(params, layer_ids)):
        if (i is None and k < first_layer) or (i is not None and i < num_shared_layers):
            module_name, _, attr = name.rpartition(".")
            setattr(ref.get_submodule(module_name), attr, params[name].requires_grad_(False))
    return ref.eval()


def build_value_head(
    policy: nn.Module, value_model: nn.Module | None, disable_dropout: bool
) -> tuple[ValueHead, nn.Module | None]:
    """The value head and, for a separate critic, its backbone (None: the head reads the policy's hidden states);
    `value_model` as in `PPOTrainer`."""
    if value_model is None:
        return ValueHead(hidden_size(policy)), None
    if isinstance(value_model, ValueHead):
        if value_model.hidden_size != hidden_size(policy):
            raise ValueError(
                f"The value head reads hidden states of size {value_model.hidden_size} but the policy's hidden "
                f"size is {hidden_size(policy)}; build it as ValueHead({hidden_size(policy)})."
            )
        return value_model, None
    if not isinstance(value_model, nn.Module):
        raise ValueError("value_model must be None, a ValueHead or a transformers PreTrainedModel.")
    value_backbone = backbone(value_model)
    score = getattr(value_model, "score", None)
    width = hidden_size(value_model)
    head = ValueHead(width)
    if isinstance(score, nn.Linear) and score.out_features == 1:
        if score.in_features != width:
            raise ValueError(
                f"The value model's score head reads size {score.in_features}, not {width}: fix its config."
            )
        head.summary = score
    if disable_dropout:
        disable_dropout_in_model(value_backbone)
    return head, value_backbone


def enable_activation_checkpointing(model: nn.Module, value_backbone: nn.Module | None, is_peft: bool, args) -> None:
    """Activation checkpointing of the policy (and a separate value model) as `transformers.Trainer.train` switches it
    on from `args.activation_checkpointing_kwargs`; non-reentrant unless the kwargs say otherwise."""
    kwargs = dict(args.activation_checkpointing_kwargs or {"use_reentrant": False})
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    for module in (model, value_backbone):
        if module is not None and hasattr(module, "activation_checkpointing_enable"):
            module.activation_checkpointing_enable(
                activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
            )
    if is_peft and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


def add_fused_logprob_head(model: nn.Module, temperature: float) -> bool:
    """Give `model` TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`: log-probs and entropies without the
    [B, R, V] logits, with ``fused_lm_head=True`` and labels); False for a model without output embeddings."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_output_embeddings") or base.get_output_embeddings() is None:
        return False
    add_fused_lm_head(base, temperature=temperature, outputs=("log_probs", "entropy"))
    return True


def response_head(batch: dict[str, torch.Tensor], fused: bool) -> dict[str, Any]:
    """The LM-head arguments of a pass that scores the response block (the last R columns of `input_ids`, padding
    included): the fused head's labels (the rest -100), or the logits of the last R + 1 positions."""
    ids, response_ids = batch["input_ids"], batch["response_ids"]
    if not fused:
        return dict(logits_to_keep=response_ids.shape[1] + 1)
    labels = torch.full_like(ids, -100)
    labels[:, -response_ids.shape[1] :] = response_ids
    return dict(labels=labels, fused_lm_head=True)


@dataclass
class ResponseScores:
    """The response tokens' fp32 log-probs [B, R], entropy [B, R] (no grad) and, for full KL, the logits [B, R, V]."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    logits: torch.Tensor | None = None


class PolicyAndValue(nn.Module):
    """The trainable modules in one `nn.Module`, so that the engine wraps and synchronizes them together; forward
    returns the policy's output (with `labels`: the fused head's) and the values of the last `logits_to_keep`
    positions."""

    # read by `transformers.Trainer` on the model it trains (`_issue_warnings_after_load`)
    _keys_to_ignore_on_save = None

    def __init__(self, policy: nn.Module, value_head: ValueHead, value_backbone: nn.Module | None):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.value_backbone = value_backbone

    @property
    def config(self) -> Any:
        # `transformers.Trainer` reads (and sets `use_cache` on) its model's config; TRL's model card names the base
        # model from it
        return self.policy.config

    @property
    def quantization_method(self) -> Any:
        # `transformers.Trainer` does not move a bitsandbytes model (it is placed by its device map)
        return getattr(self.policy, "quantization_method", None)

    @property
    def _no_split_modules(self) -> list[str]:
        # FSDP's transformer-based auto-wrap reads the layer classes to shard from the model it wraps
        names = list(getattr(self.policy, "_no_split_modules", None) or [])
        if self.value_backbone is not None:
            names += [n for n in getattr(self.value_backbone, "_no_split_modules", None) or [] if n not in names]
        return names

    @property
    def is_gradient_checkpointing(self) -> bool:
        # read (and toggled below) by TRL's `unwrap_model_for_generation` under ZeRO-3
        return bool(getattr(self.policy, "is_gradient_checkpointing", False))

    def gradient_checkpointing_disable(self) -> None:
        self.policy.gradient_checkpointing_disable()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids=None,
        logits_to_keep: int | None = None,
        labels=None,
        generation_kwargs: dict | None = None,
        reference_kwargs: dict | None = None,
    ):
        # Under FSDP2 this module is the FSDP root: a call that bypassed it would find the root's parameters
        # (embeddings, head) still sharded, so generation and the adapter-free reference pass of a PEFT policy go
        # through here too (`trl_stable.trainers.ppo.engines`).
        if generation_kwargs is not None:
            return self.policy.generate(input_ids=input_ids, attention_mask=attention_mask, **generation_kwargs)
        if reference_kwargs is not None:
            with self.policy.disable_adapter():
                return self.policy(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **reference_kwargs
                )
        captured: dict[str, torch.Tensor] = {}

        def grab(module, args, output):
            captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

        # without a separate value model the head reads the policy's last hidden state, hooked for this call (a
        # `RemovableHandle` removes its hook on exit)
        hook = backbone(self.policy).register_forward_hook(grab) if self.value_backbone is None else nullcontext()
        with hook:
            # no `use_cache`: the policy's config has it, set by Trainer from `args.use_cache` (False by default)
            head = dict(logits_to_keep=logits_to_keep) if labels is None else dict(labels=labels, fused_lm_head=True)
            out = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **head)
        if self.value_backbone is not None:
            captured["hidden"] = self.value_backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        return out, self.value_head(captured["hidden"][:, -logits_to_keep:])


def logits_scores(logits: torch.Tensor, response_ids: torch.Tensor, temperature: float) -> ResponseScores:
    """`ResponseScores` from the logits of the response positions (and any after them, dropped), by TRL's
    `selective_log_softmax_and_entropy`. Half-precision logits are upcast one sequence at a time: PPO's ratio needs
    fp32 log-probs, but the fp32 log-softmax of the whole [B, T, V] batch is never built at once."""
    logits = logits[:, : response_ids.shape[1]]
    if logits.dtype in (torch.float32, torch.float64):
        rows = [(logits, response_ids)]
    else:
        rows = [(row.float().unsqueeze(0), row_ids.unsqueeze(0)) for row, row_ids in zip(logits, response_ids)]
    kwargs = dict(entropy_requires_grad=False, temperature=temperature)  # the entropy is a metric
    parts = [selective_log_softmax_and_entropy(row, ids, **kwargs) for row, ids in rows]
    return ResponseScores(torch.cat([p[0] for p in parts]).float(), torch.cat([p[1] for p in parts]).float(), logits)


class ResponseForwards:
    """The policy's and the reference's passes over a batch's response tokens (a `PPOTrainer` mixin)."""

    def _forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], need_logits: bool = False
    ) -> tuple[ResponseScores, torch.Tensor]:
        """The response tokens' log-probs and entropies, and values [B, R + 1] (V(s_t) for each token, then the value
        after the last position). Through the fused LM head unless `need_logits` (then also the raw [B, R, V])."""
        fused = self.fused_policy and not need_logits
        inputs = (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        keep = batch["response_ids"].shape[1] + 1
        out, values = model(*inputs, logits_to_keep=keep, labels=response_head(batch, fused).get("labels"))
        return self._response_scores(out, batch, fused), values

    def _ref_scores(self, batch: dict[str, torch.Tensor], need_logits: bool = False) -> ResponseScores:
        """The reference model's view of the response tokens (the policy without its adapter under PEFT)."""
        fused = (self.fused_ref if self.ref_model is not None else self.fused_policy) and not need_logits
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        head = {**response_head(batch, fused), "use_cache": False}
        if self.ref_model is not None:
            out = self.ref_model(**inputs, **head)
        elif self.is_fsdp_enabled:  # through the FSDP root, which holds the embeddings and head (PolicyAndValue)
            out = self.model_wrapped(*inputs.values(), reference_kwargs=head)
        else:
            policy = self.policy  # unwraps the engine's module: once
            with policy.disable_adapter():
                out = policy(**inputs, **head)
        return self._response_scores(out, batch, fused)

    def _response_scores(self, out: Any, batch: dict[str, torch.Tensor], fused: bool) -> ResponseScores:
        """`ResponseScores` from a pass with `response_head(batch, fused)`'s arguments."""
        width = batch["response_ids"].shape[1]
        if not fused:  # the last R + 1 positions' logits (`logits_to_keep`)
            return logits_scores(out.logits[:, -width - 1 :], batch["response_ids"], self.args.temperature)
        return ResponseScores(out.log_probs[:, -width:].float(), out.entropy[:, -width:].detach().float())


@dataclass
class PPOModels:
    """What `build_models` wires up (`ref_model` None: the adapter-free policy; `model_id` None: unknown)."""

    wrapper: PolicyAndValue
    ref_model: nn.Module | None
    tokenizer: Any
    model_id: str | None
    is_peft: bool


def build_models(
    model: str | nn.Module, args: Any, tokenizer: Any, ref_model: Any, value_model: Any, peft_config: Any
) -> PPOModels:
    """`PPOTrainer`'s models from its arguments (see its Args); the tokenizer's pad token is EOS when it has none."""
    model_id = model if isinstance(model, str) else model_name_of(model)
    by_name = [n for n in ("model_init_kwargs", "load_in_4bit", "load_in_8bit") if getattr(args, n)]
    if by_name and not isinstance(model, str):  # the values unprinted: model_init_kwargs may hold a token
        raise ValueError(
            f"{', '.join(by_name)} apply to a policy loaded by name, but `model` is a {type(model).__name__} object: "
            "pass its name or path, or unset them."
        )
    if args.num_shared_layers is not None and ref_model is not None:
        raise ValueError(
            f"num_shared_layers={args.num_shared_layers} shapes the reference copied from the policy, but `ref_model` "
            "is used as is: leave num_shared_layers=None, or drop ref_model (or build it with create_reference_model)."
        )
    if isinstance(model, str):
        model = load_policy(model, args, peft_config, PartialState().local_process_index)
    if tokenizer is None:
        if not model_id:
            raise ValueError("Pass `processing_class` (a tokenizer): it cannot be loaded for an unnamed model.")
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    is_peft = is_peft_model(model)
    if peft_config is not None and not is_peft:  # a LoRA adapter (k-bit preparation for a quantized policy)
        from peft import get_peft_model, prepare_model_for_kbit_training

        if is_quantized(model):
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
        model, is_peft = get_peft_model(model, peft_config), True
    if args.disable_dropout:
        disable_dropout_in_model(model)
    # ZeRO-3 (``zero3_init_flag``) partitioned the policy as it was built, and a partitioned model cannot be copied
    if ref_model is None and not is_peft and any(hasattr(p, "ds_id") for p in model.parameters()):
        if not model_id:
            raise ValueError("Under DeepSpeed ZeRO-3 pass `ref_model` (or the policy by name) for the reference.")
        ref_model = load_policy(model_id, args, None, PartialState().local_process_index)
    # the reference: `ref_model`, the adapter-free policy under PEFT (None), or a frozen copy of the policy
    if ref_model is None and is_peft:
        if args.num_shared_layers is not None:
            raise ValueError(
                f"num_shared_layers={args.num_shared_layers}: a PEFT policy's reference is the policy without its "
                "adapter (no copy to share layers with): leave num_shared_layers=None."
            )
    else:
        ref_model = create_reference_model(model, args.num_shared_layers) if ref_model is None else ref_model.eval()
        ref_model.requires_grad_(False)
        disable_dropout_in_model(ref_model)
    value_head, value_backbone = build_value_head(model, value_model, args.disable_dropout)
    if args.activation_checkpointing:
        enable_activation_checkpointing(model, value_backbone, is_peft, args)
    if is_quantized(model):
        # accelerate does not move quantized (device-mapped) models: put the head where the policy lives
        value_head.to(next(model.parameters()).device)
    return PPOModels(PolicyAndValue(model, value_head, value_backbone), ref_model, tokenizer, model_id, is_peft)
