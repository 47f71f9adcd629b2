"""Summarization evaluation: ROUGE-1/2/L (F-measure, Porter stemming) and a reward-model preference score.

Each model summarises every article of the evaluation set (prompt "<article>\\nTL;DR:", greedy by default, cut at
the first newline). ROUGE is computed against the reference summary. With `--reward_model_path` (a sequence
classification model with one output, e.g. a TL;DR reward model) each summary and each reference is scored on
"<prompt> <summary>"; reported: the mean reward-model score and the preference rate, the share of articles where
the model's summary scores higher than the reference.

Offline default: the embedded policy on the 6 held-out embedded articles. Paper mode (CarperAI TL;DR data):

    python eval_scripts/eval_summarization.py --models $CKPT/ppo-intrinsic-rouge \
        --dataset CarperAI/openai_summarize_tldr --split test --num_samples 6000 --max_new_tokens 50 \
        --reward_model_path ./rm_checkpoint

Writes `<run>_generations.jsonl`, `summary.md`/`.json`, `comparison.png`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from eval_utils import ensure_examples_on_path, finish, load_causal_lm, read_jsonl, run_names, write_jsonl
from tqdm.auto import tqdm

ensure_examples_on_path()
from embedded import SUMMARY_PROMPT, summarization_records  # noqa: E402
from scorers import RougeScorer  # noqa: E402


@dataclass
class SummarizationEvalArgs:
    models: list[str] | None = None
    """Models (hub ids, saved directories); default: the embedded summarization policy."""
    names: list[str] | None = None
    data_file: str | None = None
    """JSON Lines with "article" and "summary" fields; default: the embedded test split."""
    dataset: str | None = None
    """A hub dataset with "prompt" and "label" columns (paper: CarperAI/openai_summarize_tldr)."""
    split: str = "test"
    num_samples: int | None = None
    """Evaluate only the first N articles."""
    max_new_tokens: int = 50
    do_sample: bool = False
    batch_size: int = 8
    reward_model_path: str | None = None
    """Sequence-classification reward model for the preference score (skipped when not given)."""
    output_dir: str = "outputs/eval_summarization"
    seed: int = 0


def load_pairs(args: SummarizationEvalArgs) -> tuple[list[str], list[str]]:
    """(prompts, references)."""
    if args.dataset:
        from datasets import load_dataset

        ds = load_dataset(args.dataset, split=args.split)
        prompts, refs = list(ds["prompt"]), list(ds["label"])
    else:
        rows = read_jsonl(args.data_file) if args.data_file else summarization_records("test")
        prompts = [SUMMARY_PROMPT.format(article=r["article"]) for r in rows]
        refs = [r["summary"] for r in rows]
    if args.num_samples:
        prompts, refs = prompts[: args.num_samples], refs[: args.num_samples]
    return prompts, refs


@torch.no_grad()
def summarise(model, tokenizer, prompts: list[str], args: SummarizationEvalArgs, desc: str) -> list[str]:
    torch.manual_seed(args.seed)
    out = []
    for start in tqdm(range(0, len(prompts), args.batch_size), desc=desc):
        enc = tokenizer(prompts[start : start + args.batch_size], return_tensors="pt", padding=True).to(model.device)
        ids = model.generate(
            **enc, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, pad_token_id=tokenizer.pad_token_id
        )
        texts = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        out.extend(t.strip().split("\n")[0].strip() for t in texts)
    return out


@torch.no_grad()
def reward_model_scores(path: str, prompts: list[str], summaries: list[str], batch_size: int = 8) -> list[float]:
    """Scalar reward-model score of each "<prompt> <summary>"."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    texts = [f"{p} {s}" for p, s in zip(prompts, summaries)]
    scores = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True, truncation=True)
        scores.extend(model(**enc).logits[:, 0].float().tolist())
    return scores


def evaluate(args: SummarizationEvalArgs) -> dict[str, dict[str, float]]:
    prompts, refs = load_pairs(args)
    rouge = RougeScorer()
    ref_rm = reward_model_scores(args.reward_model_path, prompts, refs) if args.reward_model_path else None
    models = args.models or ["embedded:summarization"]
    summary = {}
    for model_path, run in zip(models, run_names(models, args.names)):
        model, tokenizer = load_causal_lm(model_path, task="summarization")
        preds = summarise(model, tokenizer, prompts, args, desc=f"summarising with {run}")
        scores = rouge(preds, refs)
        metrics = {k: sum(s[k] for s in scores) / len(scores) for k in RougeScorer.TYPES}
        rows = [
            {"prompt": {"text": p}, "reference": r, "generations": [{"text": g, **s}]}
            for p, r, g, s in zip(prompts, refs, preds, scores)
        ]
        if ref_rm is not None:
            rm = reward_model_scores(args.reward_model_path, prompts, preds)
            metrics["rm_score"] = sum(rm) / len(rm)
            metrics["rm_reference_score"] = sum(ref_rm) / len(ref_rm)
            metrics["preference_rate"] = sum(a > b for a, b in zip(rm, ref_rm)) / len(rm)
            for row, a, b in zip(rows, rm, ref_rm):
                row["generations"][0]["rm_score"] = a
                row["reference_rm_score"] = b
        write_jsonl(Path(args.output_dir) / f"{run}_generations.jsonl", rows)
        summary[run] = metrics
    finish(summary, args.output_dir, "summarization")
    return summary


if __name__ == "__main__":
    evaluate(tyro.cli(SummarizationEvalArgs, use_underscores=True))
