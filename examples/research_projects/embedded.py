"""The embedded offline setting of the research examples: shipped data and a tiny warmed-up policy.

Everything here runs without the Hugging Face Hub. The data files under ``data/`` were written for this project
(IMDB-like review sentences, RealToxicityPrompts-shaped prompts with a toxicity score from alt-profanity-check,
short news articles with one-sentence reference summaries). The policy is a tiny model of the trl_stable test kit,
warmed up for a few seconds on the task's text so that it samples word-like sentences; PPO then has something
meaningful to steer. Warmed-up models are cached on disk, keyed by every setting that changes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

DATA_DIR = Path(__file__).resolve().parent / "data"
SENTIMENT_REVIEWS = DATA_DIR / "imdb_like_reviews.jsonl"
TOXICITY_PROMPTS = DATA_DIR / "toxicity_prompts.jsonl"
SUMMARIZATION_DATA = DATA_DIR / "summarization.jsonl"
TASKS = ("sentiment", "toxicity", "summarization")
# Not a task: every shipped English text, what the evaluation's scoring LM (`eval_utils.EMBEDDED_SCORER`) learns.
ENGLISH = "english"
# What a summary is asked with, as in the TL;DR setup of the paper's summarization task.
SUMMARY_PROMPT = "{article}\nTL;DR:"


def is_embedded(model_name: str | None, offline: bool) -> bool:
    """Embedded mode: no model named, or `--offline` (the named model is then a local directory)."""
    return offline or model_name is None


def use_one_thread() -> None:
    """One torch thread unless the user chose (OMP_NUM_THREADS): for a 64-wide model, thread hand-offs cost more
    than they give, and on a busy machine two threads ran a forward pass 30x slower than one."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON Lines file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def warmup_texts(task: str) -> list[str]:
    """The text a task's embedded policy is warmed up on (what "pre-training" means for a tiny offline model)."""
    if task == "sentiment":
        return [r["text"] for r in read_jsonl(SENTIMENT_REVIEWS)]
    if task == "toxicity":
        return [r["prompt"]["text"] + r["continuation"]["text"] for r in read_jsonl(TOXICITY_PROMPTS)]
    if task == "summarization":
        # The policy is pre-trained on the articles only: learning to summarise is the SFT script's job.
        return [r["article"] for r in read_jsonl(SUMMARIZATION_DATA)]
    if task == ENGLISH:
        from trl_stable.testing.kit import corpus

        texts = warmup_texts("sentiment") + warmup_texts("toxicity") + warmup_texts("summarization")
        texts += [r["summary"] for r in read_jsonl(SUMMARIZATION_DATA)]
        return texts + [line for line in corpus().splitlines() if line.strip()]
    raise ValueError(f"Unknown task {task!r}; choose one of {', '.join(TASKS)} (or {ENGLISH!r}: all shipped text).")


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRL_STABLE_CACHE", Path.home() / ".cache" / "trl_stable")) / "embedded_policies"


def embedded_policy(
    task: str = "sentiment",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    warmup_steps: int = 300,
    cache_dir: str | os.PathLike | None = None,
    show_progress: bool = True,
):
    """A tiny GPT-2 policy from the trl_stable test kit, warmed up on the task's embedded text.

    The warm-up is plain next-token cross-entropy (AdamW, lr 3e-3, batches of 16 texts ending with EOS). The result
    is saved under `cache_dir` (default ``$TRL_STABLE_CACHE`` or ``~/.cache/trl_stable``) and loaded from there
    the next time, so only the first call pays the few seconds of warm-up.

    Args:
        task: "sentiment", "toxicity" or "summarization" (which text to warm up on), or "english" (all of them: the
            evaluation's scoring LM).
        seed: Seed of the initial weights and of the warm-up batches.
        num_layers: Transformer layers (the test kit uses 2).
        hidden_size: Width of the model (the test kit uses 32).
        warmup_steps: Optimiser steps of the warm-up; 0 keeps the random initialisation.
        cache_dir: Where warmed-up models are kept.
        show_progress: Show a tqdm bar during the warm-up.

    Returns:
        `(model, tokenizer)`; the tokenizer pads on the left, as generation wants.
    """
    from transformers import AutoModelForCausalLM

    from trl_stable.testing import build_causal_lm, build_tokenizer

    texts = warmup_texts(task)
    # "seeded-dropout": warm-ups before it drew their dropout masks from the process's unseeded RNG, so two
    # processes warmed up different models from the same settings; those cache entries are not reused
    settings = [task, seed, num_layers, hidden_size, warmup_steps, texts, torch.__version__, "seeded-dropout"]
    key_src = json.dumps(settings)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / f"{task}-L{num_layers}-H{hidden_size}-S{warmup_steps}-seed{seed}-{key}"
    tokenizer = build_tokenizer()
    if (path / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(path)
        return model, tokenizer

    n_head = 4 if hidden_size % 4 == 0 else 2
    model = build_causal_lm(
        "gpt2", tokenizer, seed=seed, n_layer=num_layers, n_embd=hidden_size, n_head=n_head, n_positions=256
    )
    if warmup_steps > 0:
        with torch.random.fork_rng(devices=[]):  # dropout masks from `seed`, the caller's RNG left as it was
            torch.manual_seed(seed)
            _warm_up(model, tokenizer, texts, seed, warmup_steps, show_progress, task)
    model.eval()
    # Save to a temporary sibling and rename: concurrent first calls never see a half-written model.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another process finished first; its model is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer


def _warm_up(model, tokenizer, texts: list[str], seed: int, steps: int, show_progress: bool, task: str) -> None:
    rng = random.Random(seed)
    encoded = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    batch_size = min(16, len(encoded))
    for _ in tqdm(range(steps), desc=f"warm-up of the embedded {task} policy", disable=not show_progress):
        batch = rng.sample(encoded, batch_size)
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for i, ids in enumerate(batch):  # right padding: positions start at 0 as in generation
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
        labels = input_ids.masked_fill(attention == 0, -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


SUMMARIZATION_TEST_SIZE = 6


def summarization_records(split: str = "train") -> list[dict]:
    """The embedded summarization data: {"article", "summary"} records; the last 6 form the "test" split."""
    rows = read_jsonl(SUMMARIZATION_DATA)
    if split == "train":
        return rows[:-SUMMARIZATION_TEST_SIZE]
    if split == "test":
        return rows[-SUMMARIZATION_TEST_SIZE:]
    if split == "all":
        return rows
    raise ValueError(f"Unknown split {split!r}; choose train, test or all.")
