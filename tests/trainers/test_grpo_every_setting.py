"""Every field of `trl_stable.GRPOConfig` does something, or is refused (or, where `trl.GRPOConfig` accepts it, warned
about) by name with what to use instead (issue 21, item 3; issue 23, item 5).

`TABLE` has one entry per field of ``dataclasses.fields(GRPOConfig)``: `TrainingArguments`', TRL's `GRPOConfig`'s and
trl_stable's own. `test_table_covers_every_field` fails, naming it, for a field a new transformers, TRL or trl_stable
adds. The kinds of entry and the shared probes are `setting_table.py`'s (which says what each kind shows), with
PPO's table (`test_ppo_every_setting.py`).

TRL's own fields (the loss, the sampling, the rewards' aggregation) are shown by `trl_probe`s: one short run of
`trl_stable.GRPOTrainer` and one of `trl.GRPOTrainer` with the field set, and the check is that the field changes the
trained weights (against our own run without it) and that the changed weights are TRL's, bit for bit. TRL tests what
each of them computes (its tests/test_grpo_trainer.py); this table shows the value reaches TRL's code path unchanged.
Fields that act only on hardware or launches this machine lacks (CUDA, several processes, vLLM, DeepSpeed ZeRO-3)
show that the value reaches the component that uses it, or are refused here with a clear error; their entries say so.
`docs/grpo.md` has the same table in words.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers.trainer
import trl
import trl.trainer.grpo_trainer as trl_grpo
from accelerate import ParallelismConfig
from accelerate.utils import DynamoBackend
from datasets import Dataset
from setting_table import (
    PROMPTS,
    TMP,
    Ctx,
    Effect,
    Kit,
    Recorder,
    Refused,
    Run,
    StepCounter,
    Warned,
    check,
    ddp_setting,
    dependent,
    id_reward,
    length_reward,
    record_method,
    stat,
    table_tests,
    training_argument_entries,
    training_argument_probes,
)
from transformers.debug_utils import DebugUnderflowOverflow

from trl_stable import GRPOConfig, GRPOTrainer
from trl_stable.rewards.dense import dense_reward
from trl_stable.rewards.failure_guard import RewardComponentFailure
from trl_stable.testing import MOE_FAMILIES, build_causal_lm, save_tiny

# Every probe's config: 4 prompts per step, 2 completions each, 4 tokens, one step, in float32 (TRL's default bf16
# needs use_cpu=True on a CPU, which the precision probe sets).
BASE = dict(
    per_device_train_batch_size=8,
    num_generations=2,
    max_completion_length=4,
    max_steps=1,
    logging_steps=1,
    bf16=False,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
)


def build(ctx: Ctx, args: GRPOConfig, model=None, rewards=(id_reward,), dataset=None, **kwargs) -> GRPOTrainer:
    model = build_causal_lm("qwen2", ctx.tokenizer, seed=0) if model is None else model
    dataset = Dataset.from_dict({"prompt": PROMPTS}) if dataset is None else dataset
    return GRPOTrainer(
        model=model,
        reward_funcs=list(rewards),
        args=args,
        train_dataset=dataset,
        processing_class=ctx.tokenizer,
        **kwargs,
    )


KIT = Kit(
    config_cls=GRPOConfig,
    base=BASE,
    build=build,
    model=lambda trainer: trainer.model,
    train_loader=lambda trainer: trainer.get_train_dataloader(),
    clear_cache_module=transformers.trainer,
    best_base={"learning_rate": 1e-3},  # with the shared lr 1e-2 the lowest eval reward is the last step's
)
PROBES = training_argument_probes()
probe = PROBES.register


# ---------------------------------------------------------------------------------------------------- TRL's fields
def _params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])


_TRL_RUNS: dict[tuple, dict] = {}  # (trainer, model family, settings) -> result: each default run once per process


def _model(ctx: Ctx, family: str, by_path: bool) -> Any:
    """A tiny model, or its saved folder (TRL builds the reference model of beta > 0 from the policy's path)."""
    model = build_causal_lm(family, ctx.tokenizer, seed=0)
    return save_tiny(ctx.tmp / f"{family}-policy", model, ctx.tokenizer) if by_path else model


def _trl_result(
    ctx: Ctx, trainer_cls, config_cls, settings: dict, family: str, by_path: bool, key_prefix: str
) -> dict:
    key = (key_prefix, family, by_path, repr(sorted(settings.items())))
    if key not in _TRL_RUNS:
        args = config_cls(output_dir=str(ctx.tmp / key_prefix), **{k: _resolved(v, ctx) for k, v in settings.items()})
        trainer = trainer_cls(
            model=_model(ctx, family, by_path),
            reward_funcs=[id_reward, length_reward],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=ctx.tokenizer,
        )
        trainer.train()
        logs = [e for e in trainer.state.log_history if "loss" in e]
        _TRL_RUNS[key] = {"params": _params(trainer), "logs": logs, "trainer": trainer}
    return _TRL_RUNS[key]


def _resolved(value: Any, ctx: Ctx) -> Any:
    return str(ctx.tmp) + value[len(TMP) :] if isinstance(value, str) and value.startswith(TMP) else value


def trl_probe(
    name: str, family: str = "qwen2", by_path: bool = False, setup: Callable[[Ctx], None] | None = None, **base
):
    """A probe of TRL's fields: our trainer and TRL's, both with `base` and the fields, and ours without the fields
    (the default runs are cached: every probe of a base shares them). The model is given by its folder with
    `by_path` (TRL builds a reference model from it); `setup(ctx)` runs first (e.g. a fake vLLM)."""

    @probe(name)
    def _(ctx, fields):
        if setup is not None:
            setup(ctx)
        settings = {**BASE, "learning_rate": 1e-2, **base}
        ours = _trl_result(ctx, GRPOTrainer, GRPOConfig, {**settings, **fields}, family, by_path, "ours")
        theirs = _trl_result(ctx, trl.GRPOTrainer, trl.GRPOConfig, {**settings, **fields}, family, by_path, "trl")
        default = _trl_result(ctx, GRPOTrainer, GRPOConfig, settings, family, by_path, "ours")
        trainer = ours["trainer"]
        return Run(trainer.args, trainer, seen={"ours": ours, "trl": theirs, "default": default})


def as_trl(observe: Callable[[dict], Any] = lambda result: result["params"]) -> Callable[[Run], None]:
    """The check of a `trl_probe`: the field changes what `observe` sees of the run (the trained weights unless said
    otherwise), and our trainer's weights and losses are `trl.GRPOTrainer`'s, bit for bit."""

    def check_as_trl(run: Run):
        ours, theirs, default = run.seen["ours"], run.seen["trl"], run.seen["default"]
        assert torch.equal(ours["params"], theirs["params"]), "trl_stable's weights differ from TRL's"
        assert [e["loss"] for e in ours["logs"]] == [e["loss"] for e in theirs["logs"]]
        seen, without = observe(ours), observe(default)
        changed = not torch.equal(seen, without) if torch.is_tensor(seen) else seen != without
        assert changed, "the setting changes nothing"

    return check_as_trl


def _logged(key: str) -> Callable[[dict], list]:
    return lambda result: [entry.get(key) for entry in result["logs"]]


# the second update of a generation batch has ratios away from 1, some of them inside the clip range
OFF_POLICY = dict(num_iterations=2, learning_rate=1e-3, max_steps=2)
for _name, _base in {
    "trl_loss": {"optim": "sgd"},  # the loss types differ in scale where every completion has the same length
    "trl_iterations": {"max_steps": 2},
    "trl_beta": {"max_steps": 2},  # the first step's KL and its gradient are 0: the policy is the reference
    "trl_sapo_neg": {"loss_type": "sapo", **OFF_POLICY},
    "trl_sapo_pos": {"loss_type": "sapo", **OFF_POLICY},
    "trl_vespo_k_pos": {"loss_type": "vespo", **OFF_POLICY},
    "trl_vespo_lambda_pos": {"loss_type": "vespo", **OFF_POLICY},
    "trl_vespo_k_neg": {"loss_type": "vespo", **OFF_POLICY},
    "trl_vespo_lambda_neg": {"loss_type": "vespo", **OFF_POLICY},
    "trl_epsilon": OFF_POLICY,
    "trl_epsilon_high": OFF_POLICY,
    "trl_delta": OFF_POLICY,
    "trl_is_level": OFF_POLICY,
    "trl_opsm": OFF_POLICY,
    "trl_entropy_quantile": {},
    "trl_entropy_coef": {},
    "trl_adaptive": {},
    "trl_entropy_target": {"use_adaptive_entropy": True},
    "trl_entropy_delta": {"use_adaptive_entropy": True, "entropy_target": 10.0, "max_steps": 2},
    "trl_entropy_max": {"use_adaptive_entropy": True, "entropy_target": 10.0},
    "trl_entropy_min": {"use_adaptive_entropy": True},
    "trl_scale": {},
    "trl_aggregation": {},
    "trl_weights": {},
    "trl_truncated": {},
    "trl_temperature": {},
    "trl_top_p": {},
    "trl_top_k": {},
    "trl_min_p": {},
    "trl_repetition": {},
    "trl_generation_kwargs": {},
    "trl_length": {},
    "trl_generations": {},
    "trl_generation_batch": {"max_steps": 2},
    "trl_steps_per_generation": {"max_steps": 2},
    "trl_shuffle": {},
    "trl_lm_head": {"bf16": True, "use_cpu": True},
}.items():
    trl_probe(_name, by_path=_name == "trl_beta", **_base)
trl_probe("trl_kl", by_path=True, beta=0.04, **OFF_POLICY)
trl_probe("trl_moe", family=MOE_FAMILIES[0])


class FakeVLLM:
    """Stands in for `trl.generation.vllm_generation.VLLMGeneration` (vLLM does not run on a CPU): records its
    constructor keywords; generates 4 fixed tokens per prompt with log-probs of its own (-6.5 each), a little above the
    trainer's, so the importance-sampling correction has something to correct (sequence ratios near 0.3)."""

    instances: list = []

    def __init__(self, model, accelerator, processing_class, **kwargs):
        self.kwargs = kwargs
        self.vllm_client = self  # server mode asks the server how it computes log-probs
        FakeVLLM.instances.append(self)

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        completions = [[20 + (i % 5) + t for t in range(4)] for i in range(len(prompts))]
        return prompts, completions, [[[-6.5] for _ in c] for c in completions], None


def _with_fake_vllm(ctx: Ctx) -> None:
    FakeVLLM.instances = []
    ctx.monkeypatch.setattr(trl_grpo, "VLLMGeneration", FakeVLLM)


for _name in ("vllm_correction", "vllm_is_mode", "vllm_clip_max", "vllm_clip_min", "vllm_cap"):
    trl_probe(_name, setup=_with_fake_vllm, use_vllm=True)


def _vllm_helper(ctx: Ctx, fields: dict, **base) -> Run:
    _with_fake_vllm(ctx)
    trainer = ctx.build(ctx.config(fields, **base))
    helper = FakeVLLM.instances[0] if FakeVLLM.instances else None
    return Run(trainer.args, trainer, seen={"kwargs": helper.kwargs if helper else {}})


@probe("vllm_colocate")
def _(ctx, fields):
    return _vllm_helper(ctx, fields)


@probe("vllm_server")
def _(ctx, fields):
    return _vllm_helper(ctx, fields, use_vllm=True)


@probe("vllm_host")
def _(ctx, fields):
    return _vllm_helper(ctx, fields, use_vllm=True, vllm_mode="server")


def _helper_got(name: str, value: Any) -> Callable[[Run], None]:
    return lambda run: check(run.seen["kwargs"].get(name) == value)


# ---------------------------------------------------------------------------------------------------- GRPO's probes
@probe("built", "compile", "accelerator", "parallelism", "dropout_off", "continuous_batching")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields))
    return Run(trainer.args, trainer)


