"""The PPO scripts' shared arguments: the run's loop and saving flags (`RunArgs`) and the mode defaults.

Each PPO script runs in one of two modes:

- paper mode (a model is named and `--offline` is not set): the hub models and datasets of the paper;
- embedded mode (no model named, or `--offline`): the tiny warmed-up policy of `embedded.py`, the shipped data,
  local environment rewards (VADER, alt-profanity-check, rouge-score) and the offline lexicon critic. It runs on
  a laptop CPU in minutes and is what the smoke tests run.

A few defaults depend on the mode (`ppo_mode_defaults`): the paper's learning rate of 1.41e-5 moves a 64-wide model
nowhere in a few minutes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import tyro
from embedded import is_embedded

from trl_stable.settings.checks import field_default

# Paper mode keeps trl_stable.PPOConfig's defaults (learning rate 1.41e-5 as RELC's commands pass it, init KL
# coefficient 0.2, batch 16), with the mini-batch following the batch; these learn within minutes on the embedded
# policy.
EMBEDDED_PPO = {"learning_rate": 3e-4, "init_kl_coef": 0.1, "batch_size": 16, "mini_batch_size": 8}
EMBEDDED_EPOCHS = 40


@dataclass
class RunArgs:
    """Loop, saving and embedded-mode flags of the PPO scripts (the PPO settings themselves are `PPOConfig`'s)."""

    # `--epoch`: RELC's ppo-sentiment.sh spells it so (its argparse took any unambiguous prefix of --epochs)
    epochs: Annotated[int | None, tyro.conf.arg(aliases=("--epoch",))] = None
    """Passes over the prompt set (None: 1 in paper mode, as RELC; EMBEDDED_EPOCHS over the small embedded set)."""
    save_freq: int | None = None
    """Save a resumable checkpoint every N steps under <model_save_path>/checkpoint-N."""
    model_save_path: str | None = None
    """Where the final model, tokenizer, value head, reward history and curve go (default outputs/<task>/<run>)."""
    offline: bool = False
    """Embedded mode even when a model is named (the named model must then be a local directory)."""
    embedded_layers: int = 2
    """Embedded policy: transformer layers."""
    embedded_hidden_size: int = 64
    """Embedded policy: width."""
    embedded_warmup_steps: int = 300
    """Embedded policy: LM warm-up steps on the shipped text (cached after the first run)."""


def ppo_mode_defaults(args: Any) -> dict:
    """The `mode_defaults` of the PPO scripts, whose arguments hold `ppo_config` (a `PPOConfig`), `critic` (a
    `CriticRewardConfig`) and `offline`.

    Embedded mode: `EMBEDDED_PPO` (the mini-batch at most the batch). Paper mode: PPOConfig's RELC defaults, the
    mini-batch equal to the batch, the OpenAI-compatible critic. Both: bf16 when `accelerate launch
    --mixed_precision bf16` asked for it.
    """
    if args is None:  # the first parse only learns the mode: any batch size divides into mini-batches of 1
        return {"ppo_config": {"mini_batch_size": 1}}
    # the batch size of the first parse keeps these defaults a valid PPOConfig whatever batch size was asked for
    batch_size = args.ppo_config.batch_size
    ppo = {"bf16": os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16", "batch_size": batch_size}
    if is_embedded(args.ppo_config.model_name, args.offline):
        mini_batch_size = min(EMBEDDED_PPO["mini_batch_size"], batch_size)
        return {"ppo_config": {**EMBEDDED_PPO, **ppo, "mini_batch_size": mini_batch_size}}
    return {"ppo_config": {**ppo, "mini_batch_size": batch_size}, "critic": {"critic_backend": "openai"}}


def epochs_for(run: RunArgs, embedded: bool) -> int:
    """Passes over the prompts: `--epochs`, else 1 in paper mode (RELC's) and `EMBEDDED_EPOCHS` embedded."""
    return run.epochs if run.epochs is not None else (EMBEDDED_EPOCHS if embedded else 1)


def loop_ppo_config(ppo, output_dir: str, **overrides: Any):
    """The PPOConfig a step loop runs with: the script's progress bar (shown unless `--ppo_config.disable_tqdm`)
    and `--save_freq` checkpoints instead of the trainer's. A trainer save schedule given anyway is refused by name:
    the loop would override it."""
    given = [
        f"--ppo_config.{name} {getattr(ppo, name)}"
        for name in ("save_strategy", "save_steps")
        if getattr(ppo, name) != field_default(ppo, name)
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)}: this script saves its own resumable checkpoints (the run history and the critic's "
            "counters with the trainer's); use --save_freq N instead."
        )
    return replace(ppo, output_dir=output_dir, disable_tqdm=True, save_strategy="no", **overrides)


def default_save_path(task: str, intrinsic: bool, given: str | None, ppo=None) -> str:
    """Where the run saves: `--model_save_path` (RELC's flag) or `--ppo_config.output_dir`, else
    outputs/<task>/<run>."""
    output_dir = None if ppo is None or ppo.output_dir in (None, "trainer_output") else ppo.output_dir
    if given and output_dir and os.path.abspath(given) != os.path.abspath(output_dir):
        raise ValueError(
            f"--model_save_path {given} and --ppo_config.output_dir {output_dir} name two places for one run; "
            "give one of them."
        )
    return given or output_dir or str(Path("outputs") / task / ("ppo_intrinsic" if intrinsic else "ppo_baseline"))
