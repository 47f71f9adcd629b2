"""Shared pieces of the evaluation scripts: model loading, sampling, scoring LMs, dist-n, tables and plots.

Generations are stored as JSON Lines, one prompt per line, in the format of the RELC / DExperts evaluation code:

    {"prompt": {"text": "The movie starts with"}, "generations": [{"text": " a long shot ...", "positive_prob": 0.9}]}

so the fluency/diversity script can score the output of any of the task scripts.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

EVAL_DIR = Path(__file__).resolve().parent
EXAMPLES_DIR = EVAL_DIR.parent / "examples" / "research_projects"
EMBEDDED = "embedded"
# "embedded-scorer": a scoring LM for perplexity that is neither the policy nor its reference: another seed, width
# 128, warmed up on every shipped English text (reviews, toxicity prompts, news articles and summaries, the kit's
# corpus) and for 100 steps only: longer warm-ups memorise the 200-odd texts and score held-out reviews worse than
# a uniform model would (a check holding out a fifth of the reviews: perplexity > 1,000 after 300-400 steps, about
# 110 after 100). Built once (about 10 s on one core), then cached.
EMBEDDED_SCORER = "embedded-scorer"
EMBEDDED_SCORER_SETTINGS = {"task": "english", "seed": 1000, "num_layers": 2, "hidden_size": 128, "warmup_steps": 100}


def ensure_examples_on_path() -> None:
    """Make `examples/research_projects` importable: the embedded policy and the scorers live there, shared with
    the training scripts."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))


ensure_examples_on_path()
from embedded import embedded_policy, read_jsonl, use_one_thread  # noqa: E402  (read_jsonl: for the eval scripts)
from scorers import continuation_logprobs  # noqa: E402
from text_metrics import distinct_n  # noqa: E402  (distinct_n: shared with the training logs)