@probe("activation_checkpointing", "gradient_checkpointing", "checkpoint_kwargs", "gc_kwargs", "neftune", "debug")
def _(ctx, fields):
    seen = {"embeddings": []}

    def noise(module, args, out):  # how far a training pass's embeddings are from the embedding table's rows
        if torch.is_grad_enabled():
            seen["embeddings"].append(float((out - module.weight[args[0]]).abs().max()))

    class AfterNeftune(transformers.TrainerCallback):
        """Hooks the embeddings once training starts: after NEFTune's own hook, so this one sees its noise."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.get_input_embeddings().register_forward_hook(noise)

    trainer = ctx.build(ctx.config(fields), callbacks=[AfterNeftune()])
    return Run(trainer.args, trainer, trainer.train(), seen)


def _checkpointed_layers(run: Run) -> list[tuple[bool, dict | None]]:
    return [
        (True, layer._gradient_checkpointing_func.keywords)
        if getattr(layer, "gradient_checkpointing", False)
        else (False, None)
        for layer in run.trainer.model.model.layers
    ]


def _loss_inputs(ctx: Ctx, trainer: GRPOTrainer, seen: list) -> None:
    """Record (rows, prompt width, completion width, grad enabled) of every loss call."""
    record_method(
        ctx,
        trainer,
        "_compute_loss",
        seen,
        lambda args, kwargs, out: (
            args[1]["completion_ids"].shape[0],
            args[1]["prompt_ids"].shape[1],
            args[1]["completion_ids"].shape[1],
            torch.is_grad_enabled(),
        ),
    )


@probe("batches", "padding")
def _(ctx, fields):
    recorder, calls = Recorder(), []
    trainer = ctx.build(ctx.config(fields), callbacks=[recorder])
    _loss_inputs(ctx, trainer, calls)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen.update(calls=calls, backward_per_step=sum(1 for c in calls if c[3]) / len(recorder.lrs))
    return run


def _projection_dtypes(trainer: GRPOTrainer, seen: list) -> None:
    """Record the output dtype of the first attention projection (bf16 under bf16 autocast)."""
    projection = trainer.model.model.layers[0].self_attn.q_proj
    projection.register_forward_hook(lambda module, args, out: seen.append(out.dtype))


@probe("precision", "precision_fp16")
def _(ctx, fields):
    dtypes = []
    trainer = ctx.build(ctx.config(fields))
    _projection_dtypes(trainer, dtypes)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["dtypes"] = set(dtypes)
    loader = trainer.get_train_dataloader()
    run.seen["pin_memory"] = getattr(loader, "base_dataloader", loader).pin_memory
    return run


def _eval_dataset(n: int = 3) -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS[:n]})


def _eval_rows(ctx: Ctx, trainer: GRPOTrainer, seen: list) -> None:
    record_method(
        ctx,
        trainer,
        "_generate_and_score_completions",
        seen,
        lambda args, kwargs, out: [row["prompt"] for row in args[0]] if not trainer.model.training else None,
    )


@probe("eval")
def _(ctx, fields):
    batches = []
    trainer = ctx.build(ctx.config(fields, max_steps=4), eval_dataset=_eval_dataset())
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["evals"] = [entry["step"] for entry in trainer.state.log_history if "eval_loss" in entry]
    _eval_rows(ctx, trainer, batches)
    trainer.evaluate()  # an explicit evaluation, after training
    run.seen["explicit_eval_batches"] = [len(b) for b in batches if b is not None]
    return run


@probe("eval_batches", "eval_accumulation")
def _(ctx, fields):
    batches, steps, moves = [], [], []
    trainer = ctx.build(ctx.config(fields, per_device_eval_batch_size=4), eval_dataset=_eval_dataset())
    _eval_rows(ctx, trainer, batches)
    step = trainer.prediction_step

    def prediction_step(*args, **kwargs):
        steps.append(trainer.gather_function.keywords.get("use_gather_object"))
        return step(*args, **kwargs)

    container = transformers.trainer.EvalLoopContainer
    to_cpu = container.to_cpu_and_numpy

    def to_cpu_and_numpy(self):  # when the accumulated losses leave the device: after how many eval steps
        moves.append(len(steps))
        return to_cpu(self)

    ctx.monkeypatch.setattr(trainer, "prediction_step", prediction_step)
    ctx.monkeypatch.setattr(container, "to_cpu_and_numpy", to_cpu_and_numpy)
    metrics = trainer.evaluate()
    seen = {"eval_batches": [len(b) for b in batches if b is not None], "gather": steps, "moves": moves}
    return Run(trainer.args, trainer, metrics, seen)


@probe("eval_generations")
def _(ctx, fields):
    batches = []
    trainer = ctx.build(ctx.config(fields, per_device_eval_batch_size=12), eval_dataset=_eval_dataset())
    _eval_rows(ctx, trainer, batches)
    trainer.evaluate()
    prompts = [p for b in batches if b is not None for p in b]
    return Run(trainer.args, trainer, seen={"per_prompt": {p: prompts.count(p) for p in prompts}})


@probe("full_eval_bf16", "full_eval_fp16")
def _(ctx, fields):
    dtypes = []
    trainer = ctx.build(ctx.config(fields, use_cpu=True), eval_dataset=_eval_dataset())
    trainer.model.register_forward_hook(lambda module, args, out: dtypes.append(next(module.parameters()).dtype))
    trainer.evaluate()
    return Run(trainer.args, trainer, seen={"dtypes": set(dtypes)})


@probe("nan_filter")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields, max_steps=2))
    original = trainer.training_step

    def first_step_nan(*args, **kwargs):  # the loss of a diverged step, as Trainer collects it
        loss = original(*args, **kwargs)
        return loss * math.nan if trainer.state.global_step == 0 else loss

    ctx.monkeypatch.setattr(trainer, "training_step", first_step_nan)
    return Run(trainer.args, trainer, trainer.train())


@probe("columns")
def _(ctx, fields):
    columns = []

    def column_reward(completion_ids, **kwargs):
        columns.append(set(kwargs))
        return id_reward(completion_ids)

    dataset = Dataset.from_dict({"prompt": PROMPTS, "topic": ["film"] * len(PROMPTS)})
    trainer = ctx.build(ctx.config(fields), rewards=(column_reward,), dataset=dataset)
    return Run(trainer.args, trainer, trainer.train(), {"columns": columns})


def _first_batch(trainer: GRPOTrainer) -> list[str]:
    return [row["prompt"] for row in next(iter(trainer.get_train_dataloader()))]


@probe("seed")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields))
    return Run(trainer.args, trainer, seen={"first_batch": _first_batch(trainer)})


def _sampled_order(seed: int) -> list[str]:
    """TRL's RepeatSampler by hand: a permutation of the prompts drawn with `seed`, 4 prompts a step, each twice."""
    order = torch.randperm(len(PROMPTS), generator=torch.Generator().manual_seed(seed)).tolist()
    return [PROMPTS[i] for i in order[:4] for _ in range(2)]


