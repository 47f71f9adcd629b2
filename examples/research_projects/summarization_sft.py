"""The supervised warm start of the summarization policy (RELC starts PPO from an SFT gpt2-medium checkpoint),
shared by `summarization/sft_warmstart.py` (its command) and `summarization/ppo_rouge.py` (which runs it first in
embedded mode).

Trains on (prompt, summary) pairs with TRL's SFTTrainer, loss on the summary tokens only, and saves a
`from_pretrained`-loadable model + tokenizer that `ppo_rouge.py --model_name` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedded import SUMMARY_PROMPT, embedded_policy, is_embedded, summarization_records, use_one_thread
from policy_loading import hub_tokenizer


@dataclass
class SFTArguments:
    model_name: str | None = None
    """Base model (paper: gpt2-medium). None: the embedded tiny policy."""
    dataset: str | None = None
    """Hub dataset with "prompt" and "label" columns (paper: CarperAI/openai_summarize_tldr). None: embedded data."""
    output_dir: str = "outputs/summarization/sft"
    max_steps: int | None = None
    """Optimizer steps (None: 1000 in paper mode, 150 embedded)."""
    learning_rate: float | None = None
    """None: 5e-5 in paper mode, 2e-3 embedded."""
    batch_size: int = 8
    max_length: int = 512
    seed: int = 0
    offline: bool = False
    """Embedded data even when a model is named."""
    embedded_warmup_steps: int = 300
    """Embedded policy: LM warm-up steps on the shipped articles (cached)."""
    log_with: str | None = None


def sft_dataset(args: SFTArguments, embedded: bool):
    from datasets import Dataset, load_dataset

    if args.dataset is None and embedded:
        rows = summarization_records("train")
        return Dataset.from_dict(
            {
                "prompt": [SUMMARY_PROMPT.format(article=r["article"]) for r in rows],
                "completion": [" " + r["summary"] for r in rows],
            }
        )
    ds = load_dataset(args.dataset or "CarperAI/openai_summarize_tldr", split="train")
    return ds.map(lambda r: {"prompt": r["prompt"], "completion": " " + r["label"]}, remove_columns=ds.column_names)


def train_sft(args: SFTArguments) -> str:
    """Run the warm start; returns the directory of the saved model."""
    from trl import SFTConfig, SFTTrainer

    embedded = is_embedded(args.model_name, args.offline)
    if embedded:
        use_one_thread()
        model, tokenizer = embedded_policy("summarization", seed=args.seed, warmup_steps=args.embedded_warmup_steps)
    else:
        model, tokenizer = args.model_name, hub_tokenizer(args.model_name, padding_side=None)
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps or (150 if embedded else 1000),
        learning_rate=args.learning_rate or (2e-3 if embedded else 5e-5),
        per_device_train_batch_size=args.batch_size,
        max_length=args.max_length,
        seed=args.seed,
        report_to=args.log_with or "none",
        save_strategy="no",
        logging_steps=10,
        use_cpu=embedded,
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=sft_dataset(args, embedded), processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    return args.output_dir
