"""RELC's TRL 0.x API on trl_stable: change a RELC script's `trl` imports to this module and it runs unchanged.

RELC (Cao et al., "Beyond Sparse Rewards", google-research/relc) ships its scripts with a frozen fork of TRL 0.x.
Every name they import from `trl`, `trl.core`, `trl.extras.openai_scores` and `trl.extras.toxicity_evaluator` is
here, with the fork's signature and meaning, built on trl_stable's `PPOTrainer`, critic backends and span alignment
(no code of the fork is reused). Where the fork's behaviour was a bug, the script keeps running and a warning (once)
says what trl_stable does and how to switch: docs/coming_from_relc.md.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from accelerate.utils import gather_object, set_seed  # set_seed: random, numpy, torch (all devices), as trl.core's
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from trl_stable.compat.relc_critic import _warn_once, _warned, query_batch_span, take_failed_prompts  # noqa: F401
from trl_stable.core.score_scaling import scale_scores
from trl_stable.trainers.ppo import PPOTrainer as _StablePPOTrainer
from trl_stable.trainers.ppo import models as ppo_models
from trl_stable.trainers.ppo.ppo_config import PPOConfig as _StablePPOConfig
from trl_stable.trainers.ppo.rollout import LengthSampler as _InclusiveLengthSampler
from trl_stable.trainers.ppo.value_head import ValueHead

__all__ = [
    "AutoModelForCausalLMWithValueHead",
    "AutoModelForSeq2Seq",
    "AutoModelForSeq2SeqLMWithValueHead",
    "LengthSampler",
    "PPOConfig",
    "PPOTrainer",
    "PerspectiveAPI",
    "RobertaHateSpeechDetector",
    "create_reference_model",
    "query_batch_span",
    "set_seed",
]


class LengthSampler(_InclusiveLengthSampler):
    """`trl.core.LengthSampler`: a length drawn uniformly from ``[min_value, max_value)``.

    The upper bound is exclusive, as in TRL 0.x (``range(min_value, max_value)``); trl_stable's own
    `trl_stable.trainers.ppo.rollout.LengthSampler` includes it.
    """

    def __init__(self, min_value: int, max_value: int):
        if max_value <= min_value:
            raise ValueError(
                f"LengthSampler needs min_value < max_value (the upper bound is exclusive), got "
                f"{min_value}, {max_value}."
            )
        super().__init__(min_value, max_value - 1)


def _carried(default: Any) -> Any:
    """A `PPOConfig` field that `to_trl_stable` passes on as it is (trl_stable's PPOConfig has it, same meaning)."""
    return field(default=default, metadata={"carried": True})


@dataclass
class PPOConfig:
    """`trl.PPOConfig` of RELC's TRL 0.x fork: the same fields and defaults (a plain dataclass, so `tyro` builds
    its flags as before). `PPOTrainer` turns it into a `trl_stable.PPOConfig` (`to_trl_stable`).

    Fields the fork used only for tracking (`exp_name`, `task_name`, `model_name`, `query_dataset`, `reward_model`,
    `steps`) are kept and logged. `log_with` becomes `report_to`, `tracker_project_name` the wandb project,
    ``max_grad_norm=None`` no clipping. `accelerator_kwargs`, `project_kwargs`, `push_to_hub_if_best_kwargs` and
    `optimize_cuda_cache` have no trl_stable counterpart and are ignored with a warning when set.
    """

    exp_name: str = os.path.basename(sys.argv[0])[: -len(".py")]
    task_name: str | None = None
    model_name: str | None = _carried(None)
    query_dataset: str | None = None
    reward_model: str | None = None
    steps: int = 20000
    learning_rate: float = _carried(1e-5)
    adap_kl_ctrl: bool = _carried(True)
    init_kl_coef: float | None = 0.2
    kl_penalty: str = _carried("kl")
    target: float | None = 6
    horizon: float | None = 10000
    gamma: float = 1
    lam: float = _carried(0.95)
    cliprange: float = _carried(0.2)
    cliprange_value: float = _carried(0.2)
    vf_coef: float = _carried(0.1)
    batch_size: int = _carried(256)
    forward_batch_size: int | None = None
    mini_batch_size: int = _carried(1)
    gradient_accumulation_steps: int = _carried(1)
    world_size: int | None = None
    backward_batch_size: int | None = None
    global_backward_batch_size: int | None = None
    global_batch_size: int | None = None
    ppo_epochs: int = _carried(4)
    remove_unused_columns: bool = True
    log_with: str | None = None
    tracker_kwargs: dict = field(default_factory=dict)
    accelerator_kwargs: dict = field(default_factory=dict)
    project_kwargs: dict = field(default_factory=dict)
    tracker_project_name: str = "trl"
    max_grad_norm: float | None = None
    seed: int = _carried(0)
    optimize_cuda_cache: bool = False
    early_stopping: bool = _carried(False)
    target_kl: float = 1
    push_to_hub_if_best_kwargs: dict = field(default_factory=dict)
    compare_steps: int = 1
    ratio_threshold: float = _carried(10.0)
    use_score_scaling: bool = _carried(False)
    use_score_norm: bool = _carried(False)
    score_clip: float | None = _carried(None)
    is_encoder_decoder: bool | None = None
    is_peft_model: bool | None = None

    def __post_init__(self):
        if self.forward_batch_size is not None:
            warnings.warn("forward_batch_size is deprecated: it overrides mini_batch_size, as in TRL 0.x.")
            self.mini_batch_size = self.forward_batch_size
        self.backward_batch_size = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % self.backward_batch_size != 0:
            raise ValueError(
                f"`batch_size` ({self.batch_size}) must be a multiple of `mini_batch_size * "
                f"gradient_accumulation_steps` ({self.backward_batch_size})."
            )
        if self.kl_penalty not in ("kl", "abs", "mse", "full"):
            raise ValueError(f"kl_penalty must be one of 'kl', 'abs', 'mse', 'full', got {self.kl_penalty!r}.")
        self.total_ppo_epochs = -(-self.steps // self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a flat dict (what the fork sent to the tracker)."""
        return asdict(self)

    def to_trl_stable(self, output_dir: str | None = None, **overrides: Any) -> _StablePPOConfig:
        """The equivalent `trl_stable.PPOConfig` (`overrides` win)."""
        for name in ("accelerator_kwargs", "project_kwargs", "push_to_hub_if_best_kwargs", "optimize_cuda_cache"):
            if getattr(self, name):
                _warn_once(name, f"PPOConfig.{name} has no trl_stable counterpart and is ignored.")
        if self.log_with == "wandb":
            # transformers' WandbCallback reads the project from the environment
            os.environ.setdefault("WANDB_PROJECT", self.tracker_project_name)
        wandb_kwargs = self.tracker_kwargs.get("wandb", {}) if isinstance(self.tracker_kwargs, dict) else {}
        kwargs = dict(
            {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("carried")},
            output_dir=output_dir or os.path.join("relc_output", self.exp_name or "ppo"),
            init_kl_coef=self.init_kl_coef if self.init_kl_coef is not None else 0.2,
            # old TRL ignored the controller's target/horizon with a fixed coefficient and target_kl without
            # early_stopping; trl_stable refuses an ignored setting, so only the ones that act are carried over
            **({"target": self.target, "horizon": self.horizon} if self.adap_kl_ctrl else {}),
            gamma=float(self.gamma),
            report_to=self.log_with or "none",
            # RELC's wandb kwargs only reach wandb when log_with starts it (accelerate's init_trackers)
            run_name=wandb_kwargs.get("name") if self.log_with == "wandb" else None,
            max_grad_norm=self.max_grad_norm if self.max_grad_norm is not None else 0.0,  # 0: no clipping
            target_kl=self.target_kl if self.early_stopping else None,
            # RELC's scripts draw their lengths with a LengthSampler and show their own progress bars
            disable_tqdm=True,
            save_strategy="no",
            logging_steps=1,
        )
        return _StablePPOConfig(**{**kwargs, **overrides})


class AutoModelForCausalLMWithValueHead(nn.Module):
    """`trl.AutoModelForCausalLMWithValueHead`: a causal LM (`pretrained_model`, a PEFT model with `peft_config`)
    and a scalar value head (`v_head`, trl_stable's `ValueHead`) on its last hidden state.

    `PPOTrainer` trains this very head, so an optimizer built over ``model.parameters()`` (as RELC's scripts do)
    covers the policy and the value head. `forward` returns ``(lm_logits, loss, value)`` as in TRL 0.x.
    """

    def __init__(self, pretrained_model: nn.Module, v_head: ValueHead | None = None):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.v_head = v_head if v_head is not None else ValueHead(ppo_models.hidden_size(pretrained_model))
        self.is_peft_model = ppo_models.is_peft_model(pretrained_model)
        self.config = getattr(pretrained_model, "config", None)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | nn.Module, *model_args: Any, peft_config: Any | None = None, **kwargs
    ) -> AutoModelForCausalLMWithValueHead:
        """Load (or wrap) a causal LM and put a fresh value head on it, seeded by the global RNG as in TRL 0.x (call
        `set_seed` first for a reproducible head). `pretrained_model_name_or_path` may be a loaded LM; with
        `peft_config` it becomes a PEFT model; `kwargs` go to `AutoModelForCausalLM.from_pretrained` (``device_map``,
        ``load_in_8bit``, dtype, ...)."""
        if isinstance(pretrained_model_name_or_path, nn.Module):
            model = pretrained_model_name_or_path
        else:  # TRL 0.x's loading flags in today's transformers spelling
            load_8bit, load_4bit = kwargs.pop("load_in_8bit", False), kwargs.pop("load_in_4bit", False)
            if load_8bit or load_4bit:
                from transformers import BitsAndBytesConfig

                kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=load_8bit, load_in_4bit=load_4bit)
            # RELC's PEFT script maps the model to GPU `local_process_index`; on a CPU machine that index is no device
            device_map = kwargs.get("device_map")
            cpu_only = isinstance(device_map, dict) and not torch.cuda.is_available()
            if cpu_only and any(isinstance(v, int) for v in device_map.values()):
                kwargs.pop("device_map")
            model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        return cls(model)

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        out = self.pretrained_model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs
        )
        return out.logits, getattr(out, "loss", None), self.v_head(out.hidden_states[-1])

    def generate(self, *args: Any, **kwargs: Any):
        return self.pretrained_model.generate(*args, **kwargs)

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        self.v_head.save_pretrained(save_directory)