@probe("resume")
def _(ctx, fields):
    save = dict(save_strategy="steps", save_steps=1)
    first = ctx.build(ctx.config({}, **save), callbacks=[StepCounter()])
    loader = first.get_train_dataloader()
    epoch0 = [[row["prompt"] for row in batch] for batch in loader]
    first.train()  # one step: checkpoint-1
    counter, steps = StepCounter(), []
    trainer = ctx.build(ctx.config(fields, max_steps=2, **save), callbacks=[counter])
    record_method(
        ctx,
        trainer,
        "_generate_and_score_completions",
        steps,
        lambda args, kwargs, out: (trainer.state.global_step, [row["prompt"] for row in args[0]]),
    )
    run = Run(trainer.args, trainer, trainer.train(resume_from_checkpoint=str(ctx.tmp / "out" / "checkpoint-1")))
    counters = [c for c in trainer.callback_handler.callbacks if isinstance(c, StepCounter)]
    run.seen.update(epoch0=epoch0, steps=steps, counter=counter, counters=counters)
    return run


@probe("by_name")
def _(ctx, fields):
    calls = []
    path = save_tiny(ctx.tmp / "policy", build_causal_lm("qwen2", ctx.tokenizer, seed=0), ctx.tokenizer)
    create = trl_grpo.create_model_from_path

    def recording(model_id, **kwargs):
        calls.append(kwargs)
        return create(model_id, **kwargs)

    ctx.monkeypatch.setattr(trl_grpo, "create_model_from_path", recording)
    trainer = ctx.build(ctx.config(fields), model=path)
    return Run(trainer.args, trainer, seen={"calls": calls})


@probe("dropout")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields), model=build_causal_lm("gpt2", ctx.tokenizer, seed=0))  # dropout 0.1
    return Run(trainer.args, trainer)


@probe("sync_ref")
def _(ctx, fields):
    args = ctx.config(fields, beta=0.04, max_steps=2, learning_rate=1e-2)
    trainer = ctx.build(args, model=_model(ctx, "qwen2", by_path=True))
    initial = _params(trainer)
    run = Run(trainer.args, trainer, trainer.train())
    ref = torch.cat([p.detach().flatten() for p in trainer.ref_model.parameters()])
    run.seen.update(initial=initial, ref=ref, policy=_params(trainer))
    return run


@probe("completions")
def _(ctx, fields):
    printed = []
    ctx.monkeypatch.setattr(trl_grpo, "print_prompt_completions_sample", lambda *args, **kwargs: printed.append(args))
    run = ctx.train(fields)
    run.seen["printed"] = printed
    run.seen["tables"] = sorted(p.name for p in (Path(run.args.output_dir) / "completions").glob("*.parquet"))
    return run


@probe("completions_hub")
def _(ctx, fields):
    created, schedulers = [], []

    class Card:
        @classmethod
        def from_template(cls, **kwargs):
            return cls()

        def push_to_hub(self, repo_id):
            created.append(("card", repo_id))

    ctx.monkeypatch.setattr(trl_grpo, "create_repo", lambda repo_id, **kwargs: created.append(("repo", repo_id)))
    ctx.monkeypatch.setattr(trl_grpo, "DatasetCard", Card)
    ctx.monkeypatch.setattr(trl_grpo, "CommitScheduler", lambda **kwargs: schedulers.append(kwargs))
    trainer = ctx.build(ctx.config(fields, log_completions=True))
    return Run(trainer.args, trainer, seen={"created": created, "schedulers": schedulers})


@probe("chat")
def _(ctx, fields):
    calls = []
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = ctx.build(ctx.config(fields), dataset=dataset)
    record_method(ctx, ctx.tokenizer, "apply_chat_template", calls, lambda args, kwargs, out: dict(kwargs))
    return Run(trainer.args, trainer, trainer.train(), {"calls": calls})


def _postprocessed(ctx: Ctx, trainer: GRPOTrainer, seen: list) -> None:
    """Record each generation batch's rewards, dense rewards and advantages after trl_stable's post-processing."""
    original = trainer._postprocess_generation

    def recording(output, record):
        out = original(output, record)
        seen.append(
            {
                "rewards": record.rewards_per_func.clone(),
                "dense": None if record.dense_rewards is None else record.dense_rewards.clone(),
                "advantages": out[0]["advantages"].detach().clone(),
                "mask": out[0]["completion_mask"].clone(),
                "keys": set(out[0]),
            }
        )
        return out

    ctx.monkeypatch.setattr(trainer, "_postprocess_generation", recording)


def token_reward(completion_ids, **kwargs):
    """A reward in {0, .25, .5, .75, 1} the checks recompute from the completion tokens alone."""
    return [(sum(ids) % 5) / 4 for ids in completion_ids]


