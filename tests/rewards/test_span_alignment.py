"""Span location and span -> token alignment (RELC's substring-containment bugs must not come back)."""

import pytest

from trl_stable.rewards import locate_span, span_token_rewards, token_char_offsets


def offsets_of(pieces):
    """Offsets of consecutive token strings, and their concatenated text."""
    out, pos = [], 0
    for p in pieces:
        out.append((pos, pos + len(p)))
        pos += len(p)
    return "".join(pieces), out


def test_locate_span_case_whitespace_boundaries_every_occurrence():
    text = "The film, the  Film!\nthe\tfilm theFilm"
    assert locate_span(text, "the film") == [(0, 8), (10, 19), (21, 29)]
    assert locate_span(text, "THE") == [(0, 3), (10, 13), (21, 24)]  # not inside "theFilm"
    assert locate_span("there thesis bathe", "the") == []
    assert locate_span("well-made and well made", "well made") == [(14, 23)]
    assert locate_span("so good!!", "!!") == [(7, 9)]  # a span without word characters needs no boundary
    assert locate_span("anything", "   ") == []


def test_common_word_does_not_match_everywhere():
    # RELC: `token in span` gave " the" a reward because "the" occurs inside the span "the best". Only the tokens
    # of the located occurrence may be rewarded; "there"/"other" tokens must not.
    text, offs = offsets_of(["The", " best", " of", " the", " rest", " there", " other"])
    r = span_token_rewards(text, offs, ["the best"], [], positive_value=1.0)
    assert r == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_leading_space_token_gets_first_word():
    # RELC: the span "great acting" does not contain the token " great" (leading space), so the first word was missed.
    text, offs = offsets_of([" It", " had", " great", " acting", "."])
    assert span_token_rewards(text, offs, ["great acting"], []) == [0.0, 0.0, 0.5, 0.5, 0.0]


def test_repeated_span_rewards_every_occurrence():
    text, offs = offsets_of([" bad", " food", ",", " bad", " service", ",", " Bad", " vibes"])
    r = span_token_rewards(text, offs, [], ["bad"], negative_value=-1.0)
    assert r == [-1.0, 0.0, 0.0, -1.0, 0.0, 0.0, -1.0, 0.0]


def test_subword_tokens_all_get_the_value_and_partial_words_do_not_match():
    text, offs = offsets_of([" un", "believ", "ably", " good", " unbel"])
    r = span_token_rewards(text, offs, ["unbelievably good"], [], positive_value=2.0)
    assert r == [2.0, 2.0, 2.0, 2.0, 0.0]  # " unbel" is a prefix of the span's word, not an occurrence of it


def test_positive_and_negative_add_and_overlapping_spans_count_once():
    text, offs = offsets_of([" not", " bad", " at", " all"])
    r = span_token_rewards(text, offs, ["not bad", "bad"], ["bad at all"], positive_value=0.5, negative_value=-0.25)
    assert r == [0.5, 0.25, -0.25, -0.25]


def test_span_absent_from_response_rewards_nothing():
    # The word occurs in the prompt, not in the response text the offsets refer to.
    text, offs = offsets_of([" and", " then", " it", " ended"])
    assert span_token_rewards(text, offs, ["wonderful"], ["terrible"]) == [0.0] * 4


def test_empty_tokens_are_never_rewarded():
    text = "great"
    assert span_token_rewards(text, [(0, 5), (5, 5), (0, 0)], ["great"], []) == [0.5, 0.0, 0.0]


def test_unicode_spans():
    text, offs = offsets_of([" Ça", " été", " très", " émouvant", " 😀"])
    r = span_token_rewards(text, offs, ["TRÈS émouvant"], ["😀"], positive_value=1.0, negative_value=-1.0)
    assert r == [0.0, 0.0, 1.0, 1.0, -1.0]


@pytest.mark.parametrize(
    "text",
    ["The movie was great, the acting superb.", " héllo wörld 😀 naïve", "the there thesis", " a\nb  c", ""],
)
def test_token_char_offsets_cover_the_decoded_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    decoded, offsets = token_char_offsets(tokenizer, ids)
    assert decoded == text
    assert len(offsets) == len(ids)
    assert offsets[-1][0] == offsets[-1][1]  # EOS: no characters
    _check_offsets(text, offsets)


def test_token_char_offsets_non_canonical_tokenization_uses_incremental_decoding(tokenizer):
    # A sampled completion need not be the tokenizer's own encoding of its text: spell " great" byte by byte.
    pieces = [" ", "g", "r", "e", "a", "t", " day"]
    ids = [i for p in pieces for i in tokenizer.convert_tokens_to_ids(tokenizer.tokenize(p))]
    assert tokenizer.decode(ids) == " great day"
    assert ids != tokenizer(" great day", add_special_tokens=False)["input_ids"]
    text, offsets = token_char_offsets(tokenizer, ids)
    assert text == " great day"
    assert offsets[:6] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert offsets[6][0] == 6 and offsets[-1][1] == 10
    r = span_token_rewards(text, offsets, ["great"], [])
    assert r == [0.0, 0.5, 0.5, 0.5, 0.5, 0.5] + [0.0] * (len(ids) - 6)


