"""Step-masked SFT (docs/agent_steps.md): TRL's `SFTTrainer` on rows whose invalid steps' labels are -100, so TRL's
loss is exactly `masked_cross_entropy`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trl
from torch.nn.utils.rnn import pad_sequence
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from trl_stable.integration.hf_names import model_name_of
from trl_stable.masking.mask import StepSpanError, build_step_loss_mask
from trl_stable.masking.token_offsets import encode_with_offsets
from trl_stable.masking.transcript import DEFAULT_CODE_TOOLS, find_transcript_steps
from trl_stable.masking.validation import load_tools
from trl_stable.settings.checks import option

logger = logging.getLogger(__name__)


def step_mask_example(
    example: Mapping[str, Any],
    tokenizer: Any,
    tools: Any = None,
    assistant_only: bool = True,
    outside_steps: float = 1.0,
    open_tag: str = "<tool_call>",
    close_tag: str = "</tool_call>",
    code_tools: Sequence[str] = DEFAULT_CODE_TOOLS,
    infer_exec_status: bool = True,
) -> dict[str, Any]:
    """Turn one row into ``input_ids``, ``labels`` (-100 on masked tokens) and step counts.

    Rows are ``messages`` (steps found by `find_transcript_steps`), ``text`` + ``steps`` (character or token
    boundaries) or ``input_ids`` + ``steps`` (+ ``labels``). A row's own ``tools`` column overrides `tools`.
    """
    tools = example.get("tools") or tools
    tag_kwargs = {"open_tag": open_tag, "close_tag": close_tag}
    if example.get("messages") is not None:
        found = find_transcript_steps(
            example["messages"], tokenizer, code_tools=code_tools, infer_exec_status=infer_exec_status, **tag_kwargs
        )
        result = found.loss_mask(tools=tools, assistant_only=assistant_only, outside_steps=outside_steps, **tag_kwargs)
        input_ids, base_labels = found.input_ids, list(found.input_ids)
    elif example.get("input_ids") is not None or example.get("text") is not None:
        if example.get("input_ids") is not None:
            input_ids, offsets = list(example["input_ids"]), None
            base_labels = list(example.get("labels") or input_ids)
        else:
            input_ids, offsets = encode_with_offsets(tokenizer, example["text"])
            base_labels = list(input_ids)
        result = build_step_loss_mask(
            input_ids, example.get("steps") or [], tokenizer=tokenizer, text=example.get("text"), offsets=offsets,
            tools=tools, outside_steps=outside_steps, **tag_kwargs,
        )  # fmt: skip
    else:
        raise ValueError(
            f"A step-masked SFT row needs 'messages', 'text' (+ 'steps') or 'input_ids' (+ 'steps'); got keys "
            f"{sorted(example)}."
        )
    labels = [label if m > 0 else -100 for label, m in zip(base_labels, result.mask.tolist())]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "num_steps": len(result.verdicts),
        "num_invalid_steps": result.num_invalid_steps,
    }


def build_step_masked_dataset(dataset: Any, tokenizer: Any, **kwargs: Any) -> Any:
    """`step_mask_example` (with kwargs) mapped over a `datasets.Dataset` or IterableDataset, the original columns
    dropped (TRL's SFTTrainer then only truncates / packs it)."""
    columns = getattr(dataset, "column_names", None)

    def one_row(example: Mapping[str, Any], index: int) -> dict[str, Any]:
        try:
            return step_mask_example(example, tokenizer, **kwargs)
        except StepSpanError as err:  # the dataset row, too: the error alone names only the step
            raise StepSpanError(f"dataset row {index}: {err}") from err

    return dataset.map(one_row, with_indices=True, remove_columns=list(columns) if columns else None)


@dataclass
class StepMaskedSFTConfig(trl.SFTConfig):
    """Configuration for [`StepMaskedSFTTrainer`]: every field of `trl.SFTConfig`, plus the step-mask options."""

    step_tools: dict[str, Any] | str | None = option(
        None,
        "Valid tools: names, {name: signature}, OpenAI tool specs, or a JSON string/file of these. "
        "None skips the name and argument checks.",
    )
    step_assistant_only: bool = option(True, "For 'messages' rows, train only the assistant turns.")
    step_outside_value: float = option(1.0, "Mask value (0 or 1) of tokens covered by no step.")
    step_tool_call_open: str = option("<tool_call>", "Opening tag of a tool-call block.")
    step_tool_call_close: str = option("</tool_call>", "Closing tag of a tool-call block.")
    step_code_tools: list[str] = field(
        default_factory=lambda: list(DEFAULT_CODE_TOOLS),
        metadata={"help": "Tool names whose calls execute code; their reply decides crash/timeout/oom."},
    )
    step_infer_exec_status: bool = option(
        True, "Infer crash/timeout/oom from a code tool's output when the message has no exec_status."
    )

    def __post_init__(self):
        super().__post_init__()
        try:
            self.step_tools = load_tools(self.step_tools)
        except ValueError as err:
            raise ValueError(f"`step_tools`: {err}") from err
        if self.step_outside_value not in (0, 1, 0.0, 1.0):
            raise ValueError(f"`step_outside_value` must be 0 or 1, got {self.step_outside_value}.")
        if not self.step_tool_call_open or not self.step_tool_call_close:
            raise ValueError("`step_tool_call_open` and `step_tool_call_close` must be non-empty strings.")


_CONFIG_FIELDS = {
    "tools": "step_tools", "assistant_only": "step_assistant_only", "outside_steps": "step_outside_value",
    "open_tag": "step_tool_call_open", "close_tag": "step_tool_call_close", "code_tools": "step_code_tools",
    "infer_exec_status": "step_infer_exec_status",
}  # fmt: skip


class StepMaskedSFTTrainer(trl.SFTTrainer):
    """TRL's `SFTTrainer` that trains only on the valid steps of agent traces (docs/agent_steps.md). `args` may be a
    [`StepMaskedSFTConfig`] or a plain `SFTConfig` (step-mask defaults); `processing_class` must be a fast tokenizer,
    loaded from `model` when it is a name. ``step_mask_stats`` holds the rows, steps and invalid steps per dataset."""

    _tag_names = ["trl", "sft", "trl_stable", "step-mask"]

    def __init__(self, model: Any, args: trl.SFTConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, **kwargs: Any):  # fmt: skip
        if args is None:
            name = model if isinstance(model, str) else model_name_of(model) or "model"
            args = StepMaskedSFTConfig(f"{str(name).split('/')[-1]}-StepMaskedSFT")
        if processing_class is None:
            if not isinstance(model, str):
                raise ValueError(
                    "StepMaskedSFTTrainer needs `processing_class` (a fast tokenizer) for a model object."
                )
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(model)
        # A plain SFTConfig lacks the step fields: step_mask_example's defaults then apply.
        options = {key: getattr(args, name) for key, name in _CONFIG_FIELDS.items() if hasattr(args, name)}
        self.step_mask_stats: dict[str, dict[str, int]] = {}
        train_dataset = self._step_mask(train_dataset, processing_class, options, "train")
        eval_dataset = self._step_mask(eval_dataset, processing_class, options, "eval")
        super().__init__(
            model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, **kwargs,
        )  # fmt: skip

    def _step_mask(self, dataset: Any, tokenizer: Any, options: dict, name: str) -> Any:
        if isinstance(dataset, Mapping):  # several eval datasets by name: each masked, its stats as "eval_<name>"
            return {k: self._step_mask(v, tokenizer, options, f"{name}_{k}") for k, v in dataset.items()}
        if not {"messages", "steps"} & set(getattr(dataset, "column_names", None) or []):
            return dataset  # None, or nothing step-shaped: plain SFT
        out = build_step_masked_dataset(dataset, tokenizer, **options)
        try:
            stats = {
                "rows": len(out),
                "steps": int(sum(out["num_steps"])),
                "invalid_steps": int(sum(out["num_invalid_steps"])),
            }
        except TypeError:  # IterableDataset: no length or column access
            return out
        self.step_mask_stats[name] = stats
        logger.info("step mask (%s): %d of %d steps masked", name, stats["invalid_steps"], stats["steps"])
        return out


@dataclass
class StepMaskCollator(DataCollatorForLanguageModeling):
    """`DataCollatorForLanguageModeling` that also applies a per-token ``step_mask`` column (0 -> label -100), for
    pipelines that keep the mask as a column (`StepMaskedSFTTrainer` bakes it into the labels instead)."""

    mask_key: str = "step_mask"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        masks = [ex.get(self.mask_key) for ex in examples]
        examples = [{k: v for k, v in ex.items() if k != self.mask_key} for ex in examples]
        batch = super().torch_call(examples)
        if all(m is None for m in masks):
            return batch
        rows = []
        for ex, m in zip(examples, masks):
            length = len(ex["input_ids"])
            row = torch.ones(length, dtype=torch.bool) if m is None else torch.as_tensor(m).reshape(-1) > 0
            if row.numel() != length:
                raise ValueError(f"'{self.mask_key}' has {row.numel()} entries for {length} tokens.")
            rows.append(row)
        labels = batch["labels"]
        # Right-padded like the labels: one packed row when padding-free, else one row per example.
        keep = torch.cat(rows).unsqueeze(0) if self.padding_free else pad_sequence(rows, batch_first=True)
        keep = torch.nn.functional.pad(keep, (0, labels.size(1) - keep.size(1)), value=False)
        batch["labels"] = labels.masked_fill(~keep, -100)
        return batch
