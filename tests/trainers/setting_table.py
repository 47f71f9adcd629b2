"""The shape the every-setting tests share (`test_ppo_every_setting.py`, `test_grpo_every_setting.py`): the kinds of
table entry, the probes and entries of `TrainingArguments`' fields that act the same in both trainers, and the tests
that enumerate a table.

A test module builds a `Kit` (its config class, the base settings of every probe, how to build its trainer), a
`TABLE` with one entry per ``dataclasses.fields(config class)`` (`training_argument_entries()` gives those of the
fields both trainers honour alike), its own `Probes` on top of `training_argument_probes()`, and then takes the tests
with ``globals().update(table_tests(KIT, TABLE, PROBES, docs_page))``. An entry is one of:

- `Effect(value, probe, check)`: the probe (a tiny run) is run twice, with the fields of the probe at their table
  values and without them; `check` must pass on the first run and fail on the second, so each check shows an effect
  that is absent at the default. Probes group fields where one run honestly shows several effects.
- `Refused(value, fix)`: building the config with ``field=value`` (or, ``at="trainer"``, building the trainer) raises a
  ValueError (or ImportError) whose message names the field and says what to use instead (`fix`, a piece of it).
- `Dependent(value, needs, effect)`: a setting that only acts together with another option is refused without it
  (``warns=True``: a `trl_stable.settings.checks.IgnoredSettingWarning` instead), the message naming the field and the
  option (`needs`); `effect` shows what it does with the option on.
- `Warned(value, fix)`: a setting the trainer has nothing to apply to, accepted (TRL accepts it) with an
  `IgnoredSettingWarning` naming the field and what to do instead.

Imported by module name: pytest puts this folder on `sys.path` when it collects the test files next to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import signal
import warnings
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import transformers
import transformers.integrations.integration_utils as integrations
import transformers.trainer
import transformers.training_args
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.trainer_callback import ExportableState, PrinterCallback, ProgressCallback
from transformers.trainer_jit_checkpoint import JITCheckpointCallback
from transformers.utils import is_torch_tf32_available

from trl_stable.settings.checks import IgnoredSettingWarning
from trl_stable.trainers.checkpoints import MARKER_FILE

PROMPTS = [
    "The movie was",
    "A story about a dog",
    "I think that",
    "We saw the long film yesterday",
    "Nobody",
    "The plot of the film was thin",
    "Great acting and",
    "She said",
]
SECRET = "hf_FieldTableSecret0123456789"
TMP = "<tmp>"  # a table value under the run's temporary folder
UNSUPPORTED = "Leave it at"


def length_reward(completion_ids, **kwargs):
    return [float(len(c)) for c in completion_ids]


def id_reward(completion_ids, **kwargs):
    return [sum(c) / 1000.0 for c in completion_ids]


# ---------------------------------------------------------------------------------------------------- the table kinds
STEP_KEYS = ("loss", "loss/total")  # what a training step's log entry has (GRPO, PPO): evaluations and summaries not


@dataclass
class Run:
    """What a probe observed: the config, the trainer (None for config-only probes), `train()`'s output and
    whatever the probe recorded."""

    args: Any
    trainer: Any = None
    output: Any = None
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def logs(self) -> list[dict]:
        """The training steps' entries of the trainer's log history."""
        return [e for e in self.trainer.state.log_history if any(key in e for key in STEP_KEYS)]


@dataclass(frozen=True)
class Effect:
    value: Any
    probe: str
    check: Callable[[Run], None]
    note: str = ""


@dataclass(frozen=True)
class Refused:
    value: Any
    fix: str
    at: str = "config"  # "config": the config raises; "trainer" / "train": building / training the trainer raises
    note: str = ""


@dataclass(frozen=True)
class Dependent:
    value: Any
    needs: str
    effect: Effect | None
    off: dict = field(default_factory=dict)  # settings that switch the option off, where the defaults do not
    note: str = ""
    warns: bool = False  # without the option: an IgnoredSettingWarning (a combination TRL accepts), not an error
    at: str = "config"  # "config", or "trainer": building the trainer refuses (or warns)


@dataclass(frozen=True)
class Warned:
    value: Any
    fix: str
    at: str = "config"  # "config", "trainer" (building the trainer warns) or "train" (train() warns)
    note: str = ""


KINDS = (Effect, Refused, Dependent, Warned)


def dependent(value, needs, probe_name=None, check=None, off=None, note="", warns=False, at="config") -> Dependent:
    effect = None if probe_name is None else Effect(value, probe_name, check)
    return Dependent(value, needs, effect, off or {}, note, warns, at)


@dataclass(frozen=True)
class Kit:
    """What the shared probes and tests need of one trainer.

    Attributes:
        config_cls: The config class whose fields the table enumerates.
        base: Every probe's settings (the table's values replace them).
        build: ``build(ctx, args, model=None, rewards=None, dataset=None, **trainer_kwargs)`` -> the trainer.
        model: The policy of a trainer (what a checkpoint saves as the model).
        trained: Every module the trainer trains (default: `model`), e.g. PPO's policy with its value head.
        train_loader: The trainer's prepared training dataloader.
        clear_cache_module: The module whose `clear_device_cache` the trainer calls (torch_empty_cache_steps).
        refusal_build: How `Refused(at="trainer")` entries build the trainer (default: `build`).
        best_base: Settings of the best-model probe, where its own make the last evaluation the best one.
    """

    config_cls: type
    base: dict
    build: Callable[..., Any]
    model: Callable[[Any], torch.nn.Module]
    train_loader: Callable[[Any], Any]
    clear_cache_module: Any
    trained: Callable[[Any], torch.nn.Module] | None = None
    refusal_build: Callable[..., Any] | None = None
    best_base: dict = field(default_factory=dict)


@dataclass
class Ctx:
    tmp: Path
    tokenizer: Any
    monkeypatch: pytest.MonkeyPatch
    kit: Kit

    def config(self, fields: dict, **base) -> Any:
        merged = {"output_dir": str(self.tmp / "out"), **self.kit.base, **base, **fields}
        return self.kit.config_cls(**{k: resolve(v, self) for k, v in merged.items()})

    def build(self, args: Any, **kwargs) -> Any:
        return self.kit.build(self, args, **kwargs)

    def train(self, fields: dict, **base) -> Run:
        trainer = self.build(self.config(fields, **base))
        return Run(trainer.args, trainer, trainer.train())


class Probes(dict):
    """Probe name -> ``probe(ctx, fields) -> Run``."""

    def register(self, *names: str):
        """Register a probe under `names`: each name is a separate pair of runs, for fields that cannot share one."""

        def register(fn):
            self.update(dict.fromkeys(names, fn))
            return fn

        return register


def resolve(value: Any, ctx: Ctx) -> Any:
    if isinstance(value, str) and value.startswith(TMP):
        return str(ctx.tmp) + value[len(TMP) :]
    return value


def record_method(ctx: Ctx, obj: Any, name: str, seen: list, keep: Callable = lambda args, kwargs, out: out):
    """Wrap `obj.name` (an instance attribute, undone after the run) to append `keep(args, kwargs, output)`."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(keep(args, kwargs, out))
        return out

    ctx.monkeypatch.setattr(obj, name, wrapper)


