"""What a PPO run writes under its save path and reads back: `run_args.json`, `checkpoint-N/` (resumable),
`reward_history.jsonl`, and at the end the model, tokenizer, value head and `reward_curve.png`.

The critic is saved with the trainer: a step loop holds it, not the trainer, and its counters (requests, failures)
continue in a resumed run.
"""

from __future__ import annotations

import json
import os
from typing import Any

from reward_curve import plot_reward_curve

from trl_stable.settings.secrets import redact


def save_run_args(args: Any, save_path: str) -> None:
    """`run_args.json`: the run's arguments with every secret field (`hub_token`, `perspective_api`, any `*_token` /
    `*_key` / `*_secret`, see `trl_stable.settings.secrets.is_secret_name`) replaced by "<redacted>", credentials in
    URLs (``http://user:key@host``) removed."""
    os.makedirs(save_path, exist_ok=True)
    with open(os.path.join(save_path, "run_args.json"), "w", encoding="utf-8") as f:
        json.dump(redact(args), f, indent=2, default=str)


def resume_run(trainer, checkpoint: str | None, save_path: str, critic=None) -> tuple[int, list[dict]]:
    """(the step to continue after, the history up to it): with a `checkpoint` (`<save_path>/checkpoint-N`) the
    trainer restores weights, optimizer, KL controller, score statistics and RNG, the critic its counters, and the
    history comes from `reward_history.jsonl`; without one, (0, [])."""
    if not checkpoint:
        return 0, []
    trainer.load_checkpoint(checkpoint, reward_funcs=_stateful(critic))
    start = trainer.state.global_step
    return start, read_history(save_path)[:start]


def save_checkpoint(trainer, save_path: str, step: int, history: list[dict], critic=None) -> str:
    """`<save_path>/checkpoint-<step>` (what `resume_run` continues from) and the history so far."""
    path = os.path.join(save_path, f"checkpoint-{step}")
    trainer.save_checkpoint(path, reward_funcs=_stateful(critic))
    if trainer.accelerator.is_main_process:  # a resumed run picks its curve up from here
        write_history(history, save_path)
    return path


def save_run(trainer, save_path: str, history: list[dict], name: str) -> None:
    """The trained model (policy, tokenizer, value head: `from_pretrained`-loadable), `reward_history.jsonl` and
    `reward_curve.png` (`name` labels the curve)."""
    trainer.save_model(save_path)
    if trainer.accelerator.is_main_process:
        write_history(history, save_path)
        plot_reward_curve({name: history}, os.path.join(save_path, "reward_curve.png"))


def _stateful(critic) -> list:
    return [] if critic is None else [critic]


def read_history(save_path: str) -> list[dict]:
    path = os.path.join(save_path, "reward_history.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_history(history: list[dict], save_path: str) -> None:
    os.makedirs(save_path, exist_ok=True)
    with open(os.path.join(save_path, "reward_history.jsonl"), "w", encoding="utf-8") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")
