"""What the sentiment scripts (PPO `ppo_intrinsic.py`, GRPO family `grpo_intrinsic.py`) share: the prompt texts
and the environment reward."""

from __future__ import annotations

from pathlib import Path

from embedded import SENTIMENT_REVIEWS, read_jsonl
from scorers import VADER, build_sentiment_logit, vader_compound

# The paper's environment reward: the positive logit of this IMDB classifier.
PAPER_REWARD_MODEL = "lvwerra/distilbert-imdb"


def load_review_texts(source: str | None, embedded: bool) -> list[str]:
    """Review texts: "imdb" (hub), a JSON Lines file with a "text" field, or None (paper: imdb; embedded: the
    shipped IMDB-like reviews)."""
    if source is None and embedded:
        return [r["text"] for r in read_jsonl(SENTIMENT_REVIEWS)]
    if source is not None and Path(source).is_file():
        return [r["text"] for r in read_jsonl(source)]
    from datasets import load_dataset

    ds = load_dataset(source or "imdb", split="train")
    return [t for t in ds["text"] if len(t) > 200]  # RELC drops short reviews


def sentiment_model(name: str | None, embedded: bool) -> str:
    """The environment reward's scorer: `name`, else VADER embedded and the paper's classifier in paper mode."""
    return name or (VADER if embedded else PAPER_REWARD_MODEL)


def sentiment_scorer(name: str):
    """texts -> sentiment scores: VADER's compound in [-1, 1], or a classifier's positive logit."""
    return vader_compound if name == VADER else build_sentiment_logit(name)