class Recorder(TrainerCallback):
    """Records the learning rate of each optimizer step."""

    def __init__(self):
        self.lrs = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def checkpoints(folder) -> list[str]:
    return sorted((p.name for p in Path(folder).glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def saved_files(run: Run, name: str) -> set[str]:
    return {p.name for p in (Path(run.args.output_dir) / name).iterdir()}


def logged_steps(run: Run) -> list[int]:
    return [entry["step"] for entry in run.logs]


def check(condition: bool):
    assert condition


def stat(name: str, predicate: Callable[[float], bool]) -> Callable[[Run], None]:
    """A check that every training step logged `name` and `predicate` holds for each value."""

    def check_stat(run: Run):
        values = [entry[name] for entry in run.logs if name in entry]
        assert values and all(predicate(v) for v in values), values

    return check_stat


# ---------------------------------------------------------------------------------------------------- shared probes
class TrackerCallback(TrainerCallback):
    """Stands in for transformers' TensorBoardCallback (tensorboard is not installed): what reaches a tracker."""

    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


class FakeHub:
    """Stands in for `huggingface_hub.HfApi`: records the calls; uploads "run as future" stay pending until the end
    of training, as a slow upload would."""

    def __init__(self):
        self.calls, self.pending = [], []

    def __call__(self):
        return self

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        job = futures.Future()
        self.pending.append(job)
        return job


class FinishUploads(TrainerCallback):
    def __init__(self, hub):
        self.hub = hub

    def on_train_end(self, args, state, control, **kwargs):
        for job in self.hub.pending:
            job.set_result("commit")


def hub_calls(run: Run, kind: str) -> list[dict]:
    return [kwargs for name, _, kwargs in run.seen["calls"] if name == kind]


class StepCounter(TrainerCallback, ExportableState):
    """A callback with state that a checkpoint saves (`ExportableState`)."""

    def __init__(self, steps: int = 0):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def state(self) -> dict:
        return {"args": {"steps": self.steps}, "attributes": {}}


def _cosine(step: int, warmup: int, total: int, peak: float, min_lr: float) -> float:
    """transformers' cosine-with-min-lr schedule after the warm-up, by hand."""
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_cosine(run: Run, min_lr: float | None = None):
    kwargs = run.args.lr_scheduler_kwargs or {}
    min_lr = kwargs.get("min_lr", 0.0) if min_lr is None else min_lr
    warmup, lrs = int(run.args.warmup_steps), run.seen["lrs"]
    expected = [_cosine(s, warmup, len(lrs), run.args.learning_rate, min_lr) for s in range(warmup, len(lrs))]
    assert len(lrs) > warmup and lrs[warmup:] == pytest.approx(expected, rel=1e-6)


def param_group(run: Run, decay: bool = True) -> dict:
    groups = run.trainer.optimizer.param_groups
    return groups[0] if decay else groups[-1]


def _parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters() if p.requires_grad])