def _first_batch_after(ctx: Ctx, fields: dict, rewards=(token_reward,), **base) -> Run:
    batches = []
    trainer = ctx.build(ctx.config(fields, **base), rewards=rewards)
    _postprocessed(ctx, trainer, batches)
    return Run(trainer.args, trainer, trainer.train(), {"batch": batches[0]})


@probe("advantages", "estimator", "capture")
def _(ctx, fields):
    return _first_batch_after(ctx, fields)


@probe("ngrpo")
def _(ctx, fields):
    return _first_batch_after(ctx, fields, advantage_estimator="ngrpo")


def _hand_advantages(rewards: list[float], mean_level, std_level, loo: bool, unbiased: bool, eps: float) -> list:
    """trl_stable's normalization by hand (groups of 2 consecutive rows): (r - mean) / (std around it + eps)."""
    n = len(rewards)

    def members(i, level):
        return [j for j in range(n) if level == "batch" or j // 2 == i // 2]

    def mean(i):
        if mean_level is None:
            return 0.0
        others = [j for j in members(i, mean_level) if not (loo and j == i)]
        return sum(rewards[j] for j in others) / len(others)

    centered = [rewards[i] - mean(i) for i in range(n)]
    if std_level is None:
        return centered
    out = []
    for i in range(n):
        group = members(i, std_level)
        ss = sum(centered[j] ** 2 for j in group)
        std = math.sqrt(ss / (len(group) - 1 if unbiased else len(group)))
        out.append(centered[i] / (std + eps))
    return out


_LEVELS = {"batch": "batch", "group": "group", "none": None}
_PRESETS = {"grpo": ("group", "group", False), "rloo": ("group", None, True)}


def _check_advantages(run: Run, **override):
    args = run.args
    estimator = override.pop("estimator", args.advantage_estimator)
    mean_level, std_level, loo = _PRESETS[estimator]
    settings = {
        "mean_level": mean_level if args.advantage_mean_level is None else _LEVELS[args.advantage_mean_level],
        "std_level": std_level if args.advantage_std_level is None else _LEVELS[args.advantage_std_level],
        "loo": loo if args.advantage_leave_one_out is None else args.advantage_leave_one_out,
        "unbiased": args.advantage_std_unbiased,
        "eps": 1e-4 if args.advantage_eps is None else args.advantage_eps,
    }
    settings.update(override)
    rewards = run.seen["batch"]["rewards"][:, 0].tolist()
    expected = _hand_advantages(rewards, **settings)
    assert len(set(rewards)) > 1
    assert run.seen["batch"]["advantages"].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def _check_ngrpo(run: Run, r_max=None, num_virtual=None):
    """NGRPO by hand: each group with `num_virtual` virtual samples of reward r_max, unbiased std, eps 1e-6."""
    r_max = run.args.ngrpo_r_max if r_max is None else r_max
    k = run.args.ngrpo_num_virtual if num_virtual is None else num_virtual
    rewards = run.seen["batch"]["rewards"][:, 0].tolist()
    expected = []
    for g in range(0, len(rewards), 2):
        values = rewards[g : g + 2] + [r_max] * k
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        expected += [(r - mean) / (std + 1e-6) for r in rewards[g : g + 2]]
    assert run.seen["batch"]["advantages"].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@dense_reward
def first_token_bonus(completion_ids, **kwargs):
    return [[1.0 if t == 0 else 0.5 for t in range(len(ids))] for ids in completion_ids]


@probe("dense")
def _(ctx, fields):
    return _first_batch_after(ctx, fields, rewards=(token_reward, first_token_bonus))


def _check_dense(run: Run, coef=None, gamma=None):
    """Token advantages minus coef x the reward-to-go of the dense rewards (by hand) are one sequence advantage a row:
    GRPO's, of the sequence reward."""
    coef = run.args.dense_reward_coef if coef is None else coef
    gamma = run.args.dense_reward_gamma if gamma is None else gamma
    batch = run.seen["batch"]
    dense, mask, advantages = batch["dense"], batch["mask"], batch["advantages"]
    rewards = batch["rewards"][:, 0].tolist()
    sequence = _hand_advantages(rewards, "group", "group", False, True, 1e-4)
    for i in range(len(rewards)):
        length = int(mask[i].sum())
        to_go, total = [0.0] * length, 0.0
        for t in reversed(range(length)):
            total = float(dense[i, t]) + gamma * total
            to_go[t] = total
        expected = [sequence[i] + coef * g for g in to_go]
        assert advantages[i, :length].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


# Behaviour weights w = exp(logp_proximal - logp_sampler) the decoupled probes craft, per row (row 0, token 0: 8).
CRAFTED_WEIGHTS = [3.0, 0.3, 1.0, 0.05, 1.0, 1.0, 1.0, 1.0]


def _crafted(ctx: Ctx, fields: dict, level_probe: bool, **base) -> Run:
    """The sampler's log-probs moved so that the behaviour weights are `CRAFTED_WEIGHTS` (HF generation records
    them equal to the trainer's, weight 1)."""
    trainer = ctx.build(ctx.config(fields, **base))
    original, lengths = trainer._apply_decoupled_loss, []

    def crafted(output):
        lengths.extend(output["completion_mask"].sum(1).tolist())
        sampler = output["sampling_per_token_logps"]
        weights = torch.tensor(CRAFTED_WEIGHTS, dtype=sampler.dtype).unsqueeze(1).expand_as(sampler).clone()
        if level_probe:
            weights[0] = 1.0
            weights[0, 0] = 8.0
        output["sampling_per_token_logps"] = sampler - weights.log()
        return original(output)

    ctx.monkeypatch.setattr(trainer, "_apply_decoupled_loss", crafted)
    return Run(trainer.args, trainer, trainer.train(), {"lengths": lengths})


@probe("decoupled")
def _(ctx, fields):
    return _crafted(ctx, fields, level_probe=False)


@probe("decoupled_level")
def _(ctx, fields):
    return _crafted(ctx, fields, level_probe=True, use_decoupled_loss=True, token_filter="icepop")


def _clamped_share(run: Run, lower=None, upper=None) -> None:
    args_lower, args_upper = run.args.filter_bounds
    lower, upper = lower or args_lower, upper or args_upper
    lengths = run.seen["lengths"]
    out_of_band = sum(n for n, w in zip(lengths, CRAFTED_WEIGHTS) if not lower <= w <= upper)
    stat("token_filter/icepop/clamped_token_frac", lambda v: v == pytest.approx(out_of_band / sum(lengths)))(run)


def _masked_by_sequence(run: Run):
    # sequence level: rows 1 (0.3) and 3 (0.05) masked whole, row 0 kept (geometric mean 8^(1/n) <= 5)
    lengths = run.seen["lengths"]
    assert lengths[0] > 1
    share = (lengths[1] + lengths[3]) / sum(lengths)
    stat("token_filter/icepop/masked_token_frac", lambda v: v == pytest.approx(share))(run)


def broken_reward(completions, **kwargs):
    raise KeyError("topic")


@probe("failing_reward")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields, max_steps=2), rewards=(id_reward, broken_reward))
    run = Run(trainer.args, trainer)
    try:
        run.output = trainer.train()
    except RewardComponentFailure as err:
        run.seen["stopped"] = (trainer.state.global_step, str(err))
    return run


def nan_reward(completion_ids, **kwargs):
    return [math.nan if i % 4 == 0 else sum(c) / 1000 for i, c in enumerate(completion_ids)]


def big_reward(completion_ids, **kwargs):
    return [50.0 if i == 0 else sum(c) / 1000 for i, c in enumerate(completion_ids)]


@probe("nan_reward")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields), rewards=(nan_reward,))
    return Run(trainer.args, trainer, trainer.train())


