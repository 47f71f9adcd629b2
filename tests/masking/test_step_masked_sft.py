"""StepMaskedSFTTrainer and StepMaskCollator on the tiny kit."""

import math

import pytest
import torch
from datasets import Dataset

from trl_stable.masking import StepMaskCollator, StepMaskedSFTConfig, StepMaskedSFTTrainer, masked_cross_entropy
from trl_stable.testing import build_causal_lm

TOOLS = {"get_weather": {"city": "string"}}


def _traces():
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    bad_json = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    bad_tool = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    rows = []
    for k, call in enumerate([good, bad_json, bad_tool, good]):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is the weather {k}?"},
                    {"role": "assistant", "content": f"First I check. {call}"},
                    {"role": "tool", "content": "sunny"},
                    {"role": "assistant", "content": "It is sunny."},
                ]
            }
        )
    return Dataset.from_list(rows)


def _args(tmp_path, **kw):
    return StepMaskedSFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3, report_to="none",
        save_strategy="no", logging_steps=1, use_cpu=True, step_tools=TOOLS, seed=0, **kw,
    )  # fmt: skip


def test_sft_run_trains_only_valid_steps(tokenizer, tmp_path):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    trainer = StepMaskedSFTTrainer(model, args=_args(tmp_path), train_dataset=_traces(), processing_class=tokenizer)
    assert trainer.step_mask_stats["train"] == {"rows": 4, "steps": 16, "invalid_steps": 2}

    dataset = trainer.train_dataset
    for row in dataset:
        trained = tokenizer.decode([i for i, label in zip(row["input_ids"], row["labels"]) if label != -100])
        assert "rm_rf" not in trained and '"city": </tool_call>' not in trained
        assert "It is sunny." in trained and "What is the weather" not in trained

    # The trainer's loss (TRL's fused head over -100 labels) is the masked cross-entropy of the step mask.
    batch = trainer.data_collator([dataset[i] for i in range(2)])
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    model.eval()
    with torch.no_grad():
        ours = trainer.compute_loss(model, dict(batch))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = (batch["labels"] != -100).float()
    reference = masked_cross_entropy(logits, batch["input_ids"], mask)
    assert math.isclose(ours.item(), reference.item(), rel_tol=1e-4)
    model.train()

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_text_and_token_step_rows_and_plain_datasets(tokenizer, tmp_path):
    text = 'Plan. <tool_call>{"name": "nope"}</tool_call> ok'
    start = text.index("<tool_call>")
    end = text.index("</tool_call>") + len("</tool_call>")
    rows = Dataset.from_list(
        [{"text": text, "steps": [{"start": start, "end": end, "unit": "char", "type": "tool_call"}]}]
    )
    model = build_causal_lm("gpt2", tokenizer, seed=0)
    trainer = StepMaskedSFTTrainer(model, args=_args(tmp_path), train_dataset=rows, processing_class=tokenizer)
    row = trainer.train_dataset[0]
    assert tokenizer.decode([i for i, lab in zip(row["input_ids"], row["labels"]) if lab != -100]) == "Plan.  ok"

    plain = Dataset.from_list([{"text": "just text"}])  # nothing step-shaped: TRL's own preparation
    trainer = StepMaskedSFTTrainer(model, args=_args(tmp_path), train_dataset=plain, processing_class=tokenizer)
    assert "train" not in trainer.step_mask_stats


def test_config_validation(tmp_path):
    cfg = StepMaskedSFTConfig(output_dir=str(tmp_path), step_tools='["a", "b"]', report_to="none", use_cpu=True)
    assert cfg.step_tools == ["a", "b"]
    with pytest.raises(ValueError, match="step_tools"):
        StepMaskedSFTConfig(output_dir=str(tmp_path), step_tools="{not json", report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="step_outside_value"):
        StepMaskedSFTConfig(output_dir=str(tmp_path), step_outside_value=0.5, report_to="none", use_cpu=True)


@pytest.mark.parametrize("padding_free", [False, True])
def test_collator_applies_step_mask(padding_free):
    collator = StepMaskCollator(pad_token_id=0, padding_free=padding_free)
    examples = [
        {"input_ids": [5, 6, 7, 8], "step_mask": [1, 0, 0, 1]},
        {"input_ids": [9, 10], "labels": [-100, 10], "step_mask": [1, 1]},
    ]
    batch = collator(examples)
    if padding_free:
        # TRL itself drops each sequence's first label in padding-free mode.
        assert batch["labels"].tolist() == [[-100, -100, -100, 8, -100, 10]]
    else:
        assert batch["labels"].tolist() == [[5, -100, -100, 8], [-100, 10, -100, -100]]
    with pytest.raises(ValueError, match="step_mask"):
        collator([{"input_ids": [1, 2], "step_mask": [1]}])


def test_masked_tokens_contribute_no_gradient_in_the_trainer_loss(tokenizer, tmp_path):
    """Change the target of a masked token (the last one, so no later position sees it): the gradient of the
    trainer's loss does not move. Unmasked, the same change moves it (the check is not vacuous)."""
    text = 'Done. <tool_call>{"name": "rm_rf"}</tool_call>'
    start = text.index("<tool_call>")
    rows = Dataset.from_list([{"text": text, "steps": [{"start": start, "end": len(text), "unit": "char",
                                                        "type": "tool_call"}]}])  # fmt: skip
    model = build_causal_lm("llama", tokenizer, seed=0)
    trainer = StepMaskedSFTTrainer(model, args=_args(tmp_path), train_dataset=rows, processing_class=tokenizer)
    row = trainer.train_dataset[0]
    assert row["labels"][-1] == -100 and row["labels"][0] != -100

    def grads(input_ids, labels):
        model.zero_grad()
        batch = trainer.data_collator([{"input_ids": input_ids, "labels": labels}])
        trainer.compute_loss(model, {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ids, labels = list(row["input_ids"]), list(row["labels"])
    swapped = ids[:-1] + [(ids[-1] + 1) % len(tokenizer)]
    torch.testing.assert_close(grads(ids, labels), grads(swapped, labels), rtol=0, atol=0)
    assert not torch.equal(grads(ids, ids), grads(swapped, swapped))


def test_a_malformed_step_in_a_dataset_row_names_the_row(tokenizer):
    from datasets import Dataset

    from trl_stable.masking import StepSpanError, build_step_masked_dataset

    rows = Dataset.from_dict(
        {"text": ["hello there", "bye now"], "steps": [[], [{"start": 0, "end": 99, "unit": "char"}]]}
    )
    with pytest.raises(StepSpanError, match=r"dataset row 1: steps\[0\] is \[0, 99\) in chars"):
        build_step_masked_dataset(rows, tokenizer)