def training_argument_probes() -> Probes:
    """The probes of the `TrainingArguments` fields both trainers honour as `transformers.Trainer` does."""
    probes = Probes()

    @probes.register("optimizer", "optim")
    def _(ctx, fields):
        trainer = ctx.build(ctx.config(fields))
        if trainer.optimizer is None:  # Trainer builds it when training starts: the same call train() makes
            trainer.create_optimizer()
        return Run(trainer.args, trainer)

    @probes.register("schedule")
    def _(ctx, fields):
        recorder = Recorder()
        args = ctx.config(fields, learning_rate=1e-3, max_steps=3)
        trainer = ctx.build(args, callbacks=[recorder])
        return Run(args, trainer, trainer.train(), {"lrs": recorder.lrs})

    @probes.register("epochs")
    def _(ctx, fields):
        return ctx.train(fields, max_steps=-1)

    @probes.register("steps", "memory", "plain")
    def _(ctx, fields):
        return ctx.train(fields)

    @probes.register("clip_norm")
    def _(ctx, fields):
        trainer = ctx.build(ctx.config(fields, optim="sgd", learning_rate=1.0))
        trained = ctx.kit.trained or ctx.kit.model
        before = _parameters(trained(trainer))
        run = Run(trainer.args, trainer, trainer.train())  # one step, one optimizer step
        run.seen["update_norm"] = float((_parameters(trained(trainer)) - before).norm())
        return run

    @probes.register("empty_cache")
    def _(ctx, fields):
        calls = []
        ctx.monkeypatch.setattr(ctx.kit.clear_cache_module, "clear_device_cache", lambda *a, **k: calls.append(1))
        run = ctx.train(fields, max_steps=2)
        run.seen["clears"] = len(calls)
        return run

    @probes.register("log_epoch")
    def _(ctx, fields):
        return ctx.train(fields, max_steps=-1, num_train_epochs=2)  # 8 prompts, 4 per step: 2 steps an epoch

    @probes.register("log_steps")
    def _(ctx, fields):
        return ctx.train(fields, max_steps=4)

    @probes.register("log_level")
    def _(ctx, fields):
        before = transformers.logging.get_verbosity()
        try:
            trainer = ctx.build(ctx.config(fields))
            return Run(trainer.args, trainer, seen={"verbosity": transformers.logging.get_verbosity()})
        finally:
            transformers.logging.set_verbosity(before)

    @probes.register("multinode")
    def _(ctx, fields):
        args = ctx.config(fields)
        # this process as the first process of the second node: global rank 1, local rank 0
        ctx.monkeypatch.setattr(ctx.kit.config_cls, "process_index", property(lambda self: 1))
        ctx.monkeypatch.setattr(ctx.kit.config_cls, "local_process_index", property(lambda self: 0))
        seen = dict(should_log=args.should_log, should_save=args.should_save, level=args.get_process_log_level())
        return Run(args, seen=seen)

    @probes.register("callbacks")
    def _(ctx, fields):
        trainer = ctx.build(ctx.config(fields))
        return Run(trainer.args, trainer, seen={"callbacks": [type(c) for c in trainer.callback_handler.callbacks]})

    @probes.register("tracker")
    def _(ctx, fields):
        ctx.monkeypatch.setitem(integrations.INTEGRATION_TO_CALLBACK, "tensorboard", TrackerCallback)
        run = ctx.train(fields)
        trackers = [c for c in run.trainer.callback_handler.callbacks if isinstance(c, TrackerCallback)]
        run.seen["tracked"] = [entry for tracker in trackers for entry in tracker.logged]
        return run

    @probes.register("best")
    def _(ctx, fields):
        base = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, learning_rate=1e-2)
        base.update(ctx.kit.best_base)
        trainer = ctx.build(
            ctx.config(fields, max_steps=4, **base),
            rewards=(id_reward,),
            eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}),
        )
        run = Run(trainer.args, trainer, trainer.train())
        run.seen["eval_rewards"] = {
            e["step"]: e["eval_reward"] for e in trainer.state.log_history if "eval_reward" in e
        }
        run.seen["model"] = {k: v.detach().clone() for k, v in ctx.kit.model(trainer).state_dict().items()}
        return run

    @probes.register("save")
    def _(ctx, fields):
        run = ctx.train(fields, max_steps=3, save_strategy="steps")  # every 500 steps: none in 3 steps
        run.seen["checkpoints"] = checkpoints(run.args.output_dir)
        return run

    @probes.register("save_epoch")
    def _(ctx, fields):
        run = ctx.train(fields, max_steps=-1, num_train_epochs=2)  # 2 steps an epoch
        run.seen["checkpoints"] = checkpoints(run.args.output_dir)
        return run

    @probes.register("jit")
    def _(ctx, fields):
        trainer = ctx.build(ctx.config(fields, max_steps=3))
        jit = [c for c in trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback)]
        seen = {"jit": bool(jit)}
        if jit:
            manager = jit[0].jit_manager
            seen["handler"] = signal.getsignal(signal.SIGTERM) == manager._sigterm_handler
            manager._enable_checkpoint()  # what the SIGTERM handler's timer calls once the grace period has passed
        run = Run(trainer.args, trainer, trainer.train(), seen)
        run.seen["checkpoints"] = checkpoints(trainer.args.output_dir)
        return run

    @probes.register("hub")
    def _(ctx, fields):
        hub = FakeHub()
        ctx.monkeypatch.setattr(transformers.trainer, "hf_api", hub)
        trainer = ctx.build(ctx.config(fields, max_steps=2, save_strategy="steps", save_steps=1))
        trainer.add_callback(FinishUploads(hub))
        run = Run(trainer.args, trainer, trainer.train())
        run.seen["calls"] = hub.calls
        return run

    @probes.register("determinism")
    def _(ctx, fields):
        try:
            trainer = ctx.build(ctx.config(fields))
            return Run(trainer.args, trainer, seen={"deterministic": torch.are_deterministic_algorithms_enabled()})
        finally:
            torch.use_deterministic_algorithms(False)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False

    @probes.register("dataloader")
    def _(ctx, fields):
        trainer = ctx.build(ctx.config(fields))  # the loader is not iterated: no worker process is started
        loader = ctx.kit.train_loader(trainer)
        return Run(trainer.args, trainer, seen={"loader": getattr(loader, "base_dataloader", loader)})

    @probes.register("ddp")
    def _(ctx, fields):
        trainer = ctx.build(ctx.config(fields))
        return Run(trainer.args, trainer, seen={"ddp": trainer.accelerator.ddp_handler})

    @probes.register("process_group")
    def _(ctx, fields):
        created = []

        class RecordingState(transformers.training_args.PartialState):
            def __init__(self, *args, **kwargs):
                created.append(kwargs)
                super().__init__(*args, **kwargs)

        ctx.monkeypatch.setattr(transformers.training_args, "PartialState", RecordingState)
        args = ctx.config(fields)
        args.device  # noqa: B018 - the device set-up builds accelerate's PartialState
        return Run(args, seen={"state_kwargs": created})

    @probes.register("fsdp")
    def _(ctx, fields):
        args = ctx.config(fields)
        seen = {"plugin": args.fsdp_plugin_args, "refused": ""}
        if args.fsdp:
            with pytest.raises(ValueError) as refused:
                ctx.build(args)
            seen["refused"] = str(refused.value)
        return Run(args, seen=seen)

    @probes.register("deepspeed")
    def _(ctx, fields):
        return Run(ctx.config(fields))

    @probes.register("tf32")
    def _(ctx, fields):
        before = torch.backends.cuda.matmul.allow_tf32
        try:
            args = ctx.config(fields)
            return Run(args, seen={"tf32": torch.backends.cuda.matmul.allow_tf32})
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    return probes