@probe("big_reward")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields), rewards=(big_reward,))
    return Run(trainer.args, trainer, trainer.train())


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


@probe("zero_std")
def _(ctx, fields):
    trainer = ctx.build(
        ctx.config(fields, max_steps=2, health_monitor_kwargs={"patience": 1}), rewards=(constant_reward,)
    )
    return Run(trainer.args, trainer, trainer.train())


def half_constant(prompts, completion_ids, **kwargs):
    """Constant on the first half of the prompts (zero-variance groups), the completion's ids elsewhere."""
    return [1.0 if p in PROMPTS[:4] else sum(c) / 1000 for p, c in zip(prompts, completion_ids)]


@probe("refills")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields, dynamic_sampling=True), rewards=(half_constant,))
    return Run(trainer.args, trainer, trainer.train())


@probe("moe")
def _(ctx, fields):
    args = ctx.config(fields, num_iterations=2, max_steps=2)
    trainer = ctx.build(args, model=build_causal_lm(MOE_FAMILIES[0], ctx.tokenizer, seed=0))
    return Run(trainer.args, trainer, trainer.train())


@probe("health", "step_mask", "dynamic", "overlong", "health_off")
def _(ctx, fields):
    return ctx.train(fields, max_steps=2)


@probe("health_stop")
def _(ctx, fields):
    # grad_norm_vanishing (a critical alarm) holds from the first step when any grad norm counts as near zero
    return ctx.train(fields, max_steps=3, health_monitor_kwargs={"grad_norm_floor": 1e9, "patience": 1})


@probe("mismatch_threshold")
def _(ctx, fields):
    return ctx.train(fields, health_mismatch_monitor=True)


def _health(name: str, value: Any) -> Callable[[Run], None]:
    return lambda run: check(
        run.trainer.health_monitor is not None and getattr(run.trainer.health_monitor.config, name) == value
    )


# ---------------------------------------------------------------------------------------------------- the table
def _warned(value: Any, fix: str = "Leave it at", **kwargs) -> Warned:
    return Warned(value, fix, **kwargs)


def _trl(value: Any, probe_name: str, observe: Callable[[dict], Any] | None = None, note: str = "") -> Effect:
    return Effect(value, probe_name, as_trl() if observe is None else as_trl(observe), note)


def _trl_dependent(value, needs: str, probe_name: str, observe=None, off=None, note: str = "") -> Any:
    """A TRL field that acts with another option (warned about without it), shown by a `trl_probe` with it on."""
    observed = as_trl() if observe is None else as_trl(observe)
    return dependent(value, needs, probe_name, observed, off=off, note=note, warns=True)


def _warns(value, needs, probe_name=None, check_fn=None, off=None, note="", at="config") -> Any:
    """A `TrainingArguments` / TRL field that acts with another option, warned about without it."""
    return dependent(value, needs, probe_name, check_fn, off=off, note=note, warns=True, at=at)


_SHARED = training_argument_entries()
_WARNED_SHARED = {  # the TrainingArguments dependents both trainers share: warned about here (TRL accepts them)
    name: dependent(
        entry.value,
        entry.needs,
        entry.effect and entry.effect.probe,
        entry.effect and entry.effect.check,
        off=entry.off,
        note=entry.note,
        warns=True,
    )  # fmt: skip
    for name, entry in _SHARED.items()
    if type(entry).__name__ == "Dependent"
}

# GRPO's schedule is TRL's "linear", which warms up: the schedule arguments are ignored with "constant"
for _name in ("warmup_steps", "lr_scheduler_kwargs"):
    _WARNED_SHARED[_name] = dataclasses.replace(_WARNED_SHARED[_name], off={"lr_scheduler_type": "constant"})