class AutoModelForSeq2SeqLMWithValueHead(AutoModelForCausalLMWithValueHead):
    """`trl.AutoModelForSeq2SeqLMWithValueHead`. trl_stable's PPO trains decoder-only models only, so loading one
    raises; RELC's scripts reach it only with ``--use_seq2seq``."""

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        raise NotImplementedError(
            "trl_stable's PPOTrainer trains causal (decoder-only) LMs only; use AutoModelForCausalLMWithValueHead."
        )


AutoModelForSeq2Seq = AutoModelForSeq2SeqLMWithValueHead  # the name RELC's sentiment script imports


def create_reference_model(
    model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None
) -> nn.Module:
    """`trl.create_reference_model`: a frozen copy of `model` whose embeddings and first `num_shared_layers`
    layers are the model's own (frozen) parameters (None: a full frozen copy). Takes and returns a value-head model
    (or a plain causal LM). `pattern` (the fork's layer-name pattern) is not needed: layers are found by index."""
    if pattern is not None:
        _warn_once("pattern", "create_reference_model(pattern=...) is ignored: trl_stable finds layers by index.")
    if isinstance(model, AutoModelForCausalLMWithValueHead):
        ref = ppo_models.create_reference_model(model.pretrained_model, num_shared_layers)
        head = ValueHead(model.v_head.hidden_size)
        head.load_state_dict(model.v_head.state_dict())
        return AutoModelForCausalLMWithValueHead(ref, head.requires_grad_(False)).eval()
    return ppo_models.create_reference_model(model, num_shared_layers)


