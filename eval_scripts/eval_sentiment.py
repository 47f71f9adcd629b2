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

from dataclasses import dataclass, field
from pathlib import Path

import tyro
from eval_utils import (
    EVAL_DIR,
    SamplingArgs,
    add_sample_scores,
    ensure_examples_on_path,
    finish,
    fluency_diversity,
    generation_rows,
    load_causal_lm,
    load_prompts,
    sample_runs,
    write_jsonl,
)

ensure_examples_on_path()
from scorers import VADER, build_sentiment_classifier  # noqa: E402


@dataclass
class SentimentEvalArgs(SamplingArgs):
    models: list[str] = field(default_factory=lambda: ["embedded:sentiment"])
    """Models to compare: hub ids, saved model directories, or "embedded:sentiment" (the untrained tiny policy)."""
    prompts_file: str = str(EVAL_DIR / "neutral_prompts.jsonl")
    """Neutral prompts, one {"prompt": {"text": ...}} per line."""
    classifier: str = VADER
    """"vader", "textblob" or "afinn" (offline lexicons; "vader" is the embedded training reward, "afinn" the
    embedded critic's lexicon) or a transformers text-classification model
    (paper: distilbert-base-uncased-finetuned-sst-2-english)."""
    scoring_model: str = "embedded:sentiment"
    """LM for the perplexity (paper: gpt2-xl; "embedded-scorer": a tiny LM trained apart from the policies)."""
    output_dir: str = "outputs/eval_sentiment"


def sentiment_metrics(probs: list[list[float]]) -> dict[str, float]:
    """positive_rate: share of all samples whose positive probability is > 0.5 (equal to the mean over prompts of
    the per-prompt share, every prompt having the same number of samples); positive_prob: their mean probability."""
    flat = [p for row in probs for p in row]
    return {
        "positive_rate": sum(p > 0.5 for p in flat) / len(flat),
        "positive_prob": sum(flat) / len(flat),
        "num_samples": len(flat),
    }


def evaluate(args: SentimentEvalArgs) -> dict[str, dict[str, float]]:
    """Run the evaluation; returns run name -> metrics (also written to `args.output_dir`)."""
    prompts = load_prompts(args.prompts_file, args.num_prompts)
    classify = build_sentiment_classifier(args.classifier)
    scorer = load_causal_lm(args.scoring_model) if args.with_fluency else None
    summary: dict[str, dict[str, float]] = {}
    for run, gens in sample_runs(args.models, args, prompts, task="sentiment"):
        probs = [classify(g) for g in gens]
        metrics = sentiment_metrics(probs)
        rows = generation_rows(prompts, gens)
        add_sample_scores(rows, "positive_prob", probs)
        if scorer is not None:
            fluency, ppl = fluency_diversity(*scorer, prompts, gens)
            metrics.update(fluency)
            add_sample_scores(rows, "perplexity", ppl)
        write_jsonl(Path(args.output_dir) / f"{run}_generations.jsonl", rows)
        summary[run] = metrics
    finish(summary, args.output_dir, "sentiment on neutral prompts")
    return summary


if __name__ == "__main__":
    evaluate(tyro.cli(SentimentEvalArgs, use_underscores=True))
