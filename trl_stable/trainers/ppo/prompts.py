"""The prompts `train()` and `evaluate()` generate from (a `PPOTrainer` mixin): the train dataloader, the rows' token
ids, and the prompt checks at start-up."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import seed_worker

from trl_stable.trainers.ppo.step_inputs import check_token_ids
from trl_stable.trainers.prompt_checks import (
    check_generation_budget,
    check_prompt_column,
    empty_prompt_error,
    too_long_error,
)

logger = logging.getLogger(__name__)


def collate_rows(batch: list[dict]) -> list[dict]:
    """The dataloader's collator: a batch is the list of its rows (prompts are tokenized by the trainer)."""
    return batch


class PromptData:
    """`PPOTrainer`'s prompt handling; reads `args`, `processing_class`, `train_dataset` and `model_contexts`."""

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """The training dataloader as Trainer builds it (sampler, `dataloader_*` settings, sharding over processes),
        with `batch_size` prompts per process per batch and always full batches (a step takes `batch_size`)."""
        args = self.args
        dataset = self.train_dataset
        sampled = not isinstance(dataset, torch.utils.data.IterableDataset)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=self._get_train_sampler(dataset) if sampled else None,
            drop_last=True,
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            in_order=args.dataloader_in_order,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
            # the workers' seed from a stream of its own: drawn from the global RNG it would move every token
            # generate samples afterwards (the sampler's order is seeded on its own, by `data_seed` or `seed`)
            generator=torch.Generator().manual_seed(args.seed),
        )
        return self.accelerator.prepare(loader)

    def _get_train_sampler(self, train_dataset: Any | None = None) -> torch.utils.data.Sampler | None:
        """Trainer's sampler; ``group_by_length`` groups by PPO's `batch_size` (the prompts generated together)."""
        sampler = super()._get_train_sampler(train_dataset)
        if isinstance(sampler, LengthGroupedSampler):
            return LengthGroupedSampler(self.args.batch_size, lengths=sampler.lengths, generator=sampler.generator)
        return sampler

    def _prompt_ids(
        self, rows: list[dict], indices: Sequence[int] | None = None, name: str = "train_dataset"
    ) -> tuple[list[Any], list[torch.Tensor]]:
        """The prompts of `rows` (rows `indices` of the dataset `name`, for the errors) and their token ids, cut to the
        last `max_prompt_length` tokens. ValueError names the row of a missing or empty prompt."""
        tok = self.processing_class
        max_len = self.args.max_prompt_length
        wheres = [f"row {i} of this {name} batch" for i in range(len(rows))]
        if indices is not None:
            wheres = [f"{name} row {index}" for index in indices]
        prompts, ids = [], []
        for where, row in zip(wheres, rows):
            if "input_ids" in row and row["input_ids"] is not None:
                q = torch.as_tensor(row["input_ids"]).reshape(-1)
                if len(q):
                    check_token_ids(q, f"the input_ids of {where}", self.vocab_size)
                prompt = row.get("prompt", tok.decode(q, skip_special_tokens=True))
            elif "prompt" in row:
                prompt = row["prompt"]
                error = empty_prompt_error(prompt, where)
                if error is not None:
                    raise error
                if isinstance(prompt, list):
                    q = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
                    q = torch.as_tensor(q, dtype=torch.long).reshape(-1)
                else:
                    q = torch.as_tensor(tok(prompt)["input_ids"], dtype=torch.long)
            else:
                raise ValueError(f"{name} rows need a 'prompt' (text or messages) or an 'input_ids' column.")
            if len(q) == 0:
                raise ValueError(
                    f"The prompt of {where} has no tokens ({row.get('prompt', row.get('input_ids'))!r}): drop the row "
                    "or give it one (e.g. the BOS token)."
                )
            if max_len is not None and len(q) > max_len:
                q = q[-max_len:]
            prompts.append(prompt)
            ids.append(q.long())
        return prompts, ids

    def _check_prompts_at_start(self, train_dataset: Any) -> None:
        """The generation length against each model's context, the prompt column and its token ids and, with a learned
        position table the config does not keep prompts within, every train prompt's length (once, here)."""
        args = self.args
        generation = (args.generation_kwargs or {}).get("max_new_tokens", args.max_new_tokens)
        for context in self.model_contexts:
            check_generation_budget(context, generation, "max_new_tokens", args.max_prompt_length)
        check_prompt_column(train_dataset, alternatives=("input_ids",))
        if "input_ids" in (getattr(train_dataset, "column_names", None) or ()):  # read at once, as check_prompt_column
            for i, row in enumerate(train_dataset["input_ids"]):
                if row is not None and len(row):
                    check_token_ids(
                        torch.as_tensor(row).reshape(-1), f"the input_ids of train_dataset row {i}", self.vocab_size
                    )
        learned = [c for c in self.model_contexts if c.learned]
        if train_dataset is None or not learned or not hasattr(train_dataset, "__len__"):
            return
        context = min(learned, key=lambda c: c.limit)
        longest = context.limit - generation
        if args.max_prompt_length is not None and args.max_prompt_length <= longest:
            return  # train() cuts every prompt to a length that fits
        shown = (args.max_prompt_length, generation, context.describe(), len(train_dataset))
        logger.info("max_prompt_length=%s and max_new_tokens=%d can pass %s: checking the %d train prompts.", *shown)
        lengths = []
        for chunk in range(0, len(train_dataset), 256):
            indices = range(chunk, min(chunk + 256, len(train_dataset)))
            lengths += [len(q) for q in self._prompt_ids([train_dataset[i] for i in indices], indices)[1]]
        error = too_long_error(
            context,
            lengths,
            generation,
            lambda i: f"train_dataset row {i}",
            f"Set max_prompt_length={longest} (train() keeps a prompt's last tokens), lower max_new_tokens, or drop "
            "the long rows.",
        )
        if error is not None:
            raise error