def _policy_of(model: Any) -> Any:
    return model.pretrained_model if isinstance(model, AutoModelForCausalLMWithValueHead) else model


class PPOTrainer(_StablePPOTrainer):
    """`trl.PPOTrainer` of RELC's fork on trl_stable's PPO, with the fork's constructor, `generate`, `step` and
    `save_pretrained`, plus `config` (the RELC config) and `dataloader` (over `dataset`, see `prepare_dataloader`);
    everything of `trl_stable.PPOTrainer` is there too."""

    def __init__(
        self,
        config: PPOConfig | None = None,
        model: nn.Module | None = None,
        ref_model: nn.Module | None = None,
        tokenizer: Any | None = None,
        dataset: Any | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        data_collator: Callable | None = None,
        num_shared_layers: int | None = None,
        lr_scheduler: Any | None = None,
    ):
        config = PPOConfig() if config is None else config
        if not isinstance(config, PPOConfig):
            raise ValueError(f"config must be a trl_stable.compat.relc.PPOConfig, got {type(config)}.")
        if model is None:
            raise ValueError("PPOTrainer needs `model` (an AutoModelForCausalLMWithValueHead).")
        self.config = config
        if ref_model is not None and num_shared_layers is not None:
            warnings.warn("num_shared_layers is ignored when ref_model is provided.")
        args = config.to_trl_stable(num_shared_layers=num_shared_layers if ref_model is None else None)
        value_head = model.v_head if isinstance(model, AutoModelForCausalLMWithValueHead) else None
        super().__init__(
            model=_policy_of(model),
            args=args,
            processing_class=tokenizer,
            ref_model=_policy_of(ref_model),  # None stays None
            value_model=value_head,
            optimizers=(optimizer, lr_scheduler),
        )
        self.tokenizer = self.processing_class
        self.is_peft_model = self.is_peft
        self.is_encoder_decoder = False
        config.world_size = self.accelerator.num_processes
        config.global_backward_batch_size = config.backward_batch_size * config.world_size
        config.global_batch_size = config.batch_size * config.world_size
        config.is_encoder_decoder, config.is_peft_model = False, self.is_peft
        self.dataset = dataset
        self.data_collator = data_collator
        self.dataloader = self.prepare_dataloader(dataset, data_collator) if dataset is not None else None
        self.current_step = 0

    def prepare_dataloader(self, dataset: Any, data_collator: Callable | None = None) -> torch.utils.data.DataLoader:
        """A shuffled `DataLoader` of `config.batch_size` rows per process (last incomplete batch dropped), prepared by
        the accelerator; with `remove_unused_columns`, a `datasets.Dataset` keeps only the columns the model's forward
        takes plus "label", "query" and "response", as the fork did."""
        if self.config.remove_unused_columns and hasattr(dataset, "column_names"):
            keep = set(inspect.signature(self.unwrapped().policy.forward).parameters) | {"label", "query", "response"}
            dataset = dataset.select_columns([c for c in dataset.column_names if c in keep])
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=self.config.batch_size, collate_fn=data_collator, shuffle=True, drop_last=True
        )
        return self.accelerator.prepare(loader)

    def generate(
        self,
        query_tensor: torch.Tensor | list[torch.Tensor],
        length_sampler: Callable[[], int] | None = None,
        batch_size: int = 4,
        return_prompt: bool = True,
        **generation_kwargs: Any,
    ):
        """The fork's `generate`: one 1-D query gives a [1, len] tensor (prompt + response unless
        ``return_prompt=False``); a list gives a list of 1-D tensors, generated `batch_size` at a time with one
        `length_sampler()` draw per chunk, each cut after its first EOS (kept)."""
        if "min_length" in generation_kwargs and generation_kwargs["min_length"] < 0:
            generation_kwargs.pop("min_length")  # TRL 0.x's "no minimum"; today's generate rejects -1
        if "top_k" in generation_kwargs:
            generation_kwargs["top_k"] = int(generation_kwargs["top_k"])  # RELC passes 0.0
        single = isinstance(query_tensor, torch.Tensor)
        if single and query_tensor.dim() != 1:
            raise ValueError("query_tensor must be a tensor of shape (seq_len) or a list of such tensors.")
        out = super().generate(
            query_tensor, length_sampler, return_prompt=return_prompt, batch_size=batch_size, **generation_kwargs
        )
        return out.unsqueeze(0) if single else out

    def step(
        self,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        scores: list[Any] | torch.Tensor | None = None,
        response_masks: list[torch.Tensor] | None = None,
        **stable_kwargs: Any,
    ) -> dict[str, float]:
        """The fork's ``step(queries, responses, scores)``: each score is a scalar (the sequence reward, on the last
        response token), None (a sample without a reward: dropped) or, as RELC's scripts build them, a row of
        ``len(query) + len(response) - 1`` rewards, one per predicted token, of which only the response's last
        ``len(response)`` reach PPO (the fork masked the query positions too). trl_stable's keywords
        (``token_rewards=``, ``turn_ids=``, ...) pass through to `trl_stable.PPOTrainer.step`, with `scores` in its
        meaning."""
        if stable_kwargs:
            return super().step(queries, responses, scores=scores, **stable_kwargs)
        if response_masks is not None:
            raise ValueError("step(response_masks=...) is not supported by trl_stable's PPO; mask with turn_ids.")
        if scores is None or len(scores) != len(queries):
            raise ValueError("step() needs one score (scalar or per-token row) per query.")
        values = []
        for i, (q, r, s) in enumerate(zip(queries, responses, scores)):
            s = torch.tensor(float("nan")) if s is None else torch.as_tensor(s, dtype=torch.float32).detach().cpu()
            expected = len(q) + len(r) - 1
            if s.dim() != 0 and (s.dim() != 1 or len(s) != expected):
                raise ValueError(
                    f"scores[{i}] has shape {tuple(s.shape)}: give a scalar or one reward per predicted token of "
                    f"query + response, len(query) + len(response) - 1 = {expected} entries."
                )
            values.append(s)
        self.current_step += 1
        dropped = self._samples_of_failed_calls(responses, take_failed_prompts())
        if all(s.dim() == 0 for s in values):
            scalars = [float("nan") if i in dropped else float(s) for i, s in enumerate(values)]
            return super().step(queries, responses, scores=scalars)
        # a scalar among per-token rows goes on the last token, as a row would hold it
        rows = [
            torch.cat([torch.zeros(len(q) + len(r) - 2), s.reshape(1)]) if s.dim() == 0 else s
            for q, r, s in zip(queries, responses, values)
        ]
        # only the response tokens reach PPO: the fork masked the query positions out as well
        token_rewards = [row[len(q) - 1 :] for q, row in zip(queries, self._scaled_rows(rows))]
        for i in dropped:  # NaN: PPO drops the sample (counted in ppo/dropped_samples)
            token_rewards[i] = torch.full_like(token_rewards[i], float("nan"))
        return super().step(queries, responses, token_rewards=token_rewards)

    def _scaled_rows(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The fork's `use_score_scaling` / `use_score_norm` / `score_clip` on per-token rows: every entry of every
        process's rows (zero-padded to the longest on their process) updates the running moments, then `scale_scores`
        (the two differences from the fork: docs/coming_from_relc.md)."""
        args = self.args
        if not args.use_score_scaling and args.score_clip is None:
            return rows
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, longest row of this process]
        running = None
        if args.use_score_scaling:
            # a list gathers as one list, this process's entries after the lower ranks', whatever their counts
            self.running.update(torch.tensor(gather_object(padded.flatten().float().tolist())))
            running = self.running
        scaled = scale_scores(padded, running, normalize=args.use_score_norm, clip=args.score_clip)
        return [scaled[i, : len(row)] for i, row in enumerate(rows)]

    def _samples_of_failed_calls(self, responses: list[torch.Tensor], failed_prompts: list[str]) -> set[int]:
        """The samples whose critic call failed (``TRL_STABLE_RELC_FAILED_CALLS=drop``): the one whose decoded
        response (8 characters or more, whitespace ignored) occurs in the failed call's prompt. A prompt that no
        single sample matches drops nothing, with a warning."""
        if not failed_prompts:
            return set()
        squash = lambda text: "".join(text.split())  # noqa: E731 - RELC's scripts flatten newlines one way or another
        texts = [squash(self.tokenizer.decode(r, skip_special_tokens=True)) for r in responses]
        hits = [[i for i, t in enumerate(texts) if len(t) >= 8 and t in p] for p in map(squash, failed_prompts)]
        dropped = {h[0] for h in hits if len(h) == 1}
        unmatched = sum(len(h) != 1 for h in hits)
        if unmatched:
            warnings.warn(
                f"{unmatched} failed critic calls matched no single sample of this step (their response is shorter "
                "than 8 characters or occurs in several samples): those samples are kept.",
                stacklevel=3,
            )
        if len(dropped) == len(responses):
            raise RuntimeError(
                "Every critic call of this step failed (TRL_STABLE_RELC_FAILED_CALLS=drop leaves no sample to train "
                "on): check the critic server (OPENAI_BASE_URL) and its key."
            )
        return dropped

    def save_pretrained(self, save_directory: str) -> None:
        """Save the policy (full model or LoRA adapter), the tokenizer and the value head to `save_directory`, on the
        main process only and with no collective inside, so RELC's ``if accelerator.is_main_process:`` call works."""
        if self.accelerator.is_main_process:
            self._save(save_directory)


class RobertaHateSpeechDetector:
    """`trl.extras.toxicity_evaluator.RobertaHateSpeechDetector`: `evaluate(texts)` gives, per text, a 0-dim
    tensor with the classifier's "not hate" logit (class 0), the fork's reward. Loaded in float16 on CUDA only
    (CPU half-precision kernels are incomplete)."""

    def __init__(self, model_id: str = "facebook/roberta-hate-speech-dynabench-r4-target", device: Any = None):
        self.model_id, self.device = model_id, device
        self.toxicity_tokenizer = AutoTokenizer.from_pretrained(model_id)
        on_cuda = device is not None and torch.device(device).type == "cuda"
        self.model: PreTrainedModel = AutoModelForSequenceClassification.from_pretrained(
            model_id, dtype=torch.float16 if on_cuda else torch.float32
        ).to(device)

    @torch.no_grad()
    def evaluate(self, texts: Sequence[str]) -> list[torch.Tensor]:
        inputs = self.toxicity_tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
        logits = self.model(**inputs.to(self.device)).logits.float()
        return [torch.tensor(v) for v in logits[:, 0].tolist()]


class PerspectiveAPI:
    """`trl.extras.toxicity_evaluator.PerspectiveAPI`: `evaluate(texts)` gives ``1 - TOXICITY`` per text as 0-dim
    tensors; a text whose request fails twice scores 0.5 (the fork's fallback), with a warning. Needs
    `google-api-python-client` and network access to Google's Comment Analyzer."""

    def __init__(self, api_key: str | None = None, num_thread: int = 5):
        from googleapiclient import discovery

        self.api_key, self.num_thread = api_key, num_thread
        self.client = discovery.build(
            "commentanalyzer",
            "v1alpha1",
            developerKey=api_key,
            discoveryServiceUrl="https://commentanalyzer.googleapis.com/$discovery/rest?version=v1alpha1",
            static_discovery=False,
        )

    def _toxicity(self, text: str) -> float | None:
        body = {"comment": {"text": text}, "requestedAttributes": {"TOXICITY": {}}}
        for _ in range(2):
            try:
                response = self.client.comments().analyze(body=body).execute()
                return float(response["attributeScores"]["TOXICITY"]["summaryScore"]["value"])
            except Exception:  # noqa: BLE001 - any API failure falls back like the fork did
                continue
        return None

    def evaluate(self, texts: Sequence[str]) -> list[torch.Tensor]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.num_thread) as pool:
            scores = list(pool.map(self._toxicity, texts))
        if any(s is None for s in scores):
            _warn_once("perspective", "PerspectiveAPI: some requests failed twice; they score 0.5 (the fork's value).")
        return [torch.tensor(1.0 - (0.5 if s is None else s)) for s in scores]
