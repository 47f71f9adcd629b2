"""Shared pieces of the method experiments (`exp_ngrpo.py`, `exp_icepop.py`, `exp_routing_replay.py`, `exp_gdpo.py`,
and the set-up of `exp_relc_dense.py`).

Each GRPO experiment trains tiny `trl_stable.testing` models with `trl_stable.GRPOTrainer`, once per arm and seed,
and reports per-step curves (median over seeds with a min-max band), a table of medians and ranges, and a PNG. Runs
are deterministic given the seed (one torch thread, seeded models, data and sampling); the arms of one seed start
from the same weights and see the same prompts. `exp_relc_dense.py` runs the RELC example scripts instead
(`examples_on_path`, `load_example`).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from trl_stable import GRPOConfig, GRPOTrainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
EXAMPLES = REPO / "examples" / "research_projects"
EVAL_SCRIPTS = REPO / "eval_scripts"
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
PROMPTS = [
    "The movie was",
    "I think the",
    "The weather today",
    "She walked to",
    "The report says",
    "We met at",
    "After the game",
    "My favourite food",
]


def quiet() -> None:
    """One thread (tiny models; also what makes a run reproducible) and no per-step log spam."""
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("trl_stable").setLevel(logging.ERROR)


def examples_on_path() -> None:
    """Make the RELC examples' helpers (`examples/research_projects/*.py`) and the evaluation's (`eval_scripts/`)
    importable by name, as the scripts themselves import them."""
    for path in (EXAMPLES, EVAL_SCRIPTS):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def load_example(relative: str):
    """The example script `examples/research_projects/<relative>` as a module, to run its `main` in this process
    (sentiment/ and toxicity/ both hold a `ppo_intrinsic.py`: the module is named after the path)."""
    examples_on_path()
    name = "example_" + relative.removesuffix(".py").replace("/", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / relative)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def parser(doc: str, steps: int, seeds: int, quick_steps: int) -> argparse.ArgumentParser:
    """The flags every experiment has; `--quick` is the CI smoke test (2 seeds, `quick_steps` steps, no PNG unless
    `--png` is given)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=seeds, help="number of seeds (0, 1, ...) per arm")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps per run")
    p.add_argument("--quick", action="store_true", help=f"smoke test: 2 seeds x {quick_steps} steps, no PNG")
    p.add_argument("--png", default=None, help="where to save the figure (default: docs/images/<name>.png)")
    p.set_defaults(quick_steps=quick_steps)
    return p


def finish_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    if args.quick:
        args.seeds, args.steps = 2, args.quick_steps
    if args.png is None and not args.quick:
        args.png = str(IMAGES / f"{name}.png")
    return args


@dataclass
class Runs:
    """Per-step curves of every (arm, seed): ``curves[arm][metric]`` is a list (one per seed) of 1-D arrays."""

    arms: list[str]
    curves: dict[str, dict[str, list[np.ndarray]]] = field(default_factory=dict)
    extra: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def add(self, arm: str, metrics: dict[str, Sequence[float]], extra: dict[str, float] | None = None) -> None:
        per_arm = self.curves.setdefault(arm, {})
        for name, values in metrics.items():
            per_arm.setdefault(name, []).append(np.asarray(values, dtype=float))
        for name, value in (extra or {}).items():
            self.extra.setdefault(arm, {}).setdefault(name, []).append(float(value))

    def matrix(self, arm: str, metric: str) -> np.ndarray:
        """[seeds, steps] (runs cut to the shortest one)."""
        rows = self.curves[arm][metric]
        n = min(len(r) for r in rows)
        return np.stack([r[:n] for r in rows])


def run_seeds(arms: Sequence[str], seeds: int, run: Callable[[str, int], tuple[dict, dict]]) -> Runs:
    """`run(arm, seed) -> (per-step metrics, per-run scalars)` for every seed and arm (arms interleaved per seed, so
    machine noise and any drift hit them alike); prints one line per run."""
    runs = Runs(list(arms))
    for seed in range(seeds):
        for arm in arms:
            start = time.perf_counter()
            metrics, extra = run(arm, seed)
            runs.add(arm, metrics, extra)
            print(f"  seed {seed} {arm:<24} {time.perf_counter() - start:5.1f}s", flush=True)
    return runs


