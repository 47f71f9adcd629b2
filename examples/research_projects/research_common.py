"""Helpers shared by the RELC reproduction scripts: argument parsing (`--config FILE` + flags), mode defaults,
policy and data loading, the intrinsic reward, prompt batches, the run log (history, checkpoints, reward curve).

The algorithm itself (generate -> environment reward -> critic -> PPO step) is written out in each script.

Each script runs in one of two modes:

- paper mode (a model is named and `--offline` is not set): the hub models and datasets of the paper;
- embedded mode (no model named, or `--offline`): the tiny warmed-up policy of `embedded.py`, the shipped data,
  local environment rewards (VADER, alt-profanity-check, rouge-score) and the offline lexicon critic. It runs on
  a laptop CPU in minutes and is what the smoke tests run.

A few defaults depend on the mode (`ppo_mode_defaults`): the paper's learning rate of 1.41e-5 moves a 64-wide model
nowhere in a few minutes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import typing
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Annotated, Any, TypeVar

import torch
import tyro
import yaml
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the task scripts import this module and its neighbors by name
    sys.path.insert(0, str(HERE))

from embedded import embedded_policy  # noqa: E402

from trl_stable import PPOConfig  # noqa: E402
from trl_stable.redaction import redact, redact_argv  # noqa: E402

T = TypeVar("T")
logger = logging.getLogger(__name__)
# Paper mode keeps trl_stable.PPOConfig's defaults (learning rate 1.41e-5 as RELC's commands pass it, init KL
# coefficient 0.2, batch 16), with the mini-batch following the batch; these learn within minutes on the embedded
# policy.
EMBEDDED_PPO = {"learning_rate": 3e-4, "init_kl_coef": 0.1, "batch_size": 16, "mini_batch_size": 8}
EMBEDDED_EPOCHS = 40


# RELC flags that configure nothing here, with why: accepted (RELC's commands pass them), recorded in run_args.json,
# and named in one warning by `warn_ignored_relc_flags`.
RELC_IGNORED_FLAGS = {
    "tracker_project_name": (
        "RELC's accelerate tracker project; transformers' report_to integrations name their project themselves "
        "(wandb: set the WANDB_PROJECT environment variable)"
    ),
}


@dataclass
class RelcPPOConfig(PPOConfig):
    """`trl_stable.PPOConfig` plus the RELC PPOConfig fields that have no meaning here (accepted and ignored)."""

    tracker_project_name: str | None = None
    """Ignored (RELC's wandb project name; set WANDB_PROJECT instead). Recorded in run_args.json."""


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


# ------------------------------------------------------------------------------------------------------- arguments


def parse_script_args(
    cls: type[T],
    argv: Sequence[str] | None = None,
    description: str | None = None,
    file_values: Mapping[str, Any] | None = None,
) -> T:
    """A script's arguments from `--config FILE` (YAML) and the command line, with RELC's underscore flag names.

    Precedence: the dataclass defaults, then its mode defaults, then the YAML file, then the command line. YAML values
    are converted to each field's declared type by the same parser that reads the flags (so `learning_rate: 1e-4`
    is a float, not YAML's string), nested mappings go to nested dataclasses (`ppo_config:`, `grpo:`, ...).

    Args:
        cls: The script's argument dataclass. Defaults that depend on other flags (the embedded or paper mode) come
            from its static method `mode_defaults`, if it has one: `cls.mode_defaults(first)` gives nested field
            values for a second parse, `first` being a parse with `cls.mode_defaults(None)` (defaults loose enough
            for any flags the second parse accepts).
        argv: The flags (default `sys.argv[1:]`).
        description: The help text's headline.
        file_values: Values already read from a config file (instead of a `--config` flag).
    """
    from_sys_argv = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file, argv = pop_config_flag(argv)
    values = dict(file_values or {})
    values.update(read_config(config_file))
    base = cls()

    def parse(extra: Mapping[str, Any]) -> T:
        default = with_values(with_values(base, extra, "mode defaults"), values, config_file or "config")
        with warnings.catch_warnings():
            # TrainingArguments turns its accelerator_config into an object its own annotation does not name
            warnings.filterwarnings("ignore", message=".*AcceleratorConfig.*does not match", category=UserWarning)
            return tyro.cli(cls, args=argv, use_underscores=True, description=description, default=default)

    mode_defaults = getattr(cls, "mode_defaults", None)
    if mode_defaults is None or "-h" in argv or "--help" in argv:
        args = parse({})
    else:
        args = parse(mode_defaults(parse(mode_defaults(None))))
        # RELC flags whose meaning differs from the field they map onto (a length range) are converted once, here
        finalize = getattr(cls, "finalize", None)
        args = finalize(args) if finalize is not None else args
        warn_ignored_relc_flags(args)
    if from_sys_argv:  # parsed: trackers (wandb) record sys.argv with the run, so its secrets go now
        redact_argv(sys.argv)
    return args


def relc_length_range(min_length: int | None, max_length: int | None, ppo) -> dict[str, int | None]:
    """`min_new_tokens` / `max_new_tokens` for RELC's length flags: RELC drew each length from its
    `LengthSampler(min, max)`, i.e. `range(min, max)`, which excludes `max`; PPOConfig's range includes both ends.
    A bound not given keeps `ppo`'s value."""
    if min_length is None and max_length is None:
        return {}
    low = ppo.min_new_tokens if min_length is None else min_length
    high = ppo.max_new_tokens if max_length is None else max_length - 1
    if low is not None and high < low:
        raise ValueError(
            f"RELC's length range [{low}, {max_length}) is empty (its upper bound is excluded); "
            "give a maximum above the minimum."
        )
    return {"min_new_tokens": low, "max_new_tokens": high}


def ignored_relc_flags(args: Any, prefix: str = "") -> dict[str, Any]:
    """{flag path: value} of the `RELC_IGNORED_FLAGS` fields set in `args` (nested dataclasses included)."""
    found = {}
    for f in fields(args):
        value = getattr(args, f.name)
        if is_dataclass(value):
            found.update(ignored_relc_flags(value, f"{prefix}{f.name}."))
        elif f.name in RELC_IGNORED_FLAGS and value is not None:
            found[f"{prefix}{f.name}"] = value
    return found


def warn_ignored_relc_flags(args: Any) -> None:
    """One warning naming every RELC flag of the run that configures nothing here, and why (once per run: on the
    main process only, where `accelerate launch` sets RANK)."""
    found = ignored_relc_flags(args)
    if not found or os.environ.get("RANK", "0") != "0":
        return
    reasons = "; ".join(
        f"--{path} {value!r}: {RELC_IGNORED_FLAGS[path.rsplit('.', 1)[-1]]}" for path, value in found.items()
    )
    warnings.warn(f"Ignored RELC flags (recorded in run_args.json, no effect on the run): {reasons}.", stacklevel=2)


def pop_config_flag(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the file of `--config FILE` or `--config=FILE`, the other flags)."""
    rest, config = [], None
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name == "--config":
            config = value if eq else next(args, None)
            if not config:
                raise ValueError("--config needs a YAML file.")
        else:
            rest.append(arg)
    return config, rest


def read_config(path: str | None) -> dict[str, Any]:
    """The mapping of a YAML config file ({} for None)."""
    if path is None:
        return {}
    if not Path(path).is_file():
        raise ValueError(f"--config {path!r} does not exist.")
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file is a mapping of field names to values.")
    return data


def with_values(instance: T, values: Mapping[str, Any], source: str = "config") -> T:
    """`instance` with `values` (nested mappings for nested dataclasses), each converted to its field's type."""
    if not values:
        return instance
    hints = typing.get_type_hints(type(instance))
    names = {f.name for f in fields(instance) if f.init}
    changes = {}
    for name, value in values.items():
        if name not in names:
            raise ValueError(f"{source}: {type(instance).__name__} has no field {name!r}.")
        current = getattr(instance, name)
        if is_dataclass(current) and isinstance(value, Mapping):
            changes[name] = with_values(current, value, source)
        else:
            changes[name] = typed_value(hints[name], value)
    return replace(instance, **changes)


def typed_value(hint: Any, value: Any) -> Any:
    """`value` read as a command-line value of type `hint` (tyro's conversion; YAML reads `1e-4` as a string)."""
    if isinstance(value, Mapping):  # dict fields (generation_kwargs, ...) have no command-line form to go through
        return dict(value)
    if isinstance(value, str) and str in (typing.get_args(hint) or (hint,)):
        return value  # a string field takes the text as it is (tyro would read "-x" as a flag)
    tokens = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return tyro.cli(hint, args=tokens)


def is_embedded(model_name: str | None, offline: bool) -> bool:
    return offline or model_name is None


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


def loop_ppo_config(ppo, output_dir: str, **overrides: Any):
    """The PPOConfig a step loop runs with: its own progress bar and checkpoints instead of the trainer's."""
    return replace(ppo, output_dir=output_dir, disable_tqdm=True, save_strategy="no", **overrides)


def load_policy(model_name: str | None, seed: int, run: RunArgs, task: str, embedded: bool):
    """(model or model name, tokenizer) of the policy for the mode."""
    if embedded:
        use_one_thread()
    if embedded and model_name is None:
        return embedded_policy(
            task,
            seed=seed,
            num_layers=run.embedded_layers,
            hidden_size=run.embedded_hidden_size,
            warmup_steps=run.embedded_warmup_steps,
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model_name, tokenizer


def load_script_module(path: str | os.PathLike, name: str):
    """Import a script by file path under a unique module name (sentiment/ and toxicity/ both have a
    `ppo_intrinsic.py`, which a plain import by name would confuse)."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def use_one_thread() -> None:
    """One torch thread unless the user chose (OMP_NUM_THREADS): for a 64-wide model, thread hand-offs cost more
    than they give, and on a busy machine two threads ran a forward pass 30x slower than one."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def default_save_path(task: str, intrinsic: bool, given: str | None) -> str:
    return given or str(Path("outputs") / task / ("ppo_intrinsic" if intrinsic else "ppo_baseline"))


def public_args(args: Any) -> dict:
    """The run's arguments as a dict for `run_args.json`: every secret field (`hub_token`, `perspective_api`, any
    `*_token` / `*_key` / `*_secret`, see `trl_stable.redaction.is_secret_name`) replaced by "<redacted>", credentials
    in URLs (``http://user:key@host``) removed."""
    return redact(args)


def save_run_args(args: Any, save_path: str) -> None:
    os.makedirs(save_path, exist_ok=True)
    with open(os.path.join(save_path, "run_args.json"), "w", encoding="utf-8") as f:
        json.dump(public_args(args), f, indent=2, default=str)


# ----------------------------------------------------------------------------------------------- intrinsic reward


def build_intrinsic_reward(config, task: str, tokenizer, backend=None):
    """The dense critic reward (`trl_stable.rewards.CriticIntrinsicReward`) a `CriticRewardConfig` asks for, for
    `task`, or None when it is off. `backend` replaces the backend the config names."""
    if not config.use_intrinsic_reward:
        return None
    from trl_stable.rewards import CriticIntrinsicReward

    if backend is None and config.critic_backend == "lexicon" and task == "summarization":
        raise ValueError("critic_backend='lexicon' for summarization needs the script's offline backend.")
    # CriticRewardConfig has no summarization lexicon and rejects the pair; a backend passed in stands in for it
    name = "openai" if backend is not None else config.critic_backend
    config = replace(config, critic_task=task, critic_backend=name)
    if task == "toxicity" and config.positive_reward_value != 0.0:
        config = relc_toxicity_values(config)
    return CriticIntrinsicReward(config, tokenizer, backend=backend)


def relc_toxicity_values(config):
    """RELC's toxicity meaning of ``--positive_reward_value``: the toxicity critic names only toxic spans, so RELC's
    positive value is the reward of every token *outside* them (its `.sh`: +0.1), our `outside_span_reward_value`
    (`trl_stable.rewards.intrinsic.relc_token_reward_values`)."""
    from trl_stable.compat.relc_critic import relc_token_reward_values

    if config.outside_span_reward_value != 0.0:
        raise ValueError(
            f"--positive_reward_value {config.positive_reward_value} (RELC's reward outside toxic spans) and "
            f"--outside_span_reward_value {config.outside_span_reward_value} name the same reward for toxicity; "
            "pass one of them."
        )
    values = (config.positive_reward_value, config.negative_reward_value)
    pos, neg, outside = relc_token_reward_values("toxicity", *values)
    logger.info(f"toxicity: --positive_reward_value {outside} is RELC's reward of every token outside a toxic span")
    return replace(config, positive_reward_value=pos, negative_reward_value=neg, outside_span_reward_value=outside)


def critic_token_rewards(critic, prompts: Sequence[str], completions: Sequence[str], responses, env_scores):
    """Per-token intrinsic rewards of `responses` (1-D token tensors): the critic's, or zeros without a critic and
    for the samples it did not critique (environment reward above the threshold, failed request)."""
    rewards = [[0.0] * len(r) for r in responses]
    if critic is None:
        return rewards
    rows = critic(
        prompts=list(prompts),
        completions=list(completions),
        completion_ids=[r.tolist() for r in responses],
        env_rewards=list(env_scores),
    )
    for sample, row in zip(rewards, rows):
        if row is not None:
            sample[:] = [float(v) for v in row]
    return rewards


# ---------------------------------------------------------------------------------------------- loop helpers


def epochs_for(run: RunArgs, embedded: bool) -> int:
    return run.epochs if run.epochs is not None else (EMBEDDED_EPOCHS if embedded else 1)


class PromptBatches:
    """This process's batches of prompt records: `epochs` shuffled passes over its shard of `records`, stopped
    after `max_steps` batches (when > 0). `from_step(start)` replays the shuffles of the skipped steps, so a
    resumed run sees the prompts in the order the uninterrupted one did.
    """

    def __init__(
        self, records: Sequence[dict], accelerator, batch_size: int, epochs: int, max_steps: int | None, seed: int
    ):
        rank, world = accelerator.process_index, accelerator.num_processes
        self.shard = list(records[rank::world])
        self.batch_size, self.seed, self.rank = batch_size, seed, rank
        # From the smallest shard, not this one: shards differ by up to one prompt, and a process that took one step
        # more than the others would wait forever in the step's collective ops.
        self.steps_per_epoch = len(records) // world // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(records) // world} prompts per process is fewer than batch_size={batch_size}; "
                "lower the batch size."
            )
        self.total = self.steps_per_epoch * epochs
        if max_steps is not None and max_steps > 0:
            self.total = min(self.total, max_steps)

    def __len__(self) -> int:
        return self.total

    def from_step(self, start: int = 0) -> Iterator[list[dict]]:
        rng = random.Random(self.seed + self.rank)
        for step in range(self.total):
            b = step % self.steps_per_epoch
            if b == 0:
                order = list(range(len(self.shard)))
                rng.shuffle(order)
            if step >= start:
                yield [self.shard[i] for i in order[b * self.batch_size : (b + 1) * self.batch_size]]


class RunLog:
    """What a step loop records: `run_args.json`, the per-step history (environment and intrinsic reward, KL, ...),
    a progress bar, the critic's counters, a checkpoint every `--save_freq` steps; `finish` saves the model,
    `reward_history.jsonl` and `reward_curve.png` under `save_path`.

    `args` are a PPO script's arguments (`RunArgs` with a `ppo_config`). With `--resume_from_checkpoint` it restores
    the trainer first, and `batches` continues after the checkpoint's step.
    """

    def __init__(self, trainer, task: str, args: Any, save_path: str, embedded: bool, critic=None):
        self.trainer, self.task, self.args, self.save_path = trainer, task, args, save_path
        self.embedded, self.save_freq, self.critic = embedded, args.save_freq, critic
        if trainer.accelerator.is_main_process:
            save_run_args(args, save_path)
        self.history: list[dict] = []
        self.start = self.step = 0
        resume_from = args.ppo_config.resume_from_checkpoint
        if resume_from:
            trainer.load_checkpoint(resume_from, reward_funcs=self._stateful())
            self.start = self.step = trainer.state.global_step
            self.history = _read_history(save_path)[: self.start]

    def _stateful(self) -> list:
        """The critic, whose counters the checkpoints carry (the trainer does not hold it in a step loop)."""
        return [] if self.critic is None else [self.critic]

    def batches(self, records: Sequence[dict]) -> Iterator[list[dict]]:
        """The prompt batches of this process (`PromptBatches`), from the step the run starts at."""
        ppo, acc = self.args.ppo_config, self.trainer.accelerator
        epochs = epochs_for(self.args, self.embedded)
        batches = PromptBatches(records, acc, ppo.batch_size, epochs, ppo.max_steps, ppo.seed)
        desc = f"PPO {self.task}"
        self.bar = tqdm(total=len(batches), initial=self.start, desc=desc, disable=not acc.is_local_main_process)
        return batches.from_step(self.start)

    def record(
        self,
        env_scores: Sequence[float],
        token_rewards: Sequence[Sequence[float]],
        stats: dict,
        responses: Sequence[str] | None = None,
    ) -> dict:
        """Log one step; `responses` (the decoded rollouts) add their distinct-2 (`distinct_n`, this process's
        batch) to the history, which `run_summary` compares at the start and the end of the run."""
        acc = self.trainer.accelerator
        self.step += 1
        intrinsic_mean = sum(sum(r) for r in token_rewards) / len(token_rewards)
        row = {
            "step": self.step,
            "env_reward": _global_mean(acc, env_scores),
            "intrinsic_reward": _global_mean(acc, [intrinsic_mean]),
            "kl": stats.get("objective/kl", float("nan")),
            "kl_coef": stats.get("objective/kl_coef", float("nan")),
            "response_len": stats.get("tokens/response_len_mean", float("nan")),
        }
        if responses is not None:
            row["distinct_2"] = _global_mean(acc, [distinct_n(responses, 2)])
        if self.critic is not None and hasattr(self.critic, "metrics"):
            metrics = self.critic.metrics()
            row["critic_rewarded_token_fraction"] = metrics.get("critic/last_rewarded_token_fraction", float("nan"))
            self.trainer.log(metrics)  # critic counters to the trackers (request/failure counts)
        self.history.append(row)
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{row['env_reward']:.3f}", kl=f"{row['kl']:.2f}")
        if self.save_freq and self.step % self.save_freq == 0:
            path = os.path.join(self.save_path, f"checkpoint-{self.step}")
            self.trainer.save_checkpoint(path, reward_funcs=self._stateful())
            if acc.is_main_process:  # a resumed run picks its curve up from here
                write_history(self.history, self.save_path)
        return row

    def finish(self) -> list[dict]:
        self.bar.close()
        self.trainer.save_model(self.save_path)
        if self.trainer.accelerator.is_main_process:
            write_history(self.history, self.save_path)
            plot_reward_curve({self.task: self.history}, os.path.join(self.save_path, "reward_curve.png"))
        if self.critic is not None and hasattr(self.critic, "close"):
            self.critic.close()
        return self.history


def distinct_n(generations: Sequence[str], n: int) -> float:
    """dist-n of one prompt's samples: distinct word n-grams over all samples / total words of the samples.

    dist-n (docs/evaluation.md) = |{n-grams of all samples}| / sum_i |words(sample_i)|, words = `str.split()`
    (whitespace runs). The denominator is the total word count for every n (not the n-gram count), as in the
    DExperts/RELC code; that code split on single spaces (`split(' ')`), which also counts an empty "word" for the
    leading space of a continuation and for double spaces, giving slightly lower values than here. 0 when there are
    no words. (The evaluation scripts' `eval_utils.distinct_n` is this function.)
    """
    ngrams = set()
    total_words = 0
    for text in generations:
        words = text.split()
        total_words += len(words)
        ngrams.update(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return len(ngrams) / total_words if total_words else 0.0


def sample_preview(trainer, tokenizer, prompts: Sequence[str], max_new_tokens: int, seed: int = 0) -> list[str]:
    """One sampled continuation of each prompt from the trainer's current policy, for a before/after look.

    Drawn under a forked RNG with its own seed, so the run's own random stream (and a resumed run's) is untouched.
    """
    device = trainer.accelerator.device
    devices = [device.index or 0] if device.type == "cuda" else []
    queries = [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            responses = trainer.generate(queries, length_sampler=lambda: max_new_tokens, return_prompt=False)
    finally:
        random.setstate(state)
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


def _window_mean(history: Sequence[dict], key: str) -> float:
    values = [float(h[key]) for h in history if key in h and not math.isnan(float(h[key]))]
    return sum(values) / len(values) if values else float("nan")


def run_summary(
    history: Sequence[dict],
    prompts: Sequence[str],
    before: Sequence[str],
    after: Sequence[str],
    reward_name: str = "environment reward",
    target_kl: float | None = None,
    window: int = 20,
    before_step: int = 0,
) -> str:
    """A short side-by-side of the run's start and end: reward, intrinsic reward, KL, distinct-2 of the rollouts
    (means over the first and the last `window` steps) and one continuation per prompt before and after.

    A reward that rises while the KL runs far past its target or the rollouts lose their diversity is the policy
    exploiting the reward, not learning the task; the summary says so when it sees it (KL above twice the target,
    or distinct-2 down by more than a quarter).
    """
    window = max(1, min(window, len(history) // 2))  # a short run compares its two halves
    first, last = list(history[:window]), list(history[-window:])
    n_first, n_last = (first[-1]["step"] if first else 0), len(history)

    def row(name: str, key: str, fmt: str) -> str:
        a, b = _window_mean(first, key), _window_mean(last, key)
        return f"  {name:<34} {a:{fmt}} -> {b:{fmt}}"

    kl_name = "KL to the reference" + (f" (target {target_kl:g})" if target_kl else "")
    lines = [
        f"Summary: means of steps 1-{n_first} -> steps {max(1, n_last - len(last) + 1)}-{n_last}",
        row(reward_name, "env_reward", ".3f"),
        row("intrinsic reward per sample", "intrinsic_reward", ".3f"),
        row(kl_name, "kl", ".2f"),
        row("distinct-2 of the rollouts", "distinct_2", ".3f"),
    ]
    kl_end = _window_mean(last, "kl")
    d2_start, d2_end = _window_mean(first, "distinct_2"), _window_mean(last, "distinct_2")
    warnings_ = []
    if target_kl and kl_end > 2 * target_kl:
        warnings_.append(f"the KL ends at {kl_end:.1f}, above twice its target {target_kl:g}")
    if d2_start > 0 and d2_end < 0.75 * d2_start:
        warnings_.append(f"distinct-2 fell from {d2_start:.2f} to {d2_end:.2f}")
    if warnings_:
        lines.append(
            "  Caution: " + " and ".join(warnings_) + ": the reward gain is likely the policy exploiting the reward "
            "(repetition, drift), not learning; check the samples and a held-out evaluation (eval_scripts/)."
        )
    lines.append(f"Samples (one continuation per prompt, at step {before_step} and at step {n_last}):")
    for prompt, a, b in zip(prompts, before, after):
        lines.append(f"  {prompt!r}")
        lines.append(f"    before: {' '.join(a.split())!r}")
        lines.append(f"    after:  {' '.join(b.split())!r}")
    return "\n".join(lines)


def _global_mean(acc, values: Sequence[float]) -> float:
    """Mean over all processes, skipping NaN (a sample whose reward could not be computed)."""
    finite = [float(v) for v in values if not math.isnan(float(v))]
    t = torch.tensor([sum(finite), float(len(finite))], device=acc.device)
    if acc.num_processes > 1:
        t = acc.reduce(t, reduction="sum")
    return (t[0] / t[1].clamp(min=1)).item()


def _read_history(save_path: str) -> list[dict]:
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


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (window clipped at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_reward_curve(histories: dict[str, list[dict]], path: str, key: str = "env_reward", window: int = 5) -> str:
    """PNG of the environment reward per step (raw, faint; moving average, bold) for one or more runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, history) in enumerate(histories.items()):
        steps = [h["step"] for h in history]
        values = [h[key] for h in history]
        ax.plot(steps, values, color=f"C{i}", alpha=0.3, linewidth=1)
        ax.plot(steps, smooth(values, window), color=f"C{i}", linewidth=2, label=name)
    ax.set_xlabel("PPO step")
    ax.set_ylabel(key.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def tokenize_queries(tokenizer, texts: Sequence[str], extra: Sequence[dict] | None = None) -> list[dict]:
    """Records {"query", "input_ids", **extra} for `train_relc` (queries with no token are dropped)."""
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids:
            out.append({"query": text, "input_ids": ids, **(extra[i] if extra else {})})
    return out


def truncate_queries(tokenizer, texts: Sequence[str], min_len: int, max_len: int, seed: int) -> list[dict]:
    """RELC's IMDB prompts: each text cut to a random length in [min_len, max_len] tokens (its LengthSampler)."""
    rng = random.Random(seed)
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: rng.randint(min_len, max_len)]
        if ids:
            out.append({"query": tokenizer.decode(ids), "input_ids": ids})
    return out