def test_multibyte_character_split_over_tokens_is_rewarded_on_every_piece(tokenizer):
    text = " très bien"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded, offsets = token_char_offsets(tokenizer, ids)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the kit tokenizer splits "è" into two byte tokens
    r = span_token_rewards(decoded, offsets, ["très"], [])
    expected = [0.5 if s < 5 and e > 1 else 0.0 for s, e in offsets]  # "très" is characters 1..5
    assert r == expected
    assert sum(v > 0 for v in r) >= 3


def test_end_to_end_with_kit_tokenizer_prompt_words_excluded(tokenizer):
    prompt = "The great wall"
    completion = " was great, the great view"
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    text, offsets = token_char_offsets(tokenizer, ids)
    r = span_token_rewards(text, offsets, ["great"], [])
    tokens = [tokenizer.decode([i]) for i in ids]
    # only the two completion tokens that spell "great" are rewarded, never "the"/"was"/"view"
    rewarded = [t for t, v in zip(tokens, r) if v]
    assert "".join(rewarded).replace(" ", "") == "greatgreat", (tokens, r)
    assert prompt not in text


def _check_offsets(text, offsets):
    """Every character belongs to some token, offsets are in range and never go backwards."""
    covered = set()
    for s, e in offsets:
        assert 0 <= s <= e <= len(text)
        covered.update(range(s, e))
    assert covered == set(range(len(text)))
    assert all(a[0] <= b[0] for a, b in zip(offsets, offsets[1:]))


def test_stream_and_prefix_decoding_agree_on_random_token_sequences(tokenizer):
    import random

    from trl_stable.masking.token_offsets import _incremental_offsets, _stream_offsets

    rng = random.Random(0)
    checked_equal = 0
    for _ in range(150):
        ids = [rng.randrange(4, len(tokenizer)) for _ in range(rng.randrange(1, 20))]
        text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        streamed, prefixed = _stream_offsets(tokenizer, ids, text), _incremental_offsets(tokenizer, ids, text)
        assert streamed is not None
        _check_offsets(text, streamed)
        _check_offsets(text, prefixed)
        if "\ufffd" not in text:  # invalid byte runs may be assigned differently, everything else identically
            assert streamed == prefixed
            checked_equal += 1
    assert checked_equal >= 20


class _SlowTokenizer:
    """Only `decode`: no offset mapping, no streaming backend; the quadratic prefix fallback must do."""

    is_fast = False
    all_special_ids = []

    def __init__(self, inner):
        self.inner = inner

    def decode(self, ids, **kw):
        return self.inner.decode(ids, **kw)


def test_prefix_decoding_fallback_for_any_tokenizer(tokenizer):
    text = " Très bien, the great 😀 day"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    fast_text, fast = token_char_offsets(tokenizer, ids)
    slow_text, slow = token_char_offsets(_SlowTokenizer(tokenizer), ids)
    assert slow_text == fast_text == text
    _check_offsets(text, slow)
    assert span_token_rewards(text, slow, ["great"], ["très"]) == span_token_rewards(text, fast, ["great"], ["très"])


class _OffsetMappingOnly(_SlowTokenizer):
    """A fast tokenizer without a streaming backend: the offset-mapping path must do."""

    is_fast = True

    def __init__(self, inner):
        super().__init__(inner)
        self.all_special_ids = inner.all_special_ids

    def __call__(self, text, **kw):
        return self.inner(text, **kw)


def test_offset_mapping_path_and_its_guard(tokenizer, monkeypatch):
    import trl_stable.masking.token_offsets as sa

    text = " The great film, the great day"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    via_stream = token_char_offsets(tokenizer, ids)
    with monkeypatch.context() as m:
        m.setattr(sa, "_incremental_offsets", None)  # must not be needed: the offset mapping answers
        via_mapping = token_char_offsets(_OffsetMappingOnly(tokenizer), ids)
    assert via_mapping == via_stream
    # a non-canonical tokenisation does not re-encode to the same ids: prefix decoding takes over, same offsets
    pieces = [" ", "g", "r", "e", "a", "t"]
    odd = [i for p in pieces for i in tokenizer.convert_tokens_to_ids(tokenizer.tokenize(p))]
    assert token_char_offsets(_OffsetMappingOnly(tokenizer), odd) == token_char_offsets(tokenizer, odd)


def test_overlapping_occurrences_apostrophes_and_lenient_fallbacks():
    assert locate_span("ha ha ha", "ha ha") == [(0, 5), (3, 8)]  # every occurrence, overlapping ones too
    assert locate_span("I don\u2019t care", "don't") == [(2, 7)]  # the critic retyped the apostrophe
    assert locate_span("It was wow", "wow!") == [(7, 10)]  # punctuation the text does not have
    assert locate_span("It was wow", "wow!", lenient=False) == []
    assert locate_span("you idiot, really", "idiot - an insult") == [(4, 9)]  # commentary after a dash
    assert locate_span("great, fun", "great , fun") == [(0, 5), (7, 10)]  # parts, when the whole is absent
    assert locate_span("so great!!", "great!!") == [(3, 10)]  # the exact form wins when present
    assert locate_span("nothing here", "--") == []
    text, offs = offsets_of([" ha", " ha", " ha", " ho"])
    assert span_token_rewards(text, offs, ["ha ha"], []) == [0.5, 0.5, 0.5, 0.0]


