"""Fluency and diversity of generations files: conditional perplexity under a scoring LM, dist-1/2/3.

Reads one or more generations files written by the other evaluation scripts (or RELC's `decoding.py`), so several
runs (e.g. baseline vs intrinsic) are compared side by side:

    python eval_scripts/eval_perplexity_dist.py --generations_files outputs/eval_sentiment/baseline_generations.jsonl \
        outputs/eval_sentiment/intrinsic_generations.jsonl --scoring_model gpt2-xl

perplexity: mean over prompts of the mean over samples of exp(mean token NLL of the sample given its prompt).
dist-n: per prompt, distinct word n-grams over all its samples / total words of those samples; mean over prompts
(definitions: docs/evaluation.md). Writes `<run>_scored.jsonl` (each sample with its perplexity), `summary.md`/`.json`,
`comparison.png`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tyro
from eval_utils import (
    add_sample_scores,
    finish,
    fluency_diversity,
    load_causal_lm,
    read_generations,
    texts_of,
    write_jsonl,
)


@dataclass
class FluencyEvalArgs:
    generations_files: list[str]
    """JSON Lines files with {"prompt": {"text"}, "generations": [{"text"}, ...]} per line."""
    names: list[str] | None = None
    """Display names (one per file); default: the file names without `_generations.jsonl`."""
    scoring_model: str = "embedded:sentiment"
    """LM that scores the perplexity (paper: gpt2-xl); "embedded:<task>" is the tiny offline policy."""
    output_dir: str = "outputs/eval_fluency"


def evaluate(args: FluencyEvalArgs) -> dict[str, dict[str, float]]:
    scorer = load_causal_lm(args.scoring_model)
    summary = {}
    for run, rows, prompts in read_generations(args.generations_files, args.names):
        metrics, ppl = fluency_diversity(*scorer, prompts, texts_of(rows))
        add_sample_scores(rows, "perplexity", ppl)
        write_jsonl(Path(args.output_dir) / f"{run}_scored.jsonl", rows)
        summary[run] = metrics
    finish(summary, args.output_dir, "fluency and diversity")
    return summary


if __name__ == "__main__":
    evaluate(tyro.cli(FluencyEvalArgs, use_underscores=True))
