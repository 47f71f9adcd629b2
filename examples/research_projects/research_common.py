"""Code shared by the RELC reproduction scripts: argument dataclasses, policy and data loading, the intrinsic
reward, the RELC training loop on trl_stable's step API, checkpoints and the reward curve.

Each script runs in one of two modes:

- paper mode (a model is named and `--offline` is not set): the hub models and datasets of the paper;
- embedded mode (no model named, or `--offline`): the tiny warmed-up policy of `embedded.py`, the shipped data,
  local environment rewards (VADER, alt-profanity-check, rouge-score) and the offline lexicon critic. It runs on
  a laptop CPU in minutes and is what the smoke tests run.

Hyper-parameters left at None take the value of the mode (`PAPER_DEFAULTS` / `EMBEDDED_DEFAULTS`): the paper's
learning rate of 1.41e-5 moves a 64-wide model nowhere in a few minutes.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import torch
import tyro
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the task scripts import this module and its neighbours by name
    sys.path.insert(0, str(HERE))

from embedded import embedded_policy  # noqa: E402

# RELC's values (its README commands) for paper mode; values that learn within minutes for the embedded policy.
PAPER_DEFAULTS = {"learning_rate": 1.41e-5, "init_kl_coef": 0.2, "batch_size": 16, "mini_batch_size": 16}
EMBEDDED_DEFAULTS = {"learning_rate": 3e-4, "init_kl_coef": 0.1, "batch_size": 16, "mini_batch_size": 8}
EMBEDDED_EPOCHS = 40


@dataclass
class PPOArgs:
    """The PPO fields of the RELC scripts (`--ppo_config.<field>` in the sentiment script, flat in the others).

    They map onto `trl_stable.PPOConfig` with the same names and meanings. None means "the mode's default".
    """

    model_name: str | None = None
    """Policy: hub id or local path (paper: gpt2-large). None: the embedded tiny policy."""
    learning_rate: float | None = None
    """Adam learning rate (paper 1.41e-5; embedded 3e-4)."""
    batch_size: int | None = None
    """Samples per PPO step and process (paper 16; embedded 16)."""
    mini_batch_size: int | None = None
    """Samples per optimisation mini-batch (paper = batch_size; embedded 8)."""
    gradient_accumulation_steps: int = 1
    ppo_epochs: int = 4
    """Optimisation passes over each batch."""
    target_kl: float | None = 6.0
    """Early-stop the PPO epochs of a step once its KL to the rollout policy passes 1.5 x target_kl (None: never)."""
    early_stopping: bool = True
    """Apply the target_kl early stop. RELC ran TRL 0.x, whose early_stopping defaulted to False, so its
    `--ppo_config.target_kl 6.0` never fired; here it does (the per-step policy KL rarely reaches 9)."""
    kl_penalty: str = "kl"
    """KL estimator of the per-token penalty: kl, abs, mse or full."""
    init_kl_coef: float | None = None
    """Initial KL coefficient of the adaptive controller (paper 0.2; embedded 0.1)."""
    adap_kl_ctrl: bool = True
    target: float = 6.0
    """Target KL of the adaptive controller."""
    horizon: float = 10000.0
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    use_score_scaling: bool = False
    """Divide the environment scores by their running std."""
    use_score_norm: bool = False
    """Also subtract their running mean (needs use_score_scaling)."""
    score_clip: float | None = None
    seed: int = 0
    log_with: str | None = None
    """"wandb" or "tensorboard" (None: no tracker)."""
    bf16: bool | None = None
    """bf16 autocast; None: on when `accelerate launch --mixed_precision bf16` asked for it."""
    num_shared_layers: int | None = None
    """Layers the frozen reference model shares with the policy (paper: 20 of gpt2-large's 36)."""


@dataclass
class IntrinsicArgs:
    """RELC's intrinsic-reward flags and the critic backend flags."""

    use_intrinsic_reward: Annotated[bool, tyro.conf.arg(aliases=("--use_instric_reward",))] = False
    """Add the critic's per-token intrinsic rewards (RELC's misspelling --use_instric_reward also works)."""
    positive_reward_value: float = 0.5
    """Reward of a token inside a positive span."""
    negative_reward_value: float = -0.5
    """Reward of a token inside a negative (or toxic) span."""
    intrinsic_reward_threshold: float = 10.0
    """Only samples whose environment reward is <= this are critiqued."""
    prompt_file: str | None = None
    """Few-shot critic template with a "{}" placeholder; default prompts/critic_<task>.txt."""
    critic_backend: str | None = None
    """lexicon (offline), openai (OpenAI or any compatible server, e.g. vLLM) or transformers (local model).
    None: lexicon in embedded mode (reference-overlap critic for summarization), openai in paper mode."""
    critic_model: str | None = None
    """Served model name (openai; default gpt-4o-mini) or local path (transformers)."""
    critic_base_url: str | None = None
    """Base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1."""
    critic_api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the critic's API key (never put keys on the command line)."""
    critic_concurrency: int = 32
    critic_cache_dir: str | None = None
    """On-disk critic answer cache: a restarted run does not pay twice."""
    critic_timeout: float = 30.0
    critic_max_retries: int = 4
    """Retries of a critic request on 429/5xx/timeouts (openai)."""
    critic_rate_limit: float | None = None
    """Most critic requests started per second (openai; None: unlimited)."""
    critic_max_tokens: int = 128


@dataclass
class RunArgs:
    """Loop, saving and embedded-mode flags shared by every script."""

    epochs: int | None = None
    """Passes over the prompt set (None: 1 in paper mode, as RELC; EMBEDDED_EPOCHS over the small embedded set)."""
    max_steps: int | None = None
    """Stop after this many PPO steps (default: `epochs` full passes)."""
    save_freq: int | None = None
    """Save a resumable checkpoint every N steps under <model_save_path>/checkpoint-N."""
    resume_from_checkpoint: str | None = None
    """A checkpoint-N directory of an earlier run with the same flags: restore weights, optimizer, KL controller,
    score statistics and RNG, and continue at step N+1 with the same prompt order."""
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
    top_k: int = 0
    top_p: float = 1.0
    """Sampling of the rollouts (RELC: top_k 0, top_p 1.0, do_sample)."""


# ---------------------------------------------------------------------------------------------------------- config


def is_embedded(ppo: PPOArgs, run: RunArgs) -> bool:
    return run.offline or ppo.model_name is None


def ppo_args_of(args: Any) -> PPOArgs:
    """The PPO fields of a script's arguments: nested (`--ppo_config.*`, sentiment) or flat (the other scripts)."""
    if isinstance(getattr(args, "ppo_config", None), PPOArgs):
        return args.ppo_config
    return PPOArgs(**{f.name: getattr(args, f.name) for f in fields(PPOArgs)})


def resolve_ppo_args(ppo: PPOArgs, embedded: bool) -> PPOArgs:
    """Fill the None hyper-parameters with the mode's defaults (mini_batch_size follows batch_size in paper mode)."""
    defaults = EMBEDDED_DEFAULTS if embedded else PAPER_DEFAULTS
    values = asdict(ppo)
    for name, value in defaults.items():
        if values[name] is None:
            values[name] = value
    if ppo.mini_batch_size is None and not embedded:
        values["mini_batch_size"] = values["batch_size"]
    values["mini_batch_size"] = min(values["mini_batch_size"], values["batch_size"])
    if values["bf16"] is None:
        values["bf16"] = os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"
    return PPOArgs(**values)


def build_ppo_config(
    ppo: PPOArgs, output_dir: str, min_new_tokens: int, max_new_tokens: int, run: RunArgs, **overrides: Any
):
    """A `trl_stable.PPOConfig` from the script flags: every `PPOArgs` field under its own name (`overrides`: further
    PPOConfig fields)."""
    from trl_stable import PPOConfig

    values = asdict(ppo)
    values["bf16"] = bool(values["bf16"])
    return PPOConfig(
        output_dir=output_dir,
        **values,
        report_to=ppo.log_with or "none",
        min_new_tokens=min_new_tokens,
        max_new_tokens=max_new_tokens,
        top_k=run.top_k,
        top_p=run.top_p,
        disable_tqdm=True,  # the loop shows its own bar with the reward in it
        save_strategy="no",  # the loop saves every --save_freq steps
        **overrides,
    )


def load_policy(ppo: PPOArgs, run: RunArgs, task: str, embedded: bool):
    """(model or model name, tokenizer) of the policy for the mode."""
    if embedded:
        use_one_thread()
    if embedded and ppo.model_name is None:
        model, tokenizer = embedded_policy(
            task,
            seed=ppo.seed,
            num_layers=run.embedded_layers,
            hidden_size=run.embedded_hidden_size,
            warmup_steps=run.embedded_warmup_steps,
        )
        return model, tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ppo.model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return ppo.model_name, tokenizer


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


def parse_script_args(cls, argv: Sequence[str] | None = None, description: str | None = None, default: Any = None):
    """tyro with RELC's underscore flag names (``--ppo_config.learning_rate``, ``--use_instric_reward``); `default`
    is an instance whose values replace the dataclass defaults (e.g. read from a YAML config)."""
    return tyro.cli(cls, args=argv, use_underscores=True, description=description, default=default)


SECRET_FIELDS = ("perspective_api", "perspective_api_key", "api_key")
REDACTED = "<redacted>"
_URL_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")


def public_args(args: Any) -> dict:
    """The run's arguments as a dict for `run_args.json`: API keys replaced by "<redacted>", credentials in URLs
    (``http://user:key@host``) removed."""
    out = {}
    for f in fields(args):
        value = getattr(args, f.name)
        if hasattr(value, "__dataclass_fields__"):
            value = public_args(value)
        elif f.name in SECRET_FIELDS and value:
            value = REDACTED
        elif isinstance(value, str):
            value = _URL_USERINFO.sub(r"\1", value)
        out[f.name] = value
    return out


def redact_argv(argv: list[str]) -> None:
    """Replace, in place, the values of secret flags (`--perspective_api KEY`) in a command line once it is parsed:
    trackers such as wandb record `sys.argv` with the run."""
    for i, arg in enumerate(argv):
        name, eq, _ = arg.partition("=")
        if name.lstrip("-") in SECRET_FIELDS:
            if eq:
                argv[i] = f"{name}={REDACTED}"
            elif i + 1 < len(argv):
                argv[i + 1] = REDACTED


def save_run_args(args: Any, save_path: str) -> None:
    os.makedirs(save_path, exist_ok=True)
    with open(os.path.join(save_path, "run_args.json"), "w", encoding="utf-8") as f:
        json.dump(public_args(args), f, indent=2, default=str)


# ----------------------------------------------------------------------------------------------- intrinsic reward


def build_intrinsic_reward(args: IntrinsicArgs, task: str, tokenizer, embedded: bool, backend=None):
    """The dense critic reward (`trl_stable.rewards.CriticIntrinsicReward`), or None when it is off."""
    if not args.use_intrinsic_reward:
        return None
    from trl_stable.rewards import CriticIntrinsicReward, CriticRewardConfig

    name = args.critic_backend or ("lexicon" if embedded else "openai")
    lexicon_summary = name == "lexicon" and task == "summarization"
    if lexicon_summary and backend is None:
        raise ValueError("critic_backend='lexicon' for summarization needs the script's offline backend.")
    # every critic flag under its own name; task and backend are resolved here
    shared = {
        f.name: getattr(args, f.name)
        for f in fields(CriticRewardConfig)
        if hasattr(args, f.name) and f.name not in ("critic_task", "critic_backend")
    }
    config = CriticRewardConfig(
        **shared,
        critic_task=task,
        # the library's lexicon critic has no summarization lexicon; the script passes its own offline backend
        critic_backend="openai" if lexicon_summary else name,
    )
    return CriticIntrinsicReward(config, tokenizer, backend=backend)


# ------------------------------------------------------------------------------------------------------ the loop


@dataclass
class Task:
    """What a script plugs into `train_relc`."""

    name: str
    queries: list[dict]
    """Prompt records: {"query": text, "input_ids": list[int], ...extra columns for the reward}."""
    env_reward: Callable[[list[dict], list[str], list[str]], list[float]]
    """(records, query texts, response texts) -> one environment reward per sample."""
    intrinsic: Any = None
    """A dense reward callable (or None)."""


def run_relc(
    args: Any,
    task: str,
    embedded: bool,
    build_queries: Callable[[Any], list[dict]],
    env_reward: Callable[[list[dict], list[str], list[str]], list[float]],
    min_new_tokens: int,
    max_new_tokens: int,
    peft_config: Any = None,
    config_overrides: dict | None = None,
    critic_backend: Any = None,
) -> list[dict]:
    """Everything a RELC script does after reading its task data: policy, PPOTrainer, critic, `train_relc`.

    Args:
        args: The script's arguments (`IntrinsicArgs` + `RunArgs` + PPO fields, nested or flat).
        task: "sentiment", "toxicity" or "summarization" (embedded policy, critic format, default save path).
        embedded: Embedded mode (see `is_embedded`).
        build_queries: tokenizer -> prompt records for `Task.queries`.
        env_reward: The environment reward of `Task.env_reward`.
        min_new_tokens, max_new_tokens: Response length range.
        peft_config: A peft config: train a LoRA adapter (the reference is the adapter-free policy).
        config_overrides: Further `PPOConfig` fields.
        critic_backend: A `CriticBackend` replacing the one `--critic_backend` names (offline summarization critic).

    Returns:
        The per-step history of `train_relc`.
    """
    from trl_stable import PPOTrainer

    ppo = resolve_ppo_args(ppo_args_of(args), embedded)
    save_path = default_save_path(task, args.use_intrinsic_reward, args.model_save_path)
    model, tokenizer = load_policy(ppo, args, task, embedded)
    queries = build_queries(tokenizer)
    config = build_ppo_config(ppo, save_path, min_new_tokens, max_new_tokens, args, **(config_overrides or {}))
    trainer = PPOTrainer(model, args=config, processing_class=tokenizer, peft_config=peft_config)
    if trainer.accelerator.is_main_process:
        save_run_args(args, save_path)
    intrinsic = build_intrinsic_reward(args, task, tokenizer, embedded, backend=critic_backend)
    spec = Task(name=task, queries=queries, env_reward=env_reward, intrinsic=intrinsic)
    return train_relc(trainer, spec, args, save_path, ppo.batch_size, ppo.seed, embedded)


def train_relc(
    trainer, task: Task, run: RunArgs, save_path: str, batch_size: int, seed: int, embedded: bool
) -> list[dict]:
    """RELC's training loop on the step API: generate, score, add intrinsic rewards, `trainer.step`.

    Per sample: the environment score goes to `step(scores=...)` (so PPOConfig's score scaling/clipping apply) and
    lands on the last response token; the critic's per-token rewards go to `token_rewards`. Each process takes its
    own shard of the prompts. Saves a checkpoint every `run.save_freq` steps, and at the end the model, the reward
    history (`reward_history.jsonl`) and the reward curve (`reward_curve.png`) under `save_path`.

    Returns:
        The per-step history: env reward mean, intrinsic reward mean, KL, ...
    """
    acc = trainer.accelerator
    rank, world = acc.process_index, acc.num_processes
    shard = task.queries[rank::world]
    # From the smallest shard, not this one: shards differ by up to one prompt, and a process that took one step
    # more than the others would wait forever in the step's collective ops.
    steps_per_epoch = len(task.queries) // world // batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(task.queries) // world} prompts per process is fewer than batch_size={batch_size}; "
            "lower the batch size."
        )
    epochs = run.epochs if run.epochs is not None else (EMBEDDED_EPOCHS if embedded else 1)
    total = steps_per_epoch * epochs
    if run.max_steps is not None:
        total = min(total, run.max_steps) if run.max_steps > 0 else total
    tokenizer = trainer.processing_class
    history: list[dict] = []
    rng = random.Random(seed + rank)
    start = 0
    if run.resume_from_checkpoint:
        trainer.load_checkpoint(run.resume_from_checkpoint)
        start = trainer.state.global_step
        history = _read_history(save_path)[:start]
    bar = tqdm(total=total, initial=start, desc=f"PPO {task.name}", disable=not acc.is_local_main_process)
    step = 0
    for _epoch in range(math.ceil(total / steps_per_epoch)):
        order = list(range(len(shard)))
        rng.shuffle(order)
        for b in range(steps_per_epoch):
            if step >= total:
                break
            if step < start:  # resuming: replay the prompt order up to the checkpoint
                step += 1
                continue
            records = [shard[i] for i in order[b * batch_size : (b + 1) * batch_size]]
            queries = [torch.tensor(r["input_ids"], dtype=torch.long) for r in records]
            responses = trainer.generate(queries, return_prompt=False)
            query_texts = [r["query"] for r in records]
            response_texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
            scores = [float(s) for s in task.env_reward(records, query_texts, response_texts)]
            token_rewards = [[0.0] * len(r) for r in responses]
            intrinsic_mean = 0.0
            if task.intrinsic is not None:
                rows = task.intrinsic(
                    prompts=query_texts,
                    completions=response_texts,
                    completion_ids=[r.tolist() for r in responses],
                    env_rewards=scores,
                )
                for acc_row, row in zip(token_rewards, rows):
                    if row is not None:
                        acc_row[:] = [float(v) for v in row]
                intrinsic_mean = sum(sum(r) for r in token_rewards) / len(token_rewards)
            stats = trainer.step(queries, responses, token_rewards, scores=scores)
            step += 1
            record = {
                "step": step,
                "env_reward": _global_mean(acc, scores),
                "intrinsic_reward": _global_mean(acc, [intrinsic_mean]),
                "kl": stats.get("objective/kl", float("nan")),
                "kl_coef": stats.get("objective/kl_coef", float("nan")),
                "response_len": stats.get("tokens/response_len_mean", float("nan")),
            }
            if task.intrinsic is not None and hasattr(task.intrinsic, "metrics"):
                record["critic_rewarded_token_fraction"] = task.intrinsic.metrics().get(
                    "critic/last_rewarded_token_fraction", float("nan")
                )
            history.append(record)
            if task.intrinsic is not None and hasattr(task.intrinsic, "metrics"):
                trainer.log(task.intrinsic.metrics())  # critic counters to the trackers (request/failure counts)
            bar.update(1)
            bar.set_postfix(reward=f"{record['env_reward']:.3f}", kl=f"{record['kl']:.2f}")
            if run.save_freq and step % run.save_freq == 0:
                trainer.save_checkpoint(os.path.join(save_path, f"checkpoint-{step}"))
                if acc.is_main_process:  # a resumed run picks its curve up from here
                    write_history(history, save_path)
    bar.close()
    trainer.save_model(save_path)
    if acc.is_main_process:
        write_history(history, save_path)
        plot_reward_curve({task.name: history}, os.path.join(save_path, "reward_curve.png"))
    if task.intrinsic is not None and hasattr(task.intrinsic, "close"):
        task.intrinsic.close()
    return history


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
