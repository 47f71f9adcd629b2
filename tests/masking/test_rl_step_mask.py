"""Step masks for RL completions (the helper GRPO and PPO multiply into their completion masks)."""

import torch

from trl_stable.masking import CompletionStepMasker, apply_step_mask

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