def tracked(run: Run):
    assert run.args.report_to == ["tensorboard"]
    assert any(key in entry for entry in run.seen["tracked"] for key in STEP_KEYS)  # step logs reach the tracker


def _best_weights_loaded(run: Run):
    best = run.trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith(f"checkpoint-{run.trainer.state.global_step}")
    saved = AutoModelForCausalLM.from_pretrained(best).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in run.seen["model"].items())


def _loader(attribute: str, value: Any) -> Callable[[Run], None]:
    def check_loader(run: Run):
        got = getattr(run.seen["loader"], attribute)
        assert got == value or (attribute == "multiprocessing_context" and type(got).__name__ == "SpawnContext")

    return check_loader


def ddp_setting(attribute: str, value: Any) -> Callable[[Run], None]:
    return lambda run: check(getattr(run.seen["ddp"], attribute) == value)


def optimizer_class(run: Run, cls):
    optimizer = run.trainer.optimizer
    assert isinstance(getattr(optimizer, "optimizer", optimizer), cls)


def training_argument_entries() -> dict[str, Effect | Refused | Dependent]:
    """The entries of the `TrainingArguments` fields both trainers honour alike (a probe step takes 4 prompts, 8
    prompts are an epoch of 2 steps), on the probes of `training_argument_probes()`."""
    return {
        "output_dir": Effect(
            f"{TMP}/elsewhere",
            "save",
            lambda run: check(
                run.args.output_dir.endswith("elsewhere") and (Path(run.args.output_dir) / "checkpoint-3").is_dir()
            ),
        ),
        "num_train_epochs": dependent(
            1.5,
            "max_steps=-1",
            "epochs",
            lambda run: check(run.trainer.state.global_step == 3),
            note="1.5 passes over 8 prompts at 4 per step: 3 steps",
        ),
        "max_steps": Effect(2, "steps", lambda run: check(run.trainer.state.global_step == 2)),
        # --- optimizer and schedule (Trainer's create_optimizer / create_scheduler)
        "learning_rate": Effect(3e-3, "optimizer", lambda run: check(param_group(run)["lr"] == 3e-3)),
        "weight_decay": Effect(
            0.05,
            "optimizer",
            lambda run: check(
                (param_group(run)["weight_decay"], param_group(run, decay=False)["weight_decay"]) == (0.05, 0.0)
            ),
        ),
        "adam_beta1": Effect(0.8, "optimizer", lambda run: check(param_group(run)["betas"][0] == 0.8)),
        "adam_beta2": Effect(0.95, "optimizer", lambda run: check(param_group(run)["betas"][1] == 0.95)),
        "adam_epsilon": Effect(1e-6, "optimizer", lambda run: check(param_group(run)["eps"] == 1e-6)),
        "optim": Effect("sgd", "optim", lambda run: optimizer_class(run, torch.optim.SGD)),
        "optim_args": Effect("momentum=0.9", "optim", lambda run: check(param_group(run).get("momentum") == 0.9)),
        "optim_target_modules": dependent(
            ["attn"],
            "a GaLore or APOLLO optimizer",
            note=(
                "with optim='galore_adamw' transformers builds GaLore on these modules; galore_torch is not "
                "installed here, and the trainer then raises an ImportError naming it (test_galore_needs_its_package)"
            ),
        ),
        "lr_scheduler_type": Effect("cosine_with_min_lr", "schedule", lambda run: check_cosine(run)),
        "lr_scheduler_kwargs": dependent(
            {"min_lr": 1e-4},
            "an lr_scheduler_type that takes arguments",
            "schedule",
            lambda run: check_cosine(run, min_lr=1e-4),
        ),
        "warmup_steps": dependent(
            2,
            "a schedule that warms up",
            "schedule",
            lambda run: check(run.seen["lrs"][:2] == pytest.approx([0.0, run.args.learning_rate / 2])),
        ),
        "max_grad_norm": Effect(
            1e-3,
            "clip_norm",
            lambda run: check(run.seen["update_norm"] == pytest.approx(run.args.learning_rate * 1e-3, rel=1e-4)),
            note="SGD with lr 1: one optimizer step moves the weights by exactly the clipped gradient norm",
        ),
        # --- precision on this machine
        "fp16": (
            Effect(True, "precision_fp16", lambda run: check(run.trainer.accelerator.mixed_precision == "fp16"))
            if torch.cuda.is_available()
            else Refused(True, "Use bf16=True", note="on a CPU accelerate would skip float16 autocast: refused here")
        ),
        "tf32": (
            Refused(True, "Ampere", note="this machine has no Ampere GPU; on one, transformers enables TF32")
            if not is_torch_tf32_available()
            else Effect(True, "tf32", lambda run: check(run.seen["tf32"]))
        ),
        "torch_empty_cache_steps": Effect(1, "empty_cache", lambda run: check(run.seen["clears"] == 2)),
        # --- logging
        "logging_strategy": Effect("epoch", "log_epoch", lambda run: check(logged_steps(run) == [2, 4])),
        "logging_steps": dependent(
            3,
            "logging_strategy='steps'",
            "log_steps",
            lambda run: check(3 in logged_steps(run) and 2 not in logged_steps(run)),
            off={"logging_strategy": "epoch"},
        ),
        "logging_first_step": Effect(
            True, "log_steps", lambda run: check(1 in logged_steps(run) and 2 not in logged_steps(run))
        ),
        "log_on_each_node": Effect(
            False,
            "multinode",
            lambda run: check(run.seen["should_log"] is False),
            note="multi-node only: shown on TrainingArguments.should_log of a second node's process",
        ),
        "log_level": Effect(
            "error", "log_level", lambda run: check(run.seen["verbosity"] == transformers.logging.ERROR)
        ),
        "log_level_replica": Effect(
            "error",
            "multinode",
            lambda run: check(run.seen["level"] == transformers.logging.ERROR),
            note="multi-process only: the level of a process that does not log",
        ),
        "disable_tqdm": Effect(
            False,
            "callbacks",
            lambda run: check(
                ProgressCallback in run.seen["callbacks"] and PrinterCallback not in run.seen["callbacks"]
            ),
        ),
        "report_to": Effect(
            "tensorboard",
            "tracker",
            tracked,
            note="tensorboard is not installed: its callback is replaced by a recorder in the same slot",
        ),
        "run_name": dependent(
            "a-run",
            "report_to naming a tracker that names its runs",
            note="read by the wandb / trackio / mlflow / comet / swanlab callbacks, none installed here",
        ),
        "project": dependent("my-project", "report_to including 'trackio'", note="trackio is not installed here"),
        "trackio_space_id": dependent("me/space", "report_to including 'trackio'"),
        "trackio_bucket_id": dependent("me/bucket", "report_to including 'trackio'"),
        "trackio_static_space_id": dependent("me/static", "report_to including 'trackio'"),
        # --- checkpoints
        "save_only_model": Effect(
            True,
            "save",
            lambda run: check(
                run.seen["checkpoints"]
                and all("optimizer.pt" not in saved_files(run, c) for c in run.seen["checkpoints"])
            ),
        ),
        "save_strategy": Effect(
            "epoch", "save_epoch", lambda run: check(run.seen["checkpoints"] == ["checkpoint-2", "checkpoint-4"])
        ),
        "save_steps": dependent(
            1, "save_strategy='steps'", "save", lambda run: check("checkpoint-2" in run.seen["checkpoints"])
        ),
        "save_on_each_node": Effect(
            True,
            "multinode",
            lambda run: check(run.seen["should_save"] is True),
            note="multi-node only: shown on TrainingArguments.should_save of a second node's process",
        ),
        "save_total_limit": Effect(
            2, "save", lambda run: check(run.seen["checkpoints"] == ["checkpoint-2", "checkpoint-3"])
        ),
        "enable_jit_checkpoint": Effect(
            True,
            "jit",
            lambda run: check(
                run.seen.get("handler")
                and run.trainer.state.global_step == 1
                and "checkpoint-0" in run.seen["checkpoints"]
                and (Path(run.args.output_dir) / "checkpoint-0" / MARKER_FILE).is_file()
            ),
            note="SIGTERM's handler is installed; once it asks for a checkpoint, one is saved and training stops",
        ),
        # --- the Hub (transformers' hf_api replaced by a recorder)
        "push_to_hub": Effect(
            True, "hub", lambda run: check(hub_calls(run, "create_repo") and hub_calls(run, "upload_folder"))
        ),
        "hub_token": Effect(
            SECRET,
            "hub",
            lambda run: check(
                hub_calls(run, "create_repo")
                and all(c["token"] == SECRET for c in hub_calls(run, "create_repo") + hub_calls(run, "upload_folder"))
            ),
        ),
        "hub_private_repo": Effect(
            True, "hub", lambda run: check(any(c.get("private") is True for c in hub_calls(run, "create_repo")))
        ),
        "hub_model_id": Effect(
            "someone/tiny",
            "hub",
            lambda run: check(run.seen["calls"] and all(repo == "someone/tiny" for _, repo, _ in run.seen["calls"])),
        ),
        "hub_strategy": dependent(
            "checkpoint",
            "push_to_hub=True",
            "hub",
            lambda run: check(
                any(c.get("path_in_repo") == "last-checkpoint" for c in hub_calls(run, "upload_folder"))
            ),
        ),
        "hub_always_push": dependent(
            True,
            "push_to_hub=True",
            "hub",
            lambda run: check(len([c for c in hub_calls(run, "upload_folder") if "path_in_repo" not in c]) == 2),
            note="both saves push although the first upload is still running",
        ),
        "hub_revision": Effect(
            "dev",
            "hub",
            lambda run: check(
                hub_calls(run, "upload_folder")
                and all(c["revision"] == "dev" for c in hub_calls(run, "upload_folder"))
            ),
        ),
        # --- best model
        "load_best_model_at_end": Effect(True, "best", _best_weights_loaded),
        "metric_for_best_model": dependent(
            "reward",
            "eval_strategy='steps' or 'epoch'",
            "best",
            lambda run: check(run.trainer.state.best_metric in run.seen["eval_rewards"].values()),
        ),
        "greater_is_better": dependent(
            False,
            "eval_strategy='steps' or 'epoch'",
            "best",
            lambda run: check(
                run.trainer.state.best_metric
                == min(run.seen["eval_rewards"].values())
                < max(run.seen["eval_rewards"].values())
            ),
        ),
        # --- randomness
        "full_determinism": Effect(True, "determinism", lambda run: check(run.seen["deterministic"])),
        # --- hardware, accelerate and engines
        "dataloader_num_workers": Effect(1, "dataloader", _loader("num_workers", 1)),
        "dataloader_pin_memory": Effect(False, "dataloader", _loader("pin_memory", False)),
        "dataloader_persistent_workers": dependent(
            True, "dataloader_num_workers > 0", "dataloader", _loader("persistent_workers", True)
        ),
        "dataloader_prefetch_factor": Effect(
            3, "dataloader", _loader("prefetch_factor", 3), note="without workers transformers refuses it, naming it"
        ),
        "dataloader_multiprocessing_context": dependent(
            "spawn", "dataloader_num_workers > 0", "dataloader", _loader("multiprocessing_context", "spawn")
        ),
        "dataloader_in_order": dependent(
            False, "dataloader_num_workers > 0", "dataloader", _loader("in_order", False)
        ),
        "ddp_find_unused_parameters": Effect(
            False,
            "ddp",
            ddp_setting("find_unused_parameters", False),
            note="multi-process only: reaches accelerate's DDP kwargs handler",
        ),
        "ddp_bucket_cap_mb": Effect(7, "ddp", ddp_setting("bucket_cap_mb", 7)),
        "ddp_broadcast_buffers": Effect(False, "ddp", ddp_setting("broadcast_buffers", False)),
        "ddp_static_graph": Effect(True, "ddp", ddp_setting("static_graph", True)),
        "ddp_backend": Refused(
            "gloo",
            "leave ddp_backend=None",
            note="a single process here; under a launcher it reaches torch.distributed's init",
        ),
        "ddp_timeout": Effect(
            77,
            "process_group",
            lambda run: check(
                run.seen["state_kwargs"] and run.seen["state_kwargs"][-1]["timeout"] == datetime.timedelta(seconds=77)
            ),
            note="multi-process only: reaches accelerate's PartialState, which passes it to init_process_group",
        ),
        "fsdp": Effect(
            True,
            "fsdp",
            lambda run: check(
                run.seen["plugin"]
                and run.seen["plugin"]["fsdp_version"] == 2
                and "only works in distributed training" in run.seen["refused"]
            ),
            note="builds accelerate's FSDP plugin arguments; a single process here, so the trainer refuses it",
        ),
        "fsdp_config": dependent(
            {"version": 2, "reshard_after_forward": False},
            "fsdp=True",
            "fsdp",
            lambda run: check(run.seen["plugin"] and run.seen["plugin"]["reshard_after_forward"] is False),
        ),
        "deepspeed": Effect(
            {
                "zero_optimization": {"stage": 2},
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "train_batch_size": "auto",
            },
            "deepspeed",
            lambda run: check(
                run.args.deepspeed_plugin is not None
                and run.args.deepspeed_plugin.zero_stage == 2
                and run.args.hf_deepspeed_config.config["train_micro_batch_size_per_gpu"]
                == run.args.per_device_train_batch_size
                and run.args.hf_deepspeed_config.config["gradient_accumulation_steps"]
                == run.args.gradient_accumulation_steps
                and run.args.hf_deepspeed_config.config["gradient_clipping"] == run.args.max_grad_norm
            ),
            note="the micro-batch, accumulation and clipping fill the DeepSpeed config; the engine itself runs "
            "under accelerate launch",
        ),
        "skip_memory_metrics": Effect(
            False, "memory", lambda run: check("train_mem_cpu_alloc_delta" in run.output.metrics)
        ),
    }


