"""The prompts of a PPO step loop: records from texts, and the order in which this process sees them."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence


class PromptBatches:
    """This process's batches of prompt records: `epochs` shuffled passes over its shard of `records`, stopped
    after `max_steps` batches (when > 0). `from_step(start)` replays the shuffles of the skipped steps, so a
    resumed run sees the prompts in the order the uninterrupted one did.
    """

    def __init__(
        self, records: Sequence[dict], accelerator, batch_size: int, epochs: int, max_steps: int | None, seed: int
    ):
        rank, world = accelerator.process_index, accelerator.num_processes
        self.shard = list(records[rank::world])
        self.batch_size, self.seed, self.rank = batch_size, seed, rank
        # From the smallest shard, not this one: shards differ by up to one prompt, and a process that took one step
        # more than the others would wait forever in the step's collective ops.
        self.steps_per_epoch = len(records) // world // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(records) // world} prompts per process is fewer than batch_size={batch_size}; "
                "lower the batch size."
            )
        self.total = self.steps_per_epoch * epochs
        if max_steps is not None and max_steps > 0:
            self.total = min(self.total, max_steps)

    def __len__(self) -> int:
        return self.total

    def from_step(self, start: int = 0) -> Iterator[list[dict]]:
        rng = random.Random(self.seed + self.rank)
        for step in range(self.total):
            b = step % self.steps_per_epoch
            if b == 0:
                order = list(range(len(self.shard)))
                rng.shuffle(order)
            if step >= start:
                yield [self.shard[i] for i in order[b * self.batch_size : (b + 1) * self.batch_size]]


def tokenize_queries(tokenizer, texts: Sequence[str], extra: Sequence[dict] | None = None) -> list[dict]:
    """Records {"query", "input_ids", **extra} of `texts` (queries with no token are dropped)."""
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
