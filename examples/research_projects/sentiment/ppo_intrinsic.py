"""Sentiment control with PPO and dense intrinsic rewards from a critic (RELC / Drlc, EMNLP 2024), on trl_stable.

Steer a language model towards positive movie-review continuations. Every RELC flag of
`ppo-intrinsic-rewards-sentiment.py` is accepted, including `--ppo_config.*` and the misspelled
`--use_instric_reward`.

Embedded default (no model named; CPU, a few minutes):

    python examples/research_projects/sentiment/ppo_intrinsic.py --use_intrinsic_reward
    accelerate launch --num_processes 1 examples/research_projects/sentiment/ppo_intrinsic.py --use_intrinsic_reward

Paper mode (gpt2-large policy, IMDB prompts of 4-10 tokens, lvwerra/distilbert-imdb positive logit as reward, a
GPT critic through `OPENAI_API_KEY`):

    accelerate launch --num_processes 2 --mixed_precision bf16 --multi_gpu \
        examples/research_projects/sentiment/ppo_intrinsic.py --use_instric_reward --positive_reward_value 0.5 \
        --negative_reward_value -0.5 --intrinsic_reward_threshold 10 --prompt_file prompts/critic_sentiment.txt \
        --epochs 2 --query_dataset imdb --min_new_tokens 15 --max_new_tokens 20 --num_shared_layers 20 \
        --save_freq 50 --model_save_path ckpts/sentiment/ppo_intrinsic --ppo_config.model_name gpt2-large \
        --ppo_config.learning_rate 1.41e-5 --ppo_config.batch_size 16 --ppo_config.mini_batch_size 16 \
        --ppo_config.gradient_accumulation_steps 1 --ppo_config.target_kl 6.0 --ppo_config.kl_penalty kl \
        --ppo_config.ppo_epochs 4

Writes to `--model_save_path`: the policy and tokenizer (`from_pretrained`-loadable), the value head,
`checkpoint-N/` every `--save_freq` steps, `reward_history.jsonl`, `reward_curve.png` and `run_args.json`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedded import SENTIMENT_REVIEWS, read_jsonl  # noqa: E402
from research_common import (  # noqa: E402
    IntrinsicArgs,
    PPOArgs,
    RunArgs,
    is_embedded,
    parse_script_args,
    run_relc,
    truncate_queries,
)
from scorers import VADER, build_sentiment_logit, vader_compound  # noqa: E402

PAPER_REWARD_MODEL = "lvwerra/distilbert-imdb"


@dataclass
class ScriptArguments(IntrinsicArgs, RunArgs):
    query_dataset: str | None = None
    """Prompt source: "imdb" (hub), a JSON Lines file with a "text" field, or None (paper: imdb; embedded: the
    shipped IMDB-like reviews)."""
    min_query_tokens: int = 4
    max_query_tokens: int = 10
    """Prompts are review openings of a random length in [min_query_tokens, max_query_tokens] tokens."""
    min_new_tokens: int = 15
    max_new_tokens: int = 20
    """Response length: a random value in [min_new_tokens, max_new_tokens] per batch."""
    num_shared_layers: int | None = None
    """Layers the reference model shares (frozen) with the policy (RELC: 20 for gpt2-large)."""
    reward_model: str | None = None
    """Environment reward: "vader" (offline, compound in [-1, 1]) or a sentiment classifier whose positive logit is
    the reward (paper: lvwerra/distilbert-imdb). None: the mode's default."""
    score_query: bool = True
    """Score query + response as RELC did (False: the response alone)."""
    ppo_config: PPOArgs = field(default_factory=PPOArgs)


def load_review_texts(source: str | None, embedded: bool) -> list[str]:
    if source is None and embedded:
        return [r["text"] for r in read_jsonl(SENTIMENT_REVIEWS)]
    if source is not None and Path(source).is_file():
        return [r["text"] for r in read_jsonl(source)]
    from datasets import load_dataset

    ds = load_dataset(source or "imdb", split="train")
    return [t for t in ds["text"] if len(t) > 200]  # RELC drops short reviews


def build_env_reward(args: ScriptArguments, embedded: bool):
    name = args.reward_model or (VADER if embedded else PAPER_REWARD_MODEL)
    score = vader_compound if name == VADER else build_sentiment_logit(name)

    def env_reward(records, queries, responses):
        texts = [q + r for q, r in zip(queries, responses)] if args.score_query else list(responses)
        return score(texts)

    return env_reward


def main(args: ScriptArguments) -> list[dict]:
    """Train; returns the per-step reward history."""
    embedded = is_embedded(args.ppo_config, args)
    if args.num_shared_layers is not None:
        args.ppo_config.num_shared_layers = args.num_shared_layers
    texts = load_review_texts(args.query_dataset, embedded)
    seed = args.ppo_config.seed
    return run_relc(
        args,
        "sentiment",
        embedded,
        build_queries=lambda tok: truncate_queries(tok, texts, args.min_query_tokens, args.max_query_tokens, seed),
        env_reward=build_env_reward(args, embedded),
        min_new_tokens=args.min_new_tokens,
        max_new_tokens=args.max_new_tokens,
    )


if __name__ == "__main__":
    main(parse_script_args(ScriptArguments, description=__doc__.split("\n\n")[0]))