TABLE: dict[str, Any] = {
    **_SHARED,
    **_WARNED_SHARED,
    # --- batch structure (TRL's: a step's micro-batch, accumulation, generation batch)
    "per_device_train_batch_size": Effect(
        2,
        "batches",
        lambda run: check({c[0] for c in run.seen["calls"] if c[3]} == {2}),
        note="completions per loss pass (a multiple of num_generations' share per step)",
    ),
    "gradient_accumulation_steps": Effect(
        2,
        "batches",
        lambda run: check(run.seen["backward_per_step"] == 2),
        note="loss passes (micro-batches) per optimizer step",
    ),
    "average_tokens_across_devices": _warned(False),
    "ddp_find_unused_parameters": Effect(
        True,
        "ddp",
        ddp_setting("find_unused_parameters", True),
        note="multi-process only: reaches accelerate's DDP kwargs handler (transformers' default is off with TRL's "
        "activation checkpointing)",
    ),
    "label_smoothing_factor": _warned(0.1),
    # --- precision and memory
    "bf16": Effect(
        True,
        "precision",
        lambda run: check(run.trainer.accelerator.mixed_precision == "bf16" and torch.bfloat16 in run.seen["dtypes"]),
        note="on CPU with use_cpu=True (transformers requires it for bf16 there); TRL's default is bf16=True",
    ),
    "use_cpu": Effect(
        True,
        "precision",
        lambda run: check(run.args.device.type == "cpu" and run.seen["pin_memory"] is False),
        note="this machine has no accelerator: the visible effect is transformers switching pinned memory off",
    ),
    "bf16_full_eval": Effect(True, "full_eval_bf16", lambda run: check(run.seen["dtypes"] == {torch.bfloat16})),
    "fp16_full_eval": Effect(True, "full_eval_fp16", lambda run: check(run.seen["dtypes"] == {torch.float16})),
    "activation_checkpointing": Effect(
        False,
        "activation_checkpointing",
        lambda run: check(not run.trainer.model.is_gradient_checkpointing),
        note="TRL's default is on (gradient_checkpointing=True)",
    ),
    "gradient_checkpointing": Effect(
        False,
        "gradient_checkpointing",
        lambda run: check(not run.trainer.model.is_gradient_checkpointing),
        note="transformers' deprecated alias of activation_checkpointing",
    ),
    "activation_checkpointing_kwargs": _warns(
        {"use_reentrant": True},
        "activation_checkpointing=True",
        "checkpoint_kwargs",
        lambda run: check(_checkpointed_layers(run)[0] == (True, {"use_reentrant": True})),
        off={"activation_checkpointing": False},
        note="every_n_layers and offload are warned about: TRL re-enables checkpointing on every layer without them",
    ),
    "gradient_checkpointing_kwargs": _warns(
        {"use_reentrant": True},
        "activation_checkpointing=True",
        "gc_kwargs",
        lambda run: check(_checkpointed_layers(run)[0] == (True, {"use_reentrant": True})),
        off={"activation_checkpointing": False},
    ),
    "torch_compile": Effect(
        True,
        "compile",
        lambda run: check(run.trainer.accelerator.state.dynamo_plugin.backend != DynamoBackend.NO),
        note="accelerate compiles the model when training starts (a CPU compile takes minutes: not run here)",
    ),
    "torch_compile_backend": Effect(
        "eager",
        "compile",
        lambda run: check(run.trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.EAGER),
    ),
    "torch_compile_mode": Effect(
        "reduce-overhead",
        "compile",
        lambda run: check(run.trainer.accelerator.state.dynamo_plugin.mode == "reduce-overhead"),
    ),
    "use_liger_kernel": Refused(
        True, "pip install liger-kernel", at="train", note="liger-kernel is not installed here (TRL: deprecated)"
    ),
    "liger_kernel_config": _warns({"rope": True}, "use_liger_kernel=True", note="liger-kernel is not installed here"),
    "use_cache": Effect(
        True,
        "built",
        lambda run: check(run.trainer.model.config.use_cache is True),
        note="Trainer sets the model's config.use_cache (saved with it); TRL's log-prob passes never build a cache",
    ),
    "neftune_noise_alpha": Effect(
        5.0,
        "neftune",
        lambda run: check(run.seen["embeddings"] and min(run.seen["embeddings"]) > 0),
        note="noise on the input embeddings of the training passes",
    ),
    "auto_find_batch_size": Refused(True, "lower per_device_train_batch_size", note="TRL refuses it"),
    # --- logging
    "logging_nan_inf_filter": Effect(False, "nan_filter", lambda run: check(math.isnan(run.output.training_loss))),
    "include_num_input_tokens_seen": Effect(
        "non_padding",
        "plain",
        lambda run: check(run.logs[-1].get("num_input_tokens_seen") == run.trainer.state.num_input_tokens_seen > 0),
        note="logged from TRL's own count of prompt and completion tokens (transformers warns it cannot count a "
        "GRPO batch itself), so 'all' and 'non_padding' count the same",
    ),
    # --- evaluation
    "eval_strategy": Effect("steps", "eval", lambda run: check(any(s > 0 for s in run.seen["evals"]))),
    "eval_steps": _warns(
        2, "eval_strategy='steps'", "eval", lambda run: check(4 in run.seen["evals"] and 3 not in run.seen["evals"])
    ),
    "eval_delay": _warns(
        3,
        "eval_strategy='steps' or 'epoch'",
        "eval",
        lambda run: check(2 not in run.seen["evals"] and 4 in run.seen["evals"]),
    ),
    "per_device_eval_batch_size": Effect(
        2, "eval", lambda run: check(run.seen["explicit_eval_batches"] == [2, 2, 2]), note="rows: 3 prompts x 2"
    ),
    "eval_on_start": Effect(True, "eval", lambda run: check(0 in run.seen["evals"])),
    "dataloader_drop_last": Effect(True, "eval_batches", lambda run: check(run.seen["eval_batches"] == [4])),
    "eval_accumulation_steps": Effect(
        1,
        "eval_accumulation",
        lambda run: check(run.seen["moves"] and min(run.seen["moves"]) < len(run.seen["gather"])),
        note="the accumulated losses leave the device every that many steps (not only at the end)",
    ),
    "eval_use_gather_object": Effect(
        True,
        "eval_batches",
        lambda run: check(run.seen["gather"] and all(g is True for g in run.seen["gather"])),
        note="multi-process only: the eval losses are gathered with accelerate's gather_object",
    ),
    "prediction_loss_only": _warned(True),
    "eval_do_concat_batches": _warned(False),
    "include_for_metrics": _warned(["inputs"]),
    "batch_eval_metrics": _warned(True),
    "label_names": _warned(["labels"]),
    # --- checkpoints and resume
    "ignore_data_skip": Effect(
        True,
        "resume",
        lambda run: check(run.seen["steps"] and run.seen["steps"][0] == (1, run.seen["epoch0"][0])),
    ),
    "restore_callback_states_from_checkpoint": Effect(
        True,
        "resume",
        lambda run: check(
            run.seen["counter"] not in run.seen["counters"] and [c.steps for c in run.seen["counters"]] == [2]
        ),
    ),
    "resume_from_checkpoint": _warned(
        f"{TMP}/out/checkpoint-1",
        "trainer.train(resume_from_checkpoint=",
        at="train",
        note="not read by train(), as in transformers and TRL: the field is for your script",
    ),
    # --- randomness and data
    "seed": Effect(7, "seed", lambda run: check(run.seen["first_batch"] == _sampled_order(7))),
    "data_seed": _warned(5, "set seed instead"),
    "train_sampling_strategy": _warned("sequential", "shuffle_dataset=False"),
    "length_column_name": _warned("n_tokens"),
    "remove_unused_columns": Effect(
        True,
        "columns",
        lambda run: check(run.seen["columns"] and all("topic" not in c for c in run.seen["columns"])),
        note="TRL's default keeps every column for the reward functions",
    ),
    # --- hardware, accelerate and engines
    "accelerator_config": Effect(
        {"even_batches": False, "non_blocking": True, "dispatch_batches": False},
        "accelerator",
        lambda run: check(
            (run.trainer.accelerator.even_batches, run.trainer.accelerator.non_blocking) == (False, True)
            and run.trainer.accelerator.dispatch_batches is False
        ),
    ),
    "parallelism_config": Effect(
        ParallelismConfig(),
        "parallelism",
        lambda run: check(run.trainer.accelerator.parallelism_config is not None),
        note="reaches accelerate's Accelerator; sizes above 1 need a multi-process launch (TRL refuses cp / sp)",
    ),
    "debug": Effect(
        "underflow_overflow",
        "debug",
        lambda run: check(
            any(
                isinstance(getattr(h, "__self__", None), DebugUnderflowOverflow)
                for h in run.trainer.model._forward_hooks.values()
            )
        ),
    ),
    "do_train": _warned(True, "trainer.train()"),
    "do_eval": _warned(True, "eval_strategy='steps'"),
    "do_predict": _warned(True, "trainer.predict("),
    "local_rank": _warned(1, "Leave it at -1", note="the launcher's local rank must match accelerate's"),
    # --- TRL: models
    "model_init_kwargs": Effect(
        {"attn_implementation": "eager"},
        "by_name",
        lambda run: check(run.trainer.model.config._attn_implementation == "eager"),
        note="with a model object TRL warns that it ignores it (the reference model is still built with it)",
    ),
    "trust_remote_code": Effect(
        True,
        "by_name",
        lambda run: check(run.seen["calls"] and all(c.get("trust_remote_code") is True for c in run.seen["calls"])),
        note="reaches TRL's from_pretrained calls (model, reference, reward models, processor by name)",
    ),
    "router_aux_loss_coef": _trl(0.5, "trl_moe", note="the MoE load-balancing loss's weight"),
    "disable_dropout": Effect(
        True,
        "dropout",
        lambda run: check(not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in run.trainer.model.modules())),
    ),
    "cast_lm_head_to_fp32": _trl(True, "trl_lm_head", note="under bf16 autocast the logits are computed in float32"),
    # --- TRL: generation
    "num_generations": _trl(4, "trl_generations"),
    "num_generations_eval": Effect(
        4,
        "eval_generations",
        lambda run: check(run.seen["per_prompt"] and set(run.seen["per_prompt"].values()) == {4}),
    ),
    "max_completion_length": _trl(2, "trl_length"),
    "ds3_gather_for_generation": _warns(False, "DeepSpeed ZeRO-3", note="ZeRO-3 needs a multi-process launch"),
    "shuffle_dataset": _trl(False, "trl_shuffle"),
    "pad_to_multiple_of": Effect(
        8,
        "padding",
        lambda run: check(run.seen["calls"] and all(c[1] % 8 == 0 and c[2] % 8 == 0 for c in run.seen["calls"])),
        note="'auto' (the default) pads only on Neuron",
    ),
    "generation_batch_size": _trl(16, "trl_generation_batch"),
    "steps_per_generation": _trl(2, "trl_steps_per_generation"),
    "temperature": _trl(2.0, "trl_temperature"),
    "top_p": _trl(0.5, "trl_top_p"),
    "top_k": _trl(2, "trl_top_k"),
    "min_p": _trl(0.9, "trl_min_p"),
    "generation_kwargs": _trl({"max_new_tokens": 2}, "trl_generation_kwargs"),
    "chat_template_kwargs": Effect(
        {"enable_thinking": False},
        "chat",
        lambda run: check(run.seen["calls"] and all(c.get("enable_thinking") is False for c in run.seen["calls"])),
        note="conversational prompts only: passed to the chat template",
    ),
    "repetition_penalty": _trl(0.01, "trl_repetition", note="the tiny model's logits are near 0: a factor 100"),
    "cache_implementation": _warns(
        "static",
        "use_vllm=False",
        "built",
        lambda run: check(run.trainer.generation_config.cache_implementation == "static"),
        off={"use_vllm": True},
        note="reaches the GenerationConfig TRL's HF generate() uses",
    ),
    "max_tool_calling_iterations": _warns(
        1,
        "tools",
        at="trainer",
        note="acts in TRL's tool-calling loop, which needs a chat template that renders tool calls (the tiny "
        "tokenizer's does not); warned about by GRPOTrainer without tools",
    ),
    # --- TRL: the loss
    "beta": _trl(0.04, "trl_beta"),
    "num_iterations": _trl(2, "trl_iterations"),
    "epsilon": _trl_dependent(0.01, "a clipped loss_type", "trl_epsilon", off={"loss_type": "sapo"}),
    "epsilon_high": _trl_dependent(0.01, "a clipped loss_type", "trl_epsilon_high", off={"loss_type": "vespo"}),
    "delta": _trl_dependent(
        1.0001, "a loss_type that clips the ratio", "trl_delta", off={"loss_type": "cispo"}, note="the two-sided clip"
    ),
    "sapo_temperature_neg": _trl_dependent(4.0, "loss_type='sapo'", "trl_sapo_neg"),
    "sapo_temperature_pos": _trl_dependent(4.0, "loss_type='sapo'", "trl_sapo_pos"),
    "vespo_k_pos": _trl_dependent(0.5, "loss_type='vespo'", "trl_vespo_k_pos"),
    "vespo_lambda_pos": _trl_dependent(0.5, "loss_type='vespo'", "trl_vespo_lambda_pos"),
    "vespo_k_neg": _trl_dependent(0.5, "loss_type='vespo'", "trl_vespo_k_neg"),
    "vespo_lambda_neg": _trl_dependent(0.5, "loss_type='vespo'", "trl_vespo_lambda_neg"),
    "importance_sampling_level": _trl("sequence", "trl_is_level"),
    "loss_type": _trl("luspo", "trl_loss", note="a sum over each sequence's tokens, not their mean"),
    "mask_truncated_completions": _trl(True, "trl_truncated", note="every completion here stops at the cap"),
    "top_entropy_quantile": _trl(0.5, "trl_entropy_quantile"),
    "off_policy_mask_threshold": _trl(0.0, "trl_opsm"),
    "use_bias_correction_kl": _trl_dependent(False, "beta > 0", "trl_kl"),
    "sync_ref_model": Effect(
        True,
        "sync_ref",
        lambda run: check(
            any(type(c).__name__ == "SyncRefModelCallback" for c in run.trainer.callback_handler.callbacks)
        ),
        note="TRL refuses it with beta=0",
    ),
    "ref_model_mixup_alpha": _warns(
        1.0,
        "sync_ref_model=True",
        "sync_ref",
        lambda run: check(run.seen.get("ref") is not None and torch.equal(run.seen["ref"], run.seen["policy"])),
        note="alpha 1 makes the reference the policy at each sync",
    ),
    "ref_model_sync_steps": _warns(
        1,
        "sync_ref_model=True",
        "sync_ref",
        lambda run: check(run.seen.get("ref") is not None and not torch.equal(run.seen["ref"], run.seen["initial"])),
        note="the default (512) syncs no time in 2 steps",
    ),
    "entropy_coef": _trl(0.01, "trl_entropy_coef"),
    "use_adaptive_entropy": _trl(True, "trl_adaptive", _logged("entropy_coef")),
    "entropy_coef_min": _trl_dependent(0.5, "use_adaptive_entropy=True", "trl_entropy_min", _logged("entropy_coef")),
    "entropy_coef_max": _trl_dependent(0.001, "use_adaptive_entropy=True", "trl_entropy_max", _logged("entropy_coef")),
    "entropy_coef_delta": _trl_dependent(0.1, "use_adaptive_entropy=True", "trl_entropy_delta"),
    "entropy_target": _trl_dependent(10.0, "use_adaptive_entropy=True", "trl_entropy_target", _logged("entropy_coef")),
    # --- TRL: rewards
    "reward_weights": _trl([2.0, 0.5], "trl_weights"),
    "multi_objective_aggregation": _trl("normalize_then_sum", "trl_aggregation", note="GDPO, computed by TRL"),
    "scale_rewards": _trl("batch", "trl_scale"),
    # --- TRL: logging
    "log_completions": Effect(
        True,
        "completions",
        lambda run: check(run.seen["tables"] and run.seen["printed"]),
        note="a parquet table a log in output_dir/completions, and a rich table printed",
    ),
    "num_completions_to_print": _warns(
        1,
        "log_completions=True",
        "completions",
        lambda run: check(run.seen["printed"] and all(args[5] == 1 for args in run.seen["printed"])),
    ),
    "log_multimodal": _warns(
        False, "log_completions=True", note="images of the prompts in the completions table: multimodal data only"
    ),
    "log_unique_prompts": _warns(
        True, "log_completions=True", note="deduplicates the wandb / trackio completions table (neither installed)"
    ),
    "log_completions_hub_repo": dependent(
        "me/completions",
        "log_completions",
        "completions_hub",
        lambda run: check(("repo", "me/completions") in run.seen["created"] and run.seen["schedulers"]),
        note="TRL refuses it without log_completions; the Hub calls are recorded here",
    ),
    # --- TRL: other generation back-ends
    "use_transformers_continuous_batching": Effect(
        True,
        "continuous_batching",
        lambda run: check(run.trainer.use_transformers_continuous_batching and run.trainer.continuous_batching_config),
        note="generation through transformers' generate_batch (test_continuous_batching_step runs one, slow)",
    ),
    "use_transformers_paged": Effect(
        True,
        "continuous_batching",
        lambda run: check(run.args.use_transformers_continuous_batching),
        note="TRL's deprecated name of use_transformers_continuous_batching",
    ),
    "transformers_continuous_batching_config": _warns(
        {"max_memory_percent": 0.2},
        "use_transformers_continuous_batching=True",
        "continuous_batching",
        lambda run: check(
            run.trainer.continuous_batching_config is not None
            and run.trainer.continuous_batching_config.max_memory_percent == 0.2
        ),
    ),
    # --- TRL: vLLM (TRL's helper replaced by a fake: vLLM does not run on a CPU)
    "use_vllm": Effect(True, "vllm_colocate", lambda run: check(FakeVLLM.instances and run.trainer.use_vllm)),
    "vllm_mode": _warns("server", "use_vllm=True", "vllm_server", _helper_got("mode", "server")),
    "vllm_model_impl": _warns(
        "transformers", "use_vllm=True", "vllm_colocate", _helper_got("model_impl", "transformers")
    ),
    "vllm_enable_sleep_mode": _warns(True, "use_vllm=True", "vllm_colocate", _helper_got("enable_sleep_mode", True)),
    "vllm_structured_outputs_regex": _warns(
        "[ab]+", "use_vllm=True", "vllm_colocate", _helper_got("structured_outputs_regex", "[ab]+")
    ),
    "vllm_server_base_url": _warns(
        "http://vllm:9", "use_vllm=True", "vllm_server", _helper_got("server_base_url", "http://vllm:9")
    ),
    "vllm_server_host": _warns("vllm-host", "use_vllm=True", "vllm_host", _helper_got("server_host", "vllm-host")),
    "vllm_server_port": _warns(9, "use_vllm=True", "vllm_host", _helper_got("server_port", 9)),
    "vllm_server_timeout": _warns(5.0, "use_vllm=True", "vllm_server", _helper_got("server_timeout", 5.0)),
    "vllm_group_port": _warns(5, "use_vllm=True", "vllm_server", _helper_got("group_port", 5)),
    "vllm_gpu_memory_utilization": _warns(
        0.5, "use_vllm=True", "vllm_colocate", _helper_got("gpu_memory_utilization", 0.5)
    ),
    "vllm_max_model_length": _warns(64, "use_vllm=True", "vllm_colocate", _helper_got("max_model_length", 64)),
    "vllm_tensor_parallel_size": _warns(2, "use_vllm=True", "vllm_colocate", _helper_got("tensor_parallel_size", 2)),
    "vllm_importance_sampling_correction": _trl_dependent(False, "use_vllm=True", "vllm_correction"),
    "vllm_importance_sampling_mode": _trl_dependent("token_truncate", "use_vllm=True", "vllm_is_mode"),
    "vllm_importance_sampling_clip_max": _trl_dependent(0.1, "use_vllm=True", "vllm_clip_max"),
    "vllm_importance_sampling_clip_min": _trl_dependent(0.5, "use_vllm=True", "vllm_clip_min"),
    "vllm_importance_sampling_cap": _trl_dependent(
        0.1, "use_vllm=True", "vllm_cap", note="TRL's deprecated name of vllm_importance_sampling_clip_max"
    ),
    # --- trl_stable: advantages
    "advantage_estimator": Effect("rloo", "estimator", lambda run: _check_advantages(run, estimator="rloo")),
    "advantage_mean_level": Effect("batch", "advantages", lambda run: _check_advantages(run, mean_level="batch")),
    "advantage_std_level": Effect("batch", "advantages", lambda run: _check_advantages(run, std_level="batch")),
    "advantage_leave_one_out": Effect(True, "advantages", lambda run: _check_advantages(run, loo=True)),
    "advantage_std_unbiased": dependent(
        False,
        "an advantage std",
        "advantages",
        lambda run: _check_advantages(run, unbiased=False),
        off={"advantage_estimator": "rloo"},
    ),  # fmt: skip
    "advantage_eps": dependent(
        0.5,
        "an advantage std",
        "advantages",
        lambda run: _check_advantages(run, eps=0.5),
        off={"advantage_estimator": "rloo"},
    ),  # fmt: skip
    "ngrpo_r_max": dependent(2.0, "advantage_estimator='ngrpo'", "ngrpo", lambda run: _check_ngrpo(run, r_max=2.0)),
    "ngrpo_num_virtual": dependent(
        2, "advantage_estimator='ngrpo'", "ngrpo", lambda run: _check_ngrpo(run, num_virtual=2)
    ),
    # --- trl_stable: the decoupled loss and its token filter (the sampler's log-probs crafted)
    "use_decoupled_loss": Effect(
        True,
        "decoupled",
        stat("behaviour_weight/max", lambda v: v == pytest.approx(max(CRAFTED_WEIGHTS), rel=1e-4)),
    ),
    "token_filter": dependent(
        "icepop",
        "use_decoupled_loss=True",
        "decoupled",
        lambda run: check(any(k.startswith("token_filter/icepop/") for k in run.logs[0])),
    ),
    "token_filter_level": dependent("sequence", "token_filter='icepop'", "decoupled_level", _masked_by_sequence),
    "token_filter_action": dependent(
        "clamp",
        "token_filter='icepop'",
        "decoupled",
        lambda run: check("token_filter/icepop/clamped_token_frac" in run.logs[0]),
    ),
    "token_filter_lower": dependent(
        0.2, "token_filter='icepop'", "decoupled", lambda run: _clamped_share(run, lower=0.2)
    ),
    "token_filter_upper": dependent(
        2.0, "token_filter='icepop'", "decoupled", lambda run: _clamped_share(run, upper=2.0)
    ),
    "capture_sampler_logps": dependent(
        True,
        "HF generation",
        "capture",
        lambda run: check("sampling_per_token_logps" in run.seen["batch"]["keys"]),
        off={"use_vllm": True},
        note="with vLLM the sampler's log-probs come from vLLM",
    ),
    # --- trl_stable: rewards
    "dynamic_sampling": Effect(True, "dynamic", stat("dynamic_sampling/frac_groups_dropped", lambda v: v >= 0)),
    "dynamic_sampling_max_refills": dependent(
        1,
        "dynamic_sampling=True",
        "refills",
        stat("dynamic_sampling/refill_rounds", lambda v: v == 1),
    ),
    "overlong_penalty_tokens": Effect(
        2,
        "overlong",
        lambda run: stat("rewards/overlong_penalty/mean", lambda v: v == -run.args.overlong_penalty_factor)(run),
        note="every completion here ends at max_completion_length: the full penalty",
    ),
    "overlong_penalty_factor": dependent(
        0.5,
        "overlong_penalty_tokens set",
        "overlong",
        stat("rewards/overlong_penalty/mean", lambda v: v == -0.5),
        note="every completion here ends at max_completion_length: the full penalty",
    ),
    "dense_reward_coef": dependent(
        0.5, "a dense reward function", "dense", lambda run: _check_dense(run, coef=0.5), at="trainer"
    ),
    "dense_reward_gamma": dependent(
        0.5, "a dense reward function", "dense", lambda run: _check_dense(run, gamma=0.5), at="trainer"
    ),
    "nan_reward_action": Effect("drop", "nan_reward", stat("rewards/nan_dropped", lambda v: v == 2)),
    "reward_max_failing_steps": Effect(
        1,
        "failing_reward",
        lambda run: check(
            run.seen.get("stopped", (None, ""))[0] == 0 and "'broken_reward' failed" in run.seen["stopped"][1]
        ),
        note="the default (5) lets the 2-step run finish with its completions unscored",
    ),
    "max_abs_reward": Effect(10.0, "big_reward", stat("rewards/big_reward/out_of_range", lambda v: v == 1)),
    # --- trl_stable: agent steps and MoE
    "step_loss_mask": Effect(True, "step_mask", stat("step_mask/frac_invalid_steps", lambda v: v >= 0)),
    "step_mask_tools": dependent(
        ["search"],
        "step_loss_mask=True",
        "step_mask",
        lambda run: check(run.trainer.step_masker is not None and "search" in run.trainer.step_masker.tools),
    ),
    "routing_replay": dependent(
        "R2",
        "num_iterations > 1",
        "moe",
        lambda run: check(any(k.startswith("routing/") for k in run.logs[-1])),
        note="R2 records in the old-logprob pass, which on-policy GRPO skips ('R3' replays the sampler's routing)",
    ),
    # --- trl_stable: the health monitor
    "health_monitor": Effect(
        False,
        "health_off",
        lambda run: check(
            run.trainer.health_monitor is None and not any(k.startswith("health/") for k in run.logs[0])
        ),
    ),
    "health_reward_max": dependent(
        -100.0,
        "health_monitor=True",
        "health",
        lambda run: check(run.logs[-1].get("health/alarm/reward_above_max") == 1),
        off={"health_monitor": False},
    ),
    "health_mismatch_threshold": dependent(
        0.5,
        "health_mismatch_monitor=True",
        "mismatch_threshold",
        _health("mismatch_threshold", 0.5),
        note="the mismatch alarm's threshold on mismatch/*",
    ),
    "health_remedy_virtual_samples": dependent(
        True,
        "health_monitor=True",
        "zero_std",
        lambda run: check(
            run.trainer.health_monitor.remedy_active and run.logs[-1].get("health/remedy/virtual_samples") == 1
        ),
        off={"health_monitor": False},
        note="trains with NGRPO virtual samples while the zero-std alarm holds",
    ),
    "health_stop_after_critical_steps": dependent(
        1,
        "health_monitor=True",
        "health_stop",
        lambda run: check(run.trainer.state.global_step < run.args.max_steps),
        off={"health_monitor": False},
    ),
    "health_mismatch_monitor": dependent(
        True,
        "HF generation or vLLM",
        "health",
        lambda run: check(any(k.startswith("mismatch/") for k in run.logs[0])),
        off={"use_transformers_continuous_batching": True},
    ),
    "health_monitor_kwargs": dependent(
        {"patience": 1}, "health_monitor=True", "health", _health("patience", 1), off={"health_monitor": False}
    ),
}


# ---------------------------------------------------------------------------------------------------- the tests
globals().update(table_tests(KIT, TABLE, PROBES, Path(__file__).resolve().parents[2] / "docs" / "grpo.md"))