# ---------------------------------------------------------------------------------------------------- the tests
@contextlib.contextmanager
def isolated():
    """Undo what a probe's settings change process-wide: environment variables (FSDP, DeepSpeed and determinism
    set some), transformers' log level, the SIGTERM handler (JIT checkpoints), torch's determinism flags."""
    verbosity, sigterm = transformers.logging.get_verbosity(), signal.getsignal(signal.SIGTERM)
    deterministic = torch.are_deterministic_algorithms_enabled()
    with mock.patch.dict(os.environ):
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)
            signal.signal(signal.SIGTERM, sigterm)
            torch.use_deterministic_algorithms(deterministic)


def entries(table: dict, kind) -> list[tuple[str, Any]]:
    return [(name, entry) for name, entry in table.items() if isinstance(entry, kind)]


def effects(table: dict) -> dict[str, dict[str, Effect]]:
    """probe name -> {field: its Effect} (a Dependent's effect included)."""
    groups: dict[str, dict[str, Effect]] = {}
    for name, entry in table.items():
        effect = entry if isinstance(entry, Effect) else getattr(entry, "effect", None)
        if effect is not None:
            groups.setdefault(effect.probe, {})[name] = effect
    return groups


def counts(table: dict) -> dict[str, int]:
    kinds = [type(entry).__name__ for entry in table.values()]
    return {kind.__name__: kinds.count(kind.__name__) for kind in KINDS}


