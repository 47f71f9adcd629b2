"""Checkpoints both trainers can trust (docs/reliability.md): complete or recognisably incomplete, found by resume,
carrying trl_stable's own state.

A checkpoint is complete when its `MARKER_FILE` says ``"complete": true``; the main process writes it last, after
every process flushed its files, with every file's size, which resume checks. trl_stable's state is one file per
process (`stable_state_file`); its per-process part is restored only when as many processes resume as saved.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

logger = logging.getLogger(__name__)

MARKER_FILE = "trl_stable_checkpoint.json"
TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, written by both trainers
# What transformers' just-in-time (SIGTERM) checkpoint puts in the folder before it calls `_save_checkpoint`
JIT_SENTINEL_FILE = "checkpoint-is-incomplete.txt"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_FORMAT = 1


def stable_state_file(process_index: int) -> str:
    """The name of trl_stable's state file of process `process_index` in a checkpoint."""
    return f"trl_stable_state_{process_index}.pt"


# ---------------------------------------------------------------------------------------------------- durable writes
def _fsync_path(path: str, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:  # a directory cannot be opened for fsync on some platforms (Windows); nothing to flush there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """Flush every file under `folder`, and the folders themselves, to disk (libraries' `save_pretrained` does not)."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync_path(os.path.join(root, name))
        _fsync_path(root, directory=True)


def save_durably(obj: Any, path: str) -> None:
    """`torch.save` to `path`, flushed to disk before returning."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json_durably(data: dict[str, Any], path: str) -> None:
    """Write `data` to `path` through a temporary file and a rename: a reader sees the old file or the new one."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(path) or ".", directory=True)


def _write_marker_file(folder: str, global_step: int, complete: bool, **more: Any) -> None:
    marker = {"format": _FORMAT, "complete": complete, "global_step": global_step, **more}
    _write_json_durably(marker, os.path.join(folder, MARKER_FILE))


def begin_marker(folder: str, global_step: int) -> None:
    """Mark `folder` as being written (``"complete": false``), replacing the marker an earlier save of this step
    left: from now until `write_marker` resume skips it."""
    os.makedirs(folder, exist_ok=True)
    _write_marker_file(folder, global_step, complete=False)


def write_marker(folder: str, global_step: int, num_processes: int) -> None:
    """Mark `folder` complete, listing every file in it with its size. Call it on the main process only, after
    every process has written (and flushed) its files."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel not in (MARKER_FILE, MARKER_FILE + ".tmp"):
                files[rel] = os.path.getsize(path)
    _write_marker_file(folder, global_step, complete=True, num_processes=num_processes, files=files)


# ---------------------------------------------------------------------------------------------------- checking
def _read_marker(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, MARKER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        marker = None
    return marker if isinstance(marker, dict) else {"complete": False, "unreadable": True}


def checkpoint_problem(folder: str) -> str | None:
    """Why `folder` is not a complete trl_stable checkpoint; None when it is."""
    if not os.path.isdir(folder):
        return "it does not exist"
    marker = _read_marker(folder)
    if marker is None:
        return f"it has no {MARKER_FILE} (not written by trl_stable, or by an older version)"
    if marker.get("unreadable"):
        return f"its {MARKER_FILE} is unreadable"
    if not marker.get("complete"):
        return "saving it was interrupted (its marker says incomplete)"
    for rel, size in sorted(marker.get("files", {}).items()):
        path = os.path.join(folder, *rel.split("/"))
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} has {os.path.getsize(path)} bytes, {size} were written"
    if not os.path.isfile(os.path.join(folder, TRAINER_STATE_FILE)):
        return f"it has no {TRAINER_STATE_FILE}"
    return None


def newest_complete_checkpoint(output_dir: str, log: bool = True) -> str:
    """The newest complete ``checkpoint-N`` of `output_dir`, logging each newer one skipped and why (`log`);
    ValueError listing them when there is none."""
    found = [
        (int(match.group(1)), name)
        for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else ())
        if (match := _CHECKPOINT.fullmatch(name)) and os.path.isdir(os.path.join(output_dir, name))
    ]
    skipped = []
    for _, name in sorted(found, reverse=True):
        path = os.path.join(output_dir, name)
        problem = checkpoint_problem(path)
        if problem is None:
            if log and skipped:
                logger.warning(
                    "Resuming from %s, the newest complete checkpoint; skipped: %s.", path, "; ".join(skipped)
                )
            elif log:
                logger.info("Resuming from %s, the newest checkpoint (complete).", path)
            return path
        skipped.append(f"{name}: {problem}")
    detail = f" Skipped: {'; '.join(skipped)}." if skipped else ""
    raise ValueError(
        f"resume_from_checkpoint=True, but {output_dir} holds no complete checkpoint.{detail} Pass the path of a "
        "checkpoint folder to resume from it (one without a marker is taken unverified), or start without "
        "resume_from_checkpoint."
    )


def _fix_hint(folder: str) -> str:
    parent = os.path.dirname(os.path.normpath(folder))
    try:
        newest = newest_complete_checkpoint(parent, log=False)
    except ValueError:
        return "resume from another checkpoint or start without resume_from_checkpoint"
    return f"resume from {newest}, the newest complete checkpoint there (resume_from_checkpoint=True takes it)"


@dataclass
class CheckpointInfo:
    """What `resolve_checkpoint` found: the folder, whether its marker verified it (else: no marker), and whether as
    many processes wrote it as this run has (True when unknown; only then is the per-process state restored)."""

    path: str
    verified: bool
    same_processes: bool


def resolve_checkpoint(
    resume_from_checkpoint: str | bool | None,
    output_dir: str,
    num_processes: int,
    per_process: Sequence[str] = (),
) -> CheckpointInfo | None:
    """The checkpoint to resume from: `resume_from_checkpoint` True (the newest complete one of `output_dir`), a
    folder, or None / False (none). When as many processes wrote it, it must hold `per_process`; ValueError naming
    the folder and the fix otherwise."""
    if not resume_from_checkpoint:
        return None
    folder = newest_complete_checkpoint(output_dir) if resume_from_checkpoint is True else str(resume_from_checkpoint)
    if not os.path.isdir(folder):
        raise ValueError(f"resume_from_checkpoint={folder!r} does not exist; {_fix_hint(folder)}.")
    if not os.path.isfile(os.path.join(folder, TRAINER_STATE_FILE)):
        raise ValueError(
            f"{folder} has no {TRAINER_STATE_FILE}, so it is not a complete checkpoint (saving it was interrupted, or "
            f"it holds only a saved model). Fix: {_fix_hint(folder)}."
        )
    marker = _read_marker(folder)
    if marker is not None and (problem := checkpoint_problem(folder)) is not None:
        raise ValueError(f"{folder} is not a complete checkpoint: {problem}. Fix: {_fix_hint(folder)}.")
    saved_processes = marker.get("num_processes") if marker else None
    same = saved_processes in (None, num_processes)
    if not same:
        logger.warning(
            f"{folder} was written by {saved_processes} processes, this run has {num_processes}: the per-process "
            "state (PPO's RNG streams, reward function counters, GRPO's refill RNG) is not restored, so the run does "
            "not continue exactly as it would have."
        )
    missing = [name for name in (per_process if same else ()) if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise ValueError(
            f"{folder} is not a complete checkpoint: it lacks {', '.join(missing)}"
            + ("" if saved_processes else " (or it was written by a different number of processes)")
            + f". Fix: {_fix_hint(folder)}."
        )
    if marker is None:
        logger.warning(
            f"{folder} has no {MARKER_FILE} (written by another trainer or an older trl_stable): its completeness "
            "cannot be checked, and trl_stable's state (health monitor, reward function counters, GRPO's refill RNG "
            "and NaN count) is not in it and starts fresh."
        )
    return CheckpointInfo(folder, marker is not None, same)


# ---------------------------------------------------------------------------------------------- trl_stable's state
def _stateful(named_funcs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The reward functions with checkpoint state, keyed by position and name (a name may repeat)."""
    return {
        f"{i}:{name}": func
        for i, (name, func) in enumerate(named_funcs)
        if callable(getattr(func, "checkpoint_state", None)) and callable(getattr(func, "load_checkpoint_state", None))
    }


def check_checkpoint_names(output_dir: str, folder: str | None = None) -> None:
    """Refuse (ValueError naming each path) what is named like a checkpoint in `output_dir` but is none (a file, a
    folder no trainer wrote): a save would fail on it and rotation could delete it. With `folder`, only that name."""
    if folder is not None:
        paths = [folder] if os.path.lexists(folder) else []
    elif os.path.isdir(output_dir):
        paths = [os.path.join(output_dir, n) for n in sorted(os.listdir(output_dir)) if _CHECKPOINT.fullmatch(n)]
    else:
        paths = []
    # a checkpoint folder holds what a trainer writes (or nothing: a save killed before its first file)
    written = (MARKER_FILE, TRAINER_STATE_FILE, JIT_SENTINEL_FILE)
    strays = [
        p
        for p in paths
        if not (os.path.isdir(p) and (not os.listdir(p) or any(os.path.isfile(os.path.join(p, n)) for n in written)))
    ]
    if strays:
        kinds = ", ".join(f"{p} ({'a folder no trainer wrote' if os.path.isdir(p) else 'a file'})" for p in strays)
        raise ValueError(
            f"{kinds}: named like a checkpoint in output_dir, where the trainer writes checkpoint-<step> folders (and "
            "transformers' save_total_limit deletes old ones). Move or rename it, or choose another output_dir; "
            "trl_stable does not rename or delete what it did not write."
        )


# ---------------------------------------------------------------------------------------------- the trainers' mixin
class MarkedCheckpoints:
    """Complete-or-marked checkpoints for a `transformers.Trainer` subclass (both trainers; docs/reliability.md).

    `_save_checkpoint` writes transformers' files with its helpers in its order (`_write_checkpoint_files`, mirrored
    in `trl_stable.integration.mirrored`), marks the folder incomplete before and complete after, and only then
    pushes and rotates; `_restore_stable_state` reads trl_stable's state (`_stable_state`) back on resume. The
    trainer supplies `_named_reward_funcs()`, `_trainer_checkpoint_state()` -> (shared, per-process), its inverse
    `_load_trainer_checkpoint_state(shared, per_process)`, `reward_guards` and a `health_monitor` (or None).
    """

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            check_checkpoint_names(run_dir, folder)
            if os.path.isdir(folder):  # an older save of this step (a run restarted from an earlier checkpoint)
                shutil.rmtree(folder)
            begin_marker(folder, self.state.global_step)  # incomplete from here on
        self.accelerator.wait_for_everyone()  # no process writes into the folder while it still looks complete
        self._write_checkpoint_files(trial, run_dir, folder)
        os.makedirs(folder, exist_ok=True)
        save_durably(self._stable_state(), os.path.join(folder, stable_state_file(self.accelerator.process_index)))
        self.accelerator.wait_for_everyone()  # every process's files are written before the marker lists them
        if self.args.should_save:
            fsync_tree(folder)  # transformers does not flush its files
            write_marker(folder, self.state.global_step, self.accelerator.num_processes)
        if self.args.push_to_hub:
            self._push_from_checkpoint(folder)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _stable_state(self) -> dict[str, Any]:
        """This process's trl_stable state for its checkpoint file: plain values and tensors only (resume loads it
        with ``weights_only=True``); "shared" is equal on every process."""
        shared, per_process = self._trainer_checkpoint_state()
        monitor = None if self.health_monitor is None else self.health_monitor.checkpoint_state()
        funcs = {key: func.checkpoint_state() for key, func in _stateful(self._named_reward_funcs()).items()}
        guards = {name: guard.checkpoint_state() for name, guard in self.reward_guards.items()}
        return {
            "format": _FORMAT,
            "shared": {"health_monitor": monitor, "reward_guards": guards, **shared},
            "per_process": {"reward_funcs": funcs, **per_process},
        }

    def _restore_stable_state(self, info: CheckpointInfo) -> None:
        """Restore `_stable_state` from this process's file (process 0's, its shared part only, when the number of
        processes changed); an unverified checkpoint has no such file: nothing is restored."""
        if not info.verified:
            return
        index = self.accelerator.process_index if info.same_processes else 0
        state = torch.load(os.path.join(info.path, stable_state_file(index)), map_location="cpu", weights_only=True)
        per_process = state["per_process"] if info.same_processes else None
        saved_monitor = state["shared"].get("health_monitor")
        if self.health_monitor is not None and saved_monitor is not None:
            self.health_monitor.load_checkpoint_state(saved_monitor, args=self.args)
        elif self.health_monitor is not None:
            logger.warning(
                "The checkpoint has no health-monitor state (it ran without one): the monitor starts fresh."
            )
        if per_process is not None:
            saved = per_process["reward_funcs"]
            for key, func in _stateful(self._named_reward_funcs()).items():
                if key in saved:
                    func.load_checkpoint_state(saved[key])
                else:
                    logger.warning("The checkpoint has no state for reward function %s: it starts fresh.", key)
        for name, guard_state in state["shared"].get("reward_guards", {}).items():
            if name in self.reward_guards:
                self.reward_guards[name].load_checkpoint_state(guard_state)
        self._load_trainer_checkpoint_state(state["shared"], per_process)

    def _write_checkpoint_files(self, trial: Any, run_dir: str, folder: str) -> None:
        """The files `transformers.Trainer._save_checkpoint` writes, step for step, into `folder` (its push and
        rotation run in `_save_checkpoint`, after the marker)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self.save_model(folder, _internal_call=True)
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and (
            self.state.best_global_step
        ):
            self.accelerator.wait_for_everyone()  # the main process saved the model before the best is looked for
            best_checkpoint_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best_checkpoint_dir):
                self.state.best_model_checkpoint = best_checkpoint_dir
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(folder)
            self._save_scaler(folder)
            self._save_rng_state(folder)
        if self.args.should_save:
            for callback in self.callback_handler.callbacks + [self.control]:
                if isinstance(callback, ExportableState):
                    name = callback.__class__.__name__
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(callback.state())
                    else:
                        self.state.stateful_callbacks[name] = callback.state()
            self.state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))
