"""Step masks for RL completions (the helper GRPO and PPO multiply into their completion masks)."""

import math

import pytest
import torch
from tiny_configs import tiny_ppo_args

import trl_stable.trainers.ppo.ppo_trainer as ppo_module
from trl_stable import PPOConfig, PPOTrainer
from trl_stable.masking import CompletionStepMasker, StepSpanError, apply_step_mask
from trl_stable.testing import build_causal_lm

TOOLS = {"get_weather": {"city": "string"}}
GOOD = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
BAD = '<tool_call>{"name": "get_weather", "arguments": {"city": 5}}</tool_call>'


def _pad(rows, pad_id):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def test_keep_mask_drops_only_invalid_calls(tokenizer):
    texts = [f"Sure. {GOOD} done", f"Hmm {BAD} done", "no tools here", "<tool_call>{truncated"]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids, mask = _pad(rows, tokenizer.pad_token_id)
    masker = CompletionStepMasker(tools=TOOLS)
    new_mask = apply_step_mask(mask, ids, tokenizer, masker)
    assert new_mask.dtype == mask.dtype and new_mask.shape == mask.shape
    assert torch.equal(new_mask[0], mask[0]) and torch.equal(new_mask[2], mask[2])
    kept = tokenizer.decode([i for i, m in zip(rows[1], new_mask[1].tolist()) if m])
    assert kept == "Hmm  done"
    assert new_mask[3].sum() == 0  # an unterminated call runs to the end of the completion
    assert masker.last_counts == {"ok": 1, "bad_arguments": 1, "invalid_json": 1}
    stats = masker.stats()
    assert stats["step_mask/steps"] == 3 and abs(stats["step_mask/frac_invalid_steps"] - 2 / 3) < 1e-12


def test_extra_steps_from_the_environment_and_holes_in_the_mask(tokenizer):
    text = "run: print(1/0) then stop"
    row = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, mask = _pad([row], tokenizer.pad_token_id)
    mask[0, 0] = 0  # another mask (e.g. a tool-output mask) already removed a token: the length must not shrink

    def crashed_code(completion, index):
        start = completion.index("print")
        return [{"start": start, "end": start + len("print(1/0)"), "unit": "char", "type": "code",
                 "metadata": {"exec_status": "crash"}}]  # fmt: skip

    new_mask = apply_step_mask(mask, ids, tokenizer, CompletionStepMasker(extra_steps=crashed_code))
    kept = tokenizer.decode([i for i, m in zip(row, new_mask[0].tolist()) if m])
    assert "print" not in kept and kept.endswith("then stop")
    assert new_mask[0, 0] == 0


@pytest.mark.parametrize(
    "returned, message",
    [
        ([None], r"extra_steps\(text, 0\)\[0\] is None"),
        (
            [{"start": 0, "end": 200, "unit": "char", "type": "code"}],
            r"\[0, 200\) in chars, not a span of the sequence's",
        ),
        (
            {"start": 0, "end": 2, "unit": "char"},
            r"extra_steps\(text, 0\) returned \{'start'.*return a list of step dicts",
        ),
    ],
)
def test_malformed_environment_steps_are_refused_naming_the_call(tokenizer, returned, message):
    """A step the environment reports that is no span of the completion (None, beyond its end, one dict instead of
    a list) raises naming the `extra_steps` call and the step; None for the whole answer means no steps."""
    ids, mask = _pad([tokenizer("run: print(1)", add_special_tokens=False)["input_ids"]], tokenizer.pad_token_id)
    with pytest.raises(StepSpanError, match=message):
        apply_step_mask(mask, ids, tokenizer, CompletionStepMasker(extra_steps=lambda text, i: returned))
    kept = apply_step_mask(mask, ids, tokenizer, CompletionStepMasker(extra_steps=lambda text, i: None))
    assert torch.equal(kept, mask)


def test_ppo_step_loss_mask_removes_invalid_call_tokens_from_the_policy_loss(tokenizer, tmp_path, monkeypatch):
    seen = []
    original = ppo_module.pre_mask_token_mean

    def recording(term, mask, *args, **kwargs):  # the policy term's token mean: its mask is the policy mask
        seen.append(mask.detach().clone())
        return original(term, mask, *args, **kwargs)

    monkeypatch.setattr(ppo_module, "pre_mask_token_mean", recording)
    args = tiny_ppo_args(tmp_path, batch_size=2, step_loss_mask=True, step_mask_tools=TOOLS)
    trainer = PPOTrainer(build_causal_lm("qwen2", tokenizer, seed=0), args=args, processing_class=tokenizer)
    queries = [torch.tensor(tokenizer("Weather?")["input_ids"]), torch.tensor(tokenizer("Again?")["input_ids"])]
    texts = [f"Hmm {BAD} ok", f"Sure {GOOD}"]
    responses = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    stats = trainer.step(queries, responses, scores=[1.0, 0.0])
    assert math.isfinite(stats["loss/policy"]) and stats["step_mask/bad_arguments"] == 1.0
    (mask,) = seen  # one mini-batch, one epoch
    # Independent expectation from the tokenizer's offsets: a token is dropped iff it overlaps the bad call.
    enc = tokenizer(texts[0], add_special_tokens=False, return_offsets_mapping=True)
    b0 = texts[0].index(BAD)
    bad_row = [0.0 if (s < b0 + len(BAD) and e > b0) else 1.0 for s, e in enc["offset_mapping"]]
    width = mask.size(1)
    expected = [
        bad_row + [0.0] * (width - len(bad_row)),
        [1.0] * len(responses[1]) + [0.0] * (width - len(responses[1])),
    ]
    assert sorted(mask.tolist()) == sorted(expected)  # the mini-batch rows are shuffled
    with pytest.raises(ValueError, match="step_loss_mask"):
        PPOConfig(output_dir=str(tmp_path), report_to="none", step_mask_tools=TOOLS)