def _default(config_cls: type, name: str) -> Any:
    f = config_cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _ignored_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, IgnoredSettingWarning)]


def table_tests(kit: Kit, table: dict, probes: Probes, docs_page: Path) -> dict[str, Callable]:
    """The tests of one trainer's table, to be placed in its test module's namespace."""
    config_cls = kit.config_cls

    def ctx_for(tmp: Path, tokenizer, monkeypatch) -> Ctx:
        return Ctx(tmp, tokenizer, monkeypatch, kit)

    def run_probe(probe_name: str, tmp: Path, tokenizer, fields: dict) -> Run:
        tmp.mkdir(parents=True)
        with isolated(), pytest.MonkeyPatch.context() as monkeypatch:
            return probes[probe_name](ctx_for(tmp, tokenizer, monkeypatch), fields)

    def config_with(tmp_path: Path, **fields):
        return config_cls(output_dir=str(tmp_path), **{**kit.base, **fields})

    def test_table_covers_every_field():
        names = {f.name for f in dataclasses.fields(config_cls)}
        missing, extra = sorted(names - set(table)), sorted(set(table) - names)
        what = config_cls.__name__
        assert not missing, f"{what} fields with no entry in TABLE (honour or refuse them, then add them): {missing}"
        assert not extra, f"TABLE entries that are no {what} field: {extra}"
        assert all(isinstance(entry, KINDS) for entry in table.values())
        assert set(effects(table)) <= set(probes), sorted(set(effects(table)) - set(probes))

    @pytest.mark.parametrize("name", sorted(table))
    def test_table_values_are_not_the_defaults(name):
        value = table[name].value
        assert value != _default(config_cls, name) and value != kit.base.get(name, _default(config_cls, name))

    @pytest.mark.parametrize("name", [name for name, entry in entries(table, Refused) if entry.at == "config"])
    def test_refused_by_name(tmp_path, name):
        entry = table[name]
        with isolated(), pytest.raises(ValueError) as refused:
            config_with(tmp_path, **{name: entry.value})
        message = str(refused.value)
        assert name in message and entry.fix in message, message

    @pytest.mark.parametrize("name", [name for name, entry in entries(table, Refused) if entry.at != "config"])
    def test_refused_by_the_trainer_here(tmp_path, tokenizer, monkeypatch, name):
        entry = table[name]
        args = config_with(tmp_path / "out", **{name: entry.value})
        build = kit.refusal_build or kit.build
        with isolated(), pytest.raises((ValueError, ImportError)) as refused:
            trainer = build(ctx_for(tmp_path, tokenizer, monkeypatch), args)
            if entry.at == "train":
                trainer.train()
        message = str(refused.value)
        assert name in message and entry.fix in message, message

    @pytest.mark.parametrize("name", [name for name, _ in entries(table, Dependent)])
    def test_dependent_refused_without_its_option(tmp_path, tokenizer, monkeypatch, name):
        entry = table[name]
        fields = {**entry.off, name: entry.value}
        make = (lambda: config_with(tmp_path, **fields)) if entry.at == "config" else None
        if entry.at == "trainer":
            make = lambda: kit.build(ctx_for(tmp_path, tokenizer, monkeypatch), config_with(tmp_path, **fields))  # noqa: E731
        if entry.warns:
            with isolated(), warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                make()
            messages = [m for m in _ignored_warnings(record) if name in m]
            assert messages and entry.needs in messages[0], (messages, _ignored_warnings(record))
        else:
            with isolated(), pytest.raises(ValueError) as refused:
                make()
            message = str(refused.value)
            assert name in message and entry.needs in message, message

    @pytest.mark.parametrize("name", [name for name, _ in entries(table, Warned)])
    def test_warned_by_name(tmp_path, tokenizer, monkeypatch, name):
        entry = table[name]
        with isolated(), warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            args = config_with(tmp_path, **{name: entry.value})
            if entry.at in ("trainer", "train"):
                trainer = kit.build(ctx_for(tmp_path, tokenizer, monkeypatch), args)
                if entry.at == "train":
                    trainer.train()
        messages = [m for m in _ignored_warnings(record) if name in m]
        assert messages and entry.fix in messages[0], (messages, _ignored_warnings(record))

    def test_defaults_warn_of_nothing(tmp_path, tokenizer, monkeypatch):
        """The base settings (every field at its default but those) are honoured without a word."""
        with isolated(), warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            kit.build(ctx_for(tmp_path, tokenizer, monkeypatch), config_with(tmp_path)).train()
        assert not _ignored_warnings(record)

    @pytest.mark.parametrize("probe_name", sorted(effects(table)))
    def test_effect(tmp_path, tokenizer, probe_name):
        group = effects(table)[probe_name]
        run = run_probe(
            probe_name, tmp_path / "set", tokenizer, {name: effect.value for name, effect in group.items()}
        )
        for name, effect in group.items():  # before the second run: accelerate's state is process-wide
            try:
                effect.check(run)
            except AssertionError as err:
                raise AssertionError(
                    f"{name}={effect.value!r} showed no effect on probe {probe_name!r}: {err}"
                ) from err
        default = run_probe(probe_name, tmp_path / "default", tokenizer, {})
        for name, effect in group.items():
            with pytest.raises(AssertionError):  # the effect is absent when the field is left at its default
                effect.check(default)
                pytest.fail(f"{name}: the check passes without the setting too, so it shows nothing")

    def test_docs_name_every_field():
        """The docs page's "Every setting" section names every field, and its counts are the table's."""
        text = docs_page.read_text(encoding="utf-8")
        section = text.split("## Every setting: honoured or refused", 1)[1].split("\n## ", 1)[0]
        named = lambda name: f"`{name}`" in section or f"`{name}=" in section  # noqa: E731
        missing = [f.name for f in dataclasses.fields(config_cls) if not named(f.name)]
        assert not missing, f"{docs_page.name} does not say what {config_cls.__name__} does with {missing}"
        n = counts(table)
        assert f"{n['Effect']} fields honoured, {n['Dependent']} honoured with the option they need" in section
        assert f"{n['Refused']} refused" in section
        assert not n["Warned"] or f"{n['Warned']} accepted with a warning" in section

    tests = {name: test for name, test in locals().items() if name.startswith("test_")}
    if not any(entry.at != "config" for _, entry in entries(table, Refused)):
        del tests["test_refused_by_the_trainer_here"]
    if not entries(table, Warned):
        del tests["test_warned_by_name"]
    return tests
