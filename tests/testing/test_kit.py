import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_stable.testing import (
    CAUSAL_LM_FAMILIES,
    MOE_FAMILIES,
    build_causal_lm,
    build_reward_model,
    build_tokenizer,
    save_tiny,
)


def test_tokenizer_specials_offsets_and_chat(tokenizer):
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    text = "The movie was great! héllo 🙂"
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    assert tokenizer.decode(enc["input_ids"]) == text  # byte-level: lossless for any unicode
    # Offsets cover the text: the last token ends at the end of the string.
    assert enc["offset_mapping"][-1][1] == len(text)
    messages = [{"role": "user", "content": "hi"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|endoftext|>\n<|im_start|>assistant\n"


def test_tokenizer_is_deterministic():
    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert len(a) > 500  # whole words like " great" are single tokens, which the sentiment examples rely on
    assert len(a.tokenize(" great")) == 1


@pytest.mark.parametrize("family", CAUSAL_LM_FAMILIES)
def test_family_generates_and_trains(tokenizer, family):
    model = build_causal_lm(family, tokenizer, seed=0)
    batch = tokenizer(["The movie", "I think the first half"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=4, do_sample=True, top_k=0)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)
    model.train()
    loss = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_moe_families_are_moe(tokenizer):
    for family in MOE_FAMILIES:
        model = build_causal_lm(family, tokenizer)
        assert any("expert" in name for name, _ in model.named_parameters()), family


def test_seed_determinism(tokenizer):
    a = build_causal_lm("qwen3_moe", tokenizer, seed=3)
    b = build_causal_lm("qwen3_moe", tokenizer, seed=3)
    c = build_causal_lm("qwen3_moe", tokenizer, seed=4)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_building_does_not_disturb_caller_rng(tokenizer):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_causal_lm("gpt2", tokenizer, seed=99)
    torch.testing.assert_close(torch.rand(3), expected)


def test_save_load_round_trip(tokenizer, tmp_path):
    model = build_causal_lm("qwen2", tokenizer, seed=1)
    path = save_tiny(tmp_path / "tiny", model, tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    loaded_tok = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("The weather today", return_tensors="pt")["input_ids"]
    assert loaded_tok("The weather today", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    assert loaded_tok.chat_template == tokenizer.chat_template
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)

    rm = build_reward_model(tokenizer=tokenizer, seed=0)
    rm_path = save_tiny(tmp_path / "rm", rm, tokenizer)
    rm_loaded = AutoModelForSequenceClassification.from_pretrained(rm_path)
    batch = tokenizer(["good", "bad movie"], return_tensors="pt", padding=True)
    assert rm_loaded(**batch).logits.shape == (2, 1)
    torch.testing.assert_close(rm_loaded(**batch).logits, rm(**batch).logits)


def test_unknown_family_error(tokenizer):
    with pytest.raises(ValueError, match="Unknown family 'bert'"):
        build_causal_lm("bert", tokenizer)
