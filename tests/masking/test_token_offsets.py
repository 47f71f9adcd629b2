"""`trl_stable.masking.token_offsets`: the one token -> character mapping that critic spans and agent steps share."""

from trl_stable.masking import decode_offsets
from trl_stable.masking.token_offsets import char_span_to_tokens, encode_with_offsets, token_char_offsets


def test_special_tokens_are_skipped_for_critic_text_and_kept_for_step_markers(tokenizer):
    ids = tokenizer(" good film", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    eos = tokenizer.decode([tokenizer.eos_token_id])
    text, offsets = token_char_offsets(tokenizer, ids)
    assert text == " good film" and offsets[-1] == (len(text), len(text))  # EOS: empty, after the text
    kept_text, kept = decode_offsets(tokenizer, ids)
    assert kept_text == " good film" + eos and kept[-1] == (len(text), len(text) + len(eos))
    assert kept[:-1] == offsets[:-1]  # the ordinary tokens sit at the same characters either way
    # every character of the text is covered, in order, by exactly the tokens decoding produced
    assert "".join(kept_text[a:b] for a, b in kept) == kept_text


def test_encoded_offsets_and_char_spans(tokenizer):
    ids, offsets = encode_with_offsets(tokenizer, "the great day")
    assert ids == tokenizer("the great day", add_special_tokens=False)["input_ids"]
    first, last = char_span_to_tokens(offsets, 4, 9)  # "great"
    assert "".join(tokenizer.decode([i]) for i in ids[first:last]).strip() == "great"
    assert char_span_to_tokens(offsets, 100, 101) == (0, 0)