def train_grpo(
    model: torch.nn.Module,
    tokenizer,
    reward_funcs: list[Callable],
    seed: int,
    steps: int,
    prompts: Sequence[str] = PROMPTS,
    trainer_cls: type[GRPOTrainer] = GRPOTrainer,
    callbacks: Sequence[Any] = (),
    **config: Any,
) -> tuple[GRPOTrainer, list[dict[str, float]]]:
    """Train `model` for `steps` optimizer steps; returns the trainer and its per-step logs (one dict per step).

    Defaults: one generation batch per optimizer step (on-policy, `num_iterations=1`), constant learning rate, no
    health monitor (it only reads logs, but its mismatch monitor would record sampler log-probs in every arm).
    """
    with tempfile.TemporaryDirectory() as out:
        settings: dict[str, Any] = dict(
            output_dir=out,
            per_device_train_batch_size=32,
            num_generations=8,
            max_completion_length=4,
            learning_rate=2e-2,
            lr_scheduler_type="constant",
            max_steps=steps,
            logging_steps=1,
            seed=seed,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            health_monitor=False,
        )
        settings.update(config)
        args = GRPOConfig(**settings)
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": list(prompts) * max(1, steps * 4)}),
            processing_class=tokenizer,
            callbacks=list(callbacks),
        )
        trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for a printer of every log
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return trainer, logs


def column(logs: list[dict[str, float]], key: str) -> list[float]:
    return [float(h.get(key, math.nan)) for h in logs]


def random_token_sets(vocab_size: int, sizes: Sequence[int], seed: int, skip: int = 8) -> list[list[int]]:
    """Disjoint random sets of token ids (ids below `skip` are the special tokens and are never drawn)."""
    generator = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(vocab_size - skip, generator=generator) + skip).tolist()
    out, start = [], 0
    for size in sizes:
        out.append(perm[start : start + size])
        start += size
    return out


def target_share_reward(tokenizer, seed: int, size: int = 128) -> Callable:
    """The reward of the IcePop and routing-replay tasks: the share of a completion's tokens that lie in one random
    set of `size` token ids (drawn with `seed`; about 12% of the tiny vocabulary for 128), 0 for an empty one."""
    target = set(random_token_sets(len(tokenizer), [size], seed=seed)[0])

    def in_target_share(completion_ids, **kwargs):
        return [sum(t in target for t in ids) / max(len(ids), 1) for ids in completion_ids]

    return in_target_share


# ---------------------------------------------------------------------------------------------- summaries
def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average along the last axis (window clipped at the start)."""
    if window <= 1:
        return y
    c = np.cumsum(np.pad(y, [(0, 0)] * (y.ndim - 1) + [(1, 0)]), axis=-1)
    idx = np.arange(y.shape[-1])
    lo = np.maximum(idx + 1 - window, 0)
    return (c[..., idx + 1] - c[..., lo]) / (idx + 1 - lo)


def steps_to(curve: np.ndarray, level: float, window: int = 5) -> float:
    """First step (1-based) where the `window`-step moving average reaches `level`; inf if never."""
    hit = np.nonzero(smooth(curve[None], window)[0] >= level)[0]
    return float(hit[0] + 1) if hit.size else math.inf


def med_range(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """'median (min-max)'; inf (never reached) is written as 'never', with the count of runs that got there."""
    values = list(values)

    def f(v: float) -> str:
        return "never" if math.isinf(v) else fmt.format(v)

    if not values:
        return "-"
    text = f"{f(statistics.median(values))} ({f(min(values))}-{f(max(values))})"
    reached = sum(not math.isinf(v) for v in values)
    return text if reached == len(values) else f"{text}, {reached}/{len(values)} reached"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Print (and return) a markdown table."""
    lines = [f"\n{title}\n", "| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def band(ax, y: np.ndarray, label: str, color: str, window: int = 1, x: np.ndarray | None = None) -> None:
    """Median over seeds (line) and min-max over seeds (shaded) of [seeds, steps] curves, smoothed per seed."""
    y = smooth(y, window)
    x = np.arange(1, y.shape[1] + 1) if x is None else x
    ax.plot(x, np.median(y, axis=0), color=color, lw=2, label=label)
    ax.fill_between(x, y.min(axis=0), y.max(axis=0), color=color, alpha=0.18, lw=0)


def figure(ncols: int, nrows: int = 1, width: float = 4.6, height: float = 3.6):
    """A grid of `nrows` x `ncols` panels of `width` x `height` inches; returns (figure, flat list of axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes.ravel()


def arm_bands(ax, runs: Runs, keys: Sequence[str], metric: str, labels: dict[str, str] | None = None, **kw) -> None:
    """One `band` per arm (`keys`, in `COLORS` order) of `metric`; `kw` goes to `band` (window, x)."""
    for key, color in zip(keys, COLORS, strict=False):
        band(ax, runs.matrix(key, metric), (labels or {}).get(key, key), color, **kw)


def save(fig, path: str | None, title: str) -> None:
    """Title the figure, lay it out and write it to `path` (no file when `path` is None)."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        print(f"\nsaved {path}")
    plt.close(fig)