def _bytes_to_unicode():
    """GPT-2's byte <-> printable character table (written out here as an independent reference)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def reference_byte_level_offsets(tokenizer, ids):
    """Character offsets from the tokens' own bytes: a token covers every character one of its bytes belongs to."""
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    token_bytes = [bytes(to_byte[c] for c in tokenizer.convert_ids_to_tokens(i)) for i in ids]
    text = b"".join(token_bytes).decode("utf-8")
    char_of_byte = [k for k, ch in enumerate(text) for _ in ch.encode("utf-8")]
    offsets, pos = [], 0
    for b in token_bytes:
        offsets.append((char_of_byte[pos], char_of_byte[pos + len(b) - 1] + 1) if b else (0, 0))
        pos += len(b)
    return text, offsets


def merged_byte_tokenizer():
    """A byte-level BPE whose tokens mix whole characters with a piece of a multi-byte one: " è" is split as
    "Ġ" + first byte of "è" | second byte of "è" + "s"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("Ġ", "Ã"), ("¨", "s"), ("a", "Ã")]
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    vocab.update({a + b: len(vocab) + k for k, (a, b) in enumerate(merges)})
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


@pytest.mark.parametrize("path", ["stream", "prefix"])
def test_token_holding_a_whole_char_and_part_of_the_next(path):
    # "Ġ"+byte1(è) then byte2(è)+"s": the first token holds " " and half of "è", so the span "ès" must reach it.
    from trl_stable.masking.token_offsets import _incremental_offsets, _stream_offsets

    tok = merged_byte_tokenizer()
    ids = tok("x ès aès", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["x", "ĠÃ", "¨s", "Ġ", "aÃ", "¨s"]
    text, expected = reference_byte_level_offsets(tok, ids)
    assert expected == [(0, 1), (1, 3), (2, 4), (4, 5), (5, 7), (6, 8)]
    offsets = (_stream_offsets if path == "stream" else _incremental_offsets)(tok, ids, text)
    assert offsets == expected
    assert span_token_rewards(text, offsets, ["ès"], []) == [0.0, 0.5, 0.5, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("path", ["stream", "offset_mapping", "prefix"])
def test_offsets_match_byte_level_reference_on_random_texts(tokenizer, path):
    import random

    wrapped = {
        "stream": tokenizer,
        "offset_mapping": _OffsetMappingOnly(tokenizer),
        "prefix": _SlowTokenizer(tokenizer),
    }
    rng = random.Random(1)
    pieces = ["é", "😀", "ß", " Ça", " naïve", "x", " the", "日本", "!"]
    for _ in range(30):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8)))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert token_char_offsets(wrapped[path], ids) == reference_byte_level_offsets(tokenizer, ids), text


def test_sentencepiece_style_tokenizer_with_byte_fallback():
    # Llama-style: "▁" word marker, a stripped leading space, "<0xC3><0xA8>" byte tokens for "è".
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from trl_stable.masking.token_offsets import _incremental_offsets, _stream_offsets

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t in ["▁", "t", "r", "s", "b", "i", "e", "n", "x", "▁t", "▁b", "ie", "▁bie", "▁bien"]:
        vocab[t] = len(vocab)
    merges = [("▁", "t"), ("▁", "b"), ("i", "e"), ("▁b", "ie"), ("▁bie", "n")]
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    ids = tok("x très bien", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.convert_ids_to_tokens(ids)[4:6] == ["<0xC3>", "<0xA8>"]
    text, offsets = token_char_offsets(tok, ids)
    assert text == "x très bien"
    assert offsets == [(0, 0), (0, 1), (1, 3), (3, 4), (4, 5), (4, 5), (5, 6), (6, 11), (11, 11)]
    assert _stream_offsets(tok, ids[:-1], text) == _incremental_offsets(tok, ids[:-1], text) == offsets[:-1]
    assert span_token_rewards(text, offsets, ["TRÈS"], []) == [0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0]


def test_overlap_mask_matches_brute_force():
    import random

    from trl_stable.rewards.critic.alignment import _overlap_mask

    rng = random.Random(3)
    for _ in range(300):
        ranges = [(a, a + rng.randrange(0, 6)) for a in (rng.randrange(0, 30) for _ in range(rng.randrange(0, 6)))]
        offsets = [(s, s + rng.randrange(0, 4)) for s in (rng.randrange(0, 32) for _ in range(10))]
        brute = [e > s and any(a < e and s < b for a, b in ranges) for s, e in offsets]
        assert _overlap_mask(offsets, ranges) == brute, (ranges, offsets)