def write_jsonl(path: str | os.PathLike, rows: Sequence[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def prompt_text(record: dict) -> str:
    """The prompt of a record in any shape the scripts meet: {"prompt": {"text"}}, {"prompt": str}, {"text"}."""
    prompt = record.get("prompt", record.get("text"))
    if isinstance(prompt, dict):
        prompt = prompt.get("text")
    if not isinstance(prompt, str):
        raise ValueError(f"Record has no prompt text: {record!r}. Give {{'prompt': {{'text': ...}}}} per line.")
    return prompt


def load_prompts(path: str | os.PathLike, limit: int | None = None) -> list[str]:
    prompts = [prompt_text(r) for r in read_jsonl(path)]
    return prompts[:limit] if limit else prompts


def load_causal_lm(name_or_path: str | None, task: str = "sentiment", device: str | None = None):
    """A causal LM and its tokenizer (left padding).

    `name_or_path` is a hub id, a saved model directory (e.g. a training script's `--model_save_path`),
    None / "embedded" / "embedded:<task>" for the tiny warmed-up policy of the embedded offline setting (the
    untrained policy of seed 0: the reference model of a seed-0 run), or "embedded-scorer" for a separately
    trained scoring LM (`EMBEDDED_SCORER_SETTINGS`: neither the policy nor its reference).
    """
    if name_or_path == EMBEDDED_SCORER:
        use_one_thread()
        model, tokenizer = embedded_policy(show_progress=False, **EMBEDDED_SCORER_SETTINGS)
    elif name_or_path is None or name_or_path.startswith(EMBEDDED):
        if ":" in (name_or_path or ""):
            task = name_or_path.split(":", 1)[1]
        use_one_thread()
        model, tokenizer = embedded_policy(task)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), tokenizer


@torch.no_grad()
def sample_continuations(
    model,
    tokenizer,
    prompts: Sequence[str],
    num_return: int = 25,
    max_new_tokens: int = 20,
    top_p: float = 0.9,
    batch_size: int = 8,
    seed: int = 0,
    desc: str = "sampling",
) -> list[list[str]]:
    """`num_return` nucleus-sampled continuations per prompt (decoded, special tokens removed)."""
    torch.manual_seed(seed)
    out: list[list[str]] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc):
        chunk = list(prompts[start : start + batch_size])
        enc = tokenizer(chunk, return_tensors="pt", padding=True).to(model.device)
        ids = model.generate(
            **enc,
            do_sample=True,
            top_p=top_p,
            top_k=0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_return,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        out.extend(texts[i * num_return : (i + 1) * num_return] for i in range(len(chunk)))
    return out


def conditional_perplexity(
    model, tokenizer, prompts: Sequence[str], generations: Sequence[Sequence[str]], desc: str = "perplexity"
) -> list[list[float]]:
    """Perplexity of each generation given its prompt: exp of the mean NLL of the generation's tokens.

    ppl(g | p) = exp(-(1/|g|) * sum_t log P(g_t | p, g_<t)); prompt tokens are context only (`scorers.
    continuation_logprobs`: prompt and generation tokenized apart, then concatenated). DExperts/RELC tokenized
    prompt + generation jointly and subtracted the prompt's loss; the two agree unless BPE merges across the seam.
    A generation with no tokens gets NaN (it has no perplexity), which the averages skip.
    """
    result = []
    for prompt, gens in tqdm(list(zip(prompts, generations)), desc=desc):
        row = []
        for gen in gens:
            logp = continuation_logprobs(model, tokenizer, prompt, gen)
            row.append(math.exp(-logp.mean().item()) if len(logp) else float("nan"))
        result.append(row)
    return result


def mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def fluency_diversity(
    scoring_model, scoring_tokenizer, prompts: Sequence[str], generations: Sequence[Sequence[str]]
) -> tuple[dict[str, float], list[list[float]]]:
    """Mean conditional perplexity and mean per-prompt dist-1/2/3; also returns the per-sample perplexities."""
    ppl = conditional_perplexity(scoring_model, scoring_tokenizer, prompts, generations)
    summary = {"perplexity": mean([mean(row) for row in ppl])}
    for n in (1, 2, 3):
        summary[f"dist-{n}"] = mean([distinct_n(gens, n) for gens in generations])
    return summary, ppl


def write_summary(rows: dict[str, dict[str, float]], output_dir: str | os.PathLike, name: str = "summary") -> str:
    """Write `rows` (run name -> metric -> value) as `<name>.json` and a Markdown table `<name>.md`; returns it."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    metrics = list(dict.fromkeys(k for metrics in rows.values() for k in metrics))
    lines = ["| run | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for run, values in rows.items():
        cells = [_fmt(values.get(m)) for m in metrics]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (output_dir / f"{name}.md").write_text(table, encoding="utf-8")
    return table


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def plot_comparison(rows: dict[str, dict[str, float]], path: str | os.PathLike, title: str = "") -> str:
    """A bar chart per metric comparing the runs (e.g. baseline vs intrinsic); saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in dict.fromkeys(k for v in rows.values() for k in v) if _is_number(rows, m)]
    fig, axes = plt.subplots(1, max(1, len(metrics)), figsize=(3.2 * max(1, len(metrics)), 3.2), squeeze=False)
    runs = list(rows)
    colors = [f"C{i}" for i in range(len(runs))]
    for ax, metric in zip(axes[0], metrics):
        values = [float(rows[r].get(metric, float("nan"))) for r in runs]
        ax.bar(range(len(runs)), values, color=colors)
        ax.set_xticks(range(len(runs)), runs, rotation=30, ha="right", fontsize=8)
        ax.set_title(metric, fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _is_number(rows: dict[str, dict], metric: str) -> bool:
    return all(isinstance(v.get(metric, 0.0), int | float) for v in rows.values())


def run_names(models: Sequence[str | None], names: Sequence[str] | None) -> list[str]:
    """Display names of the evaluated runs: `names` when given (one per model), else the model paths' base names."""
    if names:
        if len(names) != len(models):
            raise ValueError(f"--names has {len(names)} entries for {len(models)} models; give one name per model.")
        return list(names)
    out = []
    for model in models:
        base = EMBEDDED if model is None else Path(model.rstrip("/")).name or model
        base = base.replace(":", "-")  # names become file names
        out.append(base if base not in out else f"{base}-{len(out)}")
    return out


@dataclass
class SamplingArgs:
    """Flags shared by the evaluation scripts that sample continuations of prompts (sentiment, toxicity)."""

    names: list[str] | None = None
    """Display names of the runs (one per model or file); default: the directories' / files' base names."""
    num_prompts: int | None = None
    """Evaluate only the first N prompts."""
    num_return: int = 25
    """Samples per prompt."""
    max_new_tokens: int = 20
    top_p: float = 0.9
    batch_size: int = 8
    """Prompts per generate call (each expands to `num_return` sequences)."""
    with_fluency: bool = False
    """Also compute conditional perplexity under `scoring_model` and dist-1/2/3."""
    seed: int = 0


def sample_runs(
    models: Sequence[str], args: SamplingArgs, prompts: Sequence[str], task: str
) -> list[tuple[str, list[list[str]]]]:
    """(run name, `args.num_return` continuations per prompt) for each model, sampled as `args` says."""
    runs = []
    for model_path, run in zip(models, run_names(models, args.names)):
        model, tokenizer = load_causal_lm(model_path, task=task)
        gens = sample_continuations(
            model,
            tokenizer,
            prompts,
            num_return=args.num_return,
            max_new_tokens=args.max_new_tokens,
            top_p=args.top_p,
            batch_size=args.batch_size,
            seed=args.seed,
            desc=f"sampling {run}",
        )
        runs.append((run, gens))
    return runs


def read_generations(files: Sequence[str], names: Sequence[str] | None) -> list[tuple[str, list[dict], list[str]]]:
    """(run name, records, prompts) of each generations file; records' "generations" become lists of dicts
    ({"text": ...}) whatever the file had (RELC's decoding.py wrote plain strings)."""
    names = names or [Path(f).name.removesuffix(".jsonl").removesuffix("_generations") for f in files]
    if len(names) != len(files):
        raise ValueError(f"--names has {len(names)} entries for {len(files)} files; give one name per file.")
    out = []
    for path, run in zip(files, names):
        rows = read_jsonl(path)
        for row in rows:
            row["generations"] = [g if isinstance(g, dict) else {"text": g} for g in row["generations"]]
        out.append((run, rows, [prompt_text(r) for r in rows]))
    return out


def generation_rows(prompts: Sequence[str], generations: Sequence[Sequence[str]]) -> list[dict]:
    """Generations records ({"prompt": {"text"}, "generations": [{"text"}, ...]}) of sampled continuations."""
    return [
        {"prompt": {"text": p}, "generations": [{"text": t} for t in gens]} for p, gens in zip(prompts, generations)
    ]


def add_sample_scores(rows: Sequence[dict], key: str, values: Sequence[Sequence[float | None]]) -> None:
    """Store per-sample scores (one list per prompt) under `key` in each generation of `rows`, in place."""
    for row, row_values in zip(rows, values):
        for sample, value in zip(row["generations"], row_values):
            sample[key] = value


def texts_of(rows: Sequence[dict]) -> list[list[str]]:
    """The generation texts of generations records, per prompt."""
    return [[g["text"] for g in r["generations"]] for r in rows]


def finish(summary: dict[str, dict[str, float]], output_dir: str | os.PathLike, title: str) -> None:
    """Print and write the summary table and the comparison plot of an evaluation."""
    print(write_summary(summary, output_dir))
    plot_comparison(summary, Path(output_dir) / "comparison.png", title)
