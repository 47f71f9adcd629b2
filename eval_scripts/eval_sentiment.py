"""Sentiment evaluation as in RELC/DExperts: share of positive continuations of neutral prompts.

For each model, `num_return` continuations (nucleus sampling, top-p 0.9, 20 new tokens) are sampled per neutral
prompt and classified; a continuation is positive when the classifier's positive probability is > 0.5. Reported per
model: positive rate (over all samples), mean positive probability and, with `--with_fluency`, the conditional
perplexity under a scoring LM and dist-1/2/3.

Offline (default): the embedded policy, the shipped `neutral_prompts.jsonl` and VADER (compound c -> positive
probability (c + 1) / 2). Paper mode:

    python eval_scripts/eval_sentiment.py --models $CKPT/ppo_intrinsic --classifier \
        distilbert-base-uncased-finetuned-sst-2-english --scoring_model gpt2-xl --with_fluency

Writes `<output_dir>/<run>_generations.jsonl`, `summary.md`/`summary.json` and `comparison.png`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import tyro
from eval_utils import (
    EVAL_DIR,
    ensure_examples_on_path,
    fluency_diversity,
    load_causal_lm,
    load_prompts,
    plot_comparison,
    run_names,
    sample_continuations,
    write_jsonl,
    write_summary,
)

ensure_examples_on_path()
from scorers import VADER, build_sentiment_classifier  # noqa: E402


@dataclass
class SentimentEvalArgs:
    models: list[str] = field(default_factory=lambda: ["embedded:sentiment"])
    """Models to compare: hub ids, saved model directories, or "embedded:sentiment" (the untrained tiny policy)."""
    names: list[str] | None = None
    """Display names of the runs (one per model); default: the directories' base names."""
    prompts_file: str = str(EVAL_DIR / "neutral_prompts.jsonl")
    """Neutral prompts, one {"prompt": {"text": ...}} per line."""
    num_prompts: int | None = None
    """Evaluate only the first N prompts."""
    num_return: int = 25
    """Samples per prompt."""
    max_new_tokens: int = 20
    top_p: float = 0.9
    batch_size: int = 8
    """Prompts per generate call (each expands to `num_return` sequences)."""
    classifier: str = VADER
    """"vader" (offline) or a transformers text-classification model
    (paper: distilbert-base-uncased-finetuned-sst-2-english)."""
    with_fluency: bool = False
    """Also compute conditional perplexity under `scoring_model` and dist-1/2/3."""
    scoring_model: str = "embedded:sentiment"
    """LM for the perplexity (paper: gpt2-xl)."""
    output_dir: str = "outputs/eval_sentiment"
    seed: int = 0


def evaluate(args: SentimentEvalArgs) -> dict[str, dict[str, float]]:
    """Run the evaluation; returns run name -> metrics (also written to `args.output_dir`)."""
    prompts = load_prompts(args.prompts_file, args.num_prompts)
    classify = build_sentiment_classifier(args.classifier)
    scorer = load_causal_lm(args.scoring_model) if args.with_fluency else None
    summary: dict[str, dict[str, float]] = {}
    for model_path, run in zip(args.models, run_names(args.models, args.names)):
        model, tokenizer = load_causal_lm(model_path)
        gens = sample_continuations(
            model,
            tokenizer,
            prompts,
            args.num_return,
            args.max_new_tokens,
            args.top_p,
            args.batch_size,
            args.seed,
            desc=f"sampling {run}",
        )
        probs = [classify(g) for g in gens]
        flat = [p for row in probs for p in row]
        metrics = {
            "positive_rate": sum(p > 0.5 for p in flat) / len(flat),
            "positive_prob": sum(flat) / len(flat),
            "num_samples": len(flat),
        }
        ppl = None
        if scorer is not None:
            fluency, ppl = fluency_diversity(*scorer, prompts, gens)
            metrics.update(fluency)
        rows = []
        for i, (prompt, row) in enumerate(zip(prompts, gens)):
            samples = [{"text": t, "positive_prob": p} for t, p in zip(row, probs[i])]
            if ppl is not None:
                for s, v in zip(samples, ppl[i]):
                    s["perplexity"] = v
            rows.append({"prompt": {"text": prompt}, "generations": samples})
        write_jsonl(Path(args.output_dir) / f"{run}_generations.jsonl", rows)
        summary[run] = metrics
    print(write_summary(summary, args.output_dir))
    plot_comparison(summary, os.path.join(args.output_dir, "comparison.png"), "sentiment on neutral prompts")
    return summary


if __name__ == "__main__":
    evaluate(tyro.cli(SentimentEvalArgs, use_underscores=True))
