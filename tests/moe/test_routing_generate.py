"""R3: routing recorded while HF generate samples, replayed on the full sequences; layout helpers."""

from __future__ import annotations

import pytest
import torch

from trl_stable.moe import (
    RoutingReplay,
    generate_with_routing,
    mask_routing,
    pad_routing,
    repad_routing,
    unpad_routing,
)
from trl_stable.testing import build_causal_lm
from trl_stable.testing.kit import MOE_FAMILIES

PROMPTS = ["the cat sat on the mat and", "hello", "a quiet morning by"]
NEW_TOKENS = 6


def _generate(model, replay, tokenizer, seed=0):
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out, routing = generate_with_routing(
        model,
        replay,
        input_ids=enc.input_ids,
        attention_mask=enc.attention_mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    prompt_width = enc.input_ids.shape[1]
    tokens = out.sequences[:, prompt_width:]
    # the sampler's log-probs: raw logits at each step (temperature 1, no warpers), at the sampled token
    gen_logps = torch.stack(
        [
            torch.log_softmax(step.float(), -1).gather(-1, tokens[:, i, None])[:, 0]
            for i, step in enumerate(out.logits)
        ],
        dim=1,
    )
    attention_mask = torch.cat([enc.attention_mask, torch.ones_like(tokens)], dim=1)
    return out.sequences, attention_mask, prompt_width, gen_logps, routing


def _completion_logps(model, sequences, attention_mask, prompt_width):
    logits = model(input_ids=sequences, attention_mask=attention_mask).logits
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, sequences[:, 1:, None])[..., 0]
    return logps[:, prompt_width - 1 :]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_r3_replay_reproduces_generation_logps(tokenizer, family):
    model = build_causal_lm(family, tokenizer).eval()
    replay = RoutingReplay(model)
    sequences, attention_mask, prompt_width, gen_logps, routing = _generate(model, replay, tokenizer)
    assert routing.shape == (3, sequences.shape[1], replay.num_layers, replay.top_k)
    assert (routing[:, -1] == -1).all() and (routing[:, :-1] >= 0).all()  # last token never fed

    # prefill rows + one row per decode step line up with the tokens: a full forward routes identically
    with torch.no_grad(), replay.record():
        model(input_ids=sequences, attention_mask=attention_mask)
    full = replay.export()
    real = attention_mask[:, :-1].bool()
    assert torch.equal(routing[:, :-1][real], full[:, :-1][real])

    with torch.no_grad(), replay.replay(routing):
        replayed = _completion_logps(model, sequences, attention_mask, prompt_width)
    torch.testing.assert_close(replayed, gen_logps, rtol=0, atol=2e-5)

    # the rows are really used: routing of the completion shifted to other experts breaks the match
    tampered = routing.clone()
    tampered[:, prompt_width:-1] = (tampered[:, prompt_width:-1] + 1) % 4
    with torch.no_grad(), replay.replay(tampered):
        wrong = _completion_logps(model, sequences, attention_mask, prompt_width)
    assert (wrong - gen_logps).abs().max() > 1e-4


def test_r3_survives_trainer_repadding(tokenizer):
    """Generate's layout -> per-sequence -> a trainer layout with wider prompt padding and trimmed completions."""
    model = build_causal_lm("qwen2_moe", tokenizer).eval()
    replay = RoutingReplay(model)
    sequences, attention_mask, prompt_width, gen_logps, routing = _generate(model, replay, tokenizer, seed=1)
    prompt_lengths = attention_mask[:, :prompt_width].sum(1).tolist()
    per_sequence = unpad_routing(
        routing, [prompt_width - p for p in prompt_lengths], [p + NEW_TOKENS for p in prompt_lengths]
    )
    assert [len(s) for s in per_sequence] == [p + NEW_TOKENS for p in prompt_lengths]

    extra = 2  # the trainer pads prompts two tokens wider
    new_width = prompt_width + extra
    trainer_routing = pad_routing(per_sequence, prompt_lengths, new_width, new_width + NEW_TOKENS)
    pad = torch.full((3, extra), tokenizer.pad_token_id)
    trainer_ids = torch.cat([pad, sequences], dim=1)
    trainer_mask = torch.cat([torch.zeros_like(pad), attention_mask], dim=1)
    trainer_routing = mask_routing(trainer_routing, trainer_mask)
    with torch.no_grad(), replay.replay(trainer_routing):
        logits = model(input_ids=trainer_ids, attention_mask=trainer_mask).logits
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, trainer_ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(logps[:, new_width - 1 :], gen_logps, rtol=0, atol=2e-5)


def test_layout_helpers_by_hand():
    rows = [torch.arange(3 * 2).view(3, 1, 2), torch.arange(100, 104).view(2, 1, 2)]  # n = 3 and 2 tokens
    out = pad_routing(rows, prompt_lengths=[2, 1], prompt_width=3, total_width=5)
    minus = [-1, -1]
    assert out[:, :, 0].tolist() == [
        [minus, [0, 1], [2, 3], [4, 5], minus],  # prompt of 2 at positions 1-2, one completion token at 3
        [minus, minus, [100, 101], [102, 103], minus],
    ]
    back = unpad_routing(out, starts=[1, 2], lengths=[3, 2])
    assert torch.equal(back[0], rows[0].int()) and torch.equal(back[1], rows[1].int())
    truncated = pad_routing(rows, prompt_lengths=[2, 1], prompt_width=3, total_width=3)
    assert truncated[0, :, 0].tolist() == [minus, [0, 1], [2, 3]]
    masked = mask_routing(out, torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]))
    assert masked[1, 3, 0].tolist() == minus and masked[0, 2, 0].tolist() == [2, 3]
    wider = repad_routing(out, prompt_width=3, new_prompt_width=4, new_total_width=7)  # 1 more left, 1 more right
    assert wider.shape == (2, 7, 1, 2)
    assert torch.equal(wider[:, 1:6], out) and (wider[:, 0] == -1).all() and (wider[:, 6] == -1).all()
    with pytest.raises(ValueError, match="only widens"):
        repad_routing(out, prompt_width=3, new_prompt_width=2, new_total_width=5)
    with pytest.raises(ValueError, match="more than prompt_width"):
        pad_routing(rows, prompt_lengths=[4, 1], prompt_width=3, total_width=5)
    with pytest.raises(ValueError, match="expected"):
        pad_routing([torch.zeros(2, 2, 2), torch.zeros(2, 1, 2)], [1, 1], 2, 4)


def test_generate_with_routing_refuses_beam_search(tokenizer):
    model = build_causal_lm("olmoe", tokenizer).eval()
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="num_beams=2"):
        generate_with_routing(model, RoutingReplay(model), input_ids=enc.input_ids, num_beams=2)


def test_r3_rows_follow_num_return_sequences(tokenizer):
    """Several samples per prompt: generate repeats each prompt row, and the routing rows follow the sequences."""
    model = build_causal_lm("qwen3_moe", tokenizer).eval()
    replay = RoutingReplay(model)
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    sequences, routing = generate_with_routing(
        model, replay, **enc, max_new_tokens=4, min_new_tokens=4, do_sample=True, num_return_sequences=2
    )
    assert routing.shape[:2] == sequences.shape == (6, enc.input_ids.shape[1] + 4)
    attention_mask = torch.cat([enc.attention_mask.repeat_interleave(2, 0), torch.ones(6, 4, dtype=torch.long)], 1)
    with torch.no_grad(), replay.record():
        model(input_ids=sequences, attention_mask=attention_mask)
    real = attention_mask[:, :-1].bool()
    assert torch.equal(routing[:, :-1][real], replay.export()[:, :-1][real])
