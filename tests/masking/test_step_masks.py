"""Step loss masks on hand-built traces: each failure kind, token and character boundaries, sub-word tokens."""

import pytest
import torch

from trl_stable.masking import (
    StepSpanError,
    build_step_loss_mask,
    char_span_to_tokens,
    decode_offsets,
    normalize_signatures,
    parse_tool_call,
    schema_errors,
    validate_step,
    validate_tool_call,
)

WEATHER = {"get_weather": {"city": "string", "days": "integer"}, "check_status": None}


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', "ok"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>', "ok"),
        ('{"tool": "get_weather", "args": {"city": "Paris", "days": 3}}', "ok"),  # flat tool/args keys
        ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\", \\"days\\": 1}"}', "ok"),  # OpenAI string
        ('{"name": "check_status", "arguments": {"anything": [1, 2]}}', "ok"),  # no signature: any arguments
        ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}', "invalid_json"),  # missing brace
        ("call get_weather(Paris)", "invalid_json"),
        ('["get_weather"]', "invalid_json"),  # JSON, but not an object
        ('{"name": "get_weather", "arguments": "{city: Paris}"}', "invalid_json"),  # broken argument string
        ('{"name": "get_wether", "arguments": {"city": "Paris", "days": 3}}', "unknown_tool"),
        ('{"arguments": {"city": "Paris"}}', "unknown_tool"),  # no name at all
        ('{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}', "bad_arguments"),  # str for int
        ('{"name": "get_weather", "arguments": {"city": "Paris", "days": true}}', "bad_arguments"),  # bool != int
        ('{"name": "get_weather", "arguments": {"city": 7, "days": 3}}', "bad_arguments"),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "bad_arguments"),  # missing required
        ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "x": 1}}', "bad_arguments"),  # extra
    ],
)
def test_tool_call_failure_kinds(text, reason):
    verdict = validate_tool_call(text, normalize_signatures(WEATHER))
    assert verdict.reason == reason, verdict
    assert verdict.valid == (reason == "ok")


def test_json_schema_signature_and_openai_specs():
    specs = [
        {
            "type": "function",
            "function": {
                "name": "search",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string"},
                        "top_k": {"type": "integer"},
                        "mode": {"enum": ["fast", "deep"]},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "score": {"type": ["number", "null"]},
                    },
                    "required": ["query"],
                },
            },
        }
    ]
    tools = normalize_signatures(specs)
    ok = '{"name": "search", "arguments": {"query": "q", "top_k": 2.0, "tags": ["a"], "score": null, "other": 1}}'
    assert validate_tool_call(ok, tools).valid  # 2.0 is an integer in JSON; extra keys allowed by default
    for bad in (
        '{"name": "search", "arguments": {"query": "q", "mode": "slow"}}',
        '{"name": "search", "arguments": {"query": "q", "tags": ["a", 3]}}',
        '{"name": "search", "arguments": {"query": "q", "top_k": 2.5}}',
        '{"name": "search", "arguments": {"query": "q", "score": "high"}}',
    ):
        assert validate_tool_call(bad, tools).reason == "bad_arguments", bad
    assert schema_errors({"top_k": 2.5}, tools["search"]) == [
        "arguments: missing required 'query'",
        "arguments.top_k: expected integer, got float",
    ]
    # A list of names checks the name only.
    assert validate_tool_call('{"name": "search", "arguments": {"q": 1}}', normalize_signatures(["search"])).valid
    with pytest.raises(ValueError, match="Unknown argument type"):
        normalize_signatures({"f": {"x": "text"}})


@pytest.mark.parametrize("status, valid", [("crash", False), ("timeout", False), ("oom", False), ("ok", True)])
def test_code_step_exec_status(status, valid):
    step = {"start": 0, "end": 3, "type": "code_exec", "metadata": {"exec_status": status}}
    verdict = validate_step(step)
    assert verdict.valid is valid
    assert verdict.reason == ("ok" if valid else f"exec_{status}")
    # The flat form (metadata keys on the step itself) works too.
    assert validate_step({"start": 0, "end": 3, "type": "code", "exec_status": status}).valid is valid


@pytest.mark.parametrize(
    "status, reason",
    [("Error", "exec_crash"), ("timed-out", "exec_timeout"), ("OOMKilled", "exec_oom"), ("success", "ok")],
)
def test_exec_status_aliases(status, reason):
    assert validate_step({"start": 0, "end": 1, "type": "code", "exec_status": status}).reason == reason


def test_other_step_types_always_train_and_explicit_verdicts_win():
    assert validate_step({"start": 0, "end": 1, "type": "thought"}).valid
    assert not validate_step({"start": 0, "end": 1, "type": "thought", "metadata": {"valid": False}}).valid
    # Arrow fills missing keys with None: a None must not disable a check.
    step = {"start": 0, "end": 1, "type": "tool_call", "metadata": {"valid_tools": None, "exec_status": None}}
    assert validate_step(step, text='{"name": "nope"}', tools=["get_weather"]).reason == "unknown_tool"


def test_parse_tool_call_formats():
    call = parse_tool_call('```json\n{"function": {"name": "f", "arguments": "{\\"a\\": 1}"}}\n```')
    assert (call.name, call.arguments) == ("f", {"a": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_tool_call("<tool_call>{oops</tool_call>")


def test_token_steps_each_failure_kind(tokenizer):
    pieces = [
        ("Thought: look it up.", {"type": "thought"}),
        ('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}', {"type": "tool_call"}),  # valid
        ('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}', {"type": "tool_call"}),  # bad JSON
        ('{"name": "launch", "arguments": {}}', {"type": "tool_call"}),  # unknown tool
        ('{"name": "get_weather", "arguments": {"city": "Oslo", "days": "2"}}', {"type": "tool_call"}),  # bad type
        ("print(1/0)", {"type": "code", "metadata": {"exec_status": "crash"}}),
        ("while True: pass", {"type": "code", "metadata": {"exec_status": "timeout"}}),
        ("x = [0] * 10**12", {"type": "code", "metadata": {"exec_status": "oom"}}),
        ("print(2)", {"type": "code", "metadata": {"exec_status": "ok"}}),
    ]
    ids, steps, expected = [], [], []
    for text, meta in pieces:
        piece_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        steps.append({"start": len(ids), "end": len(ids) + len(piece_ids), **meta})
        ids += piece_ids
    expected_valid = [True, True, False, False, False, False, False, False, True]
    for (_, _), valid, step in zip(pieces, expected_valid, steps):
        expected += [1.0 if valid else 0.0] * (step["end"] - step["start"])
    result = build_step_loss_mask(ids, steps, tokenizer=tokenizer, tools=WEATHER)
    assert [v.reason for v in result.verdicts] == [
        "ok", "ok", "invalid_json", "unknown_tool", "bad_arguments", "exec_crash", "exec_timeout", "exec_oom", "ok",
    ]  # fmt: skip
    assert result.mask.tolist() == expected
    assert result.num_invalid_steps == 6
    assert result.mask.dtype == torch.float32


def test_char_steps_mask_subword_tokens_straddling_a_boundary(tokenizer):
    text = "weather"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1  # one sub-word token covers both steps below
    steps = [
        {"start": 0, "end": 3, "unit": "char", "type": "code", "metadata": {"exec_status": "crash"}},  # "wea"
        {"start": 3, "end": 7, "unit": "char", "type": "text"},  # "ther"
    ]
    # A token carrying part of an invalid step is masked, even though it also belongs to a valid step.
    assert build_step_loss_mask(ids, steps, tokenizer=tokenizer, text=text).mask.tolist() == [0.0]


def test_char_steps_on_a_trace(tokenizer):
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>'
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": "one"}}</tool_call>'
    text = f"I will check. {good} Hmm, again: {bad} Done."
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    g0 = text.index(good)
    b0 = text.index(bad)
    steps = [
        {"start": g0, "end": g0 + len(good), "unit": "char", "type": "tool_call"},
        {"start": b0, "end": b0 + len(bad), "unit": "char", "type": "tool_call"},
    ]
    result = build_step_loss_mask(ids, steps, tokenizer=tokenizer, text=text, tools=WEATHER)
    assert [v.reason for v in result.verdicts] == ["ok", "bad_arguments"]
    # Independent check: a token is dropped iff its character span overlaps the bad call.
    expected = [0.0 if (s < b0 + len(bad) and e > b0) else 1.0 for s, e in offsets]
    assert result.mask.tolist() == expected
    kept = tokenizer.decode([i for i, m in zip(ids, result.mask.tolist()) if m])
    assert bad not in kept and good in kept and kept.endswith("Done.")
    # outside_steps=0 trains only on the valid steps.
    only_valid = build_step_loss_mask(ids, steps, tokenizer=tokenizer, text=text, tools=WEATHER, outside_steps=0)
    assert tokenizer.decode([i for i, m in zip(ids, only_valid.mask.tolist()) if m]).strip() == good


def test_char_span_to_tokens_and_misaligned_text(tokenizer):
    offsets = [(0, 2), (2, 5), (5, 5), (5, 9)]
    assert char_span_to_tokens(offsets, 3, 6) == (1, 4)
    assert char_span_to_tokens(offsets, 9, 12) == (0, 0)
    with pytest.raises(ValueError, match="does not reproduce"):
        build_step_loss_mask([1, 2, 3], [{"start": 0, "end": 2, "unit": "char"}], tokenizer=tokenizer, text="hello")
    with pytest.raises(ValueError, match=r"steps\[0\] is \[2, 5\) in tokens, not a span of the sequence's 3 tokens"):
        build_step_loss_mask([1, 2, 3], [{"start": 2, "end": 5}])


@pytest.mark.parametrize(
    "step, message",
    [
        (None, r"steps\[1\] is None \(NoneType\)"),
        ("0:2", r"steps\[1\] is '0:2' \(str\)"),
        ({"start": None, "end": 2}, r"steps\[1\] has start=None, end=2"),
        ({"start": "0", "end": 2}, r"steps\[1\] has start='0', end=2"),
        ({"start": 0.5, "end": 2}, r"steps\[1\] has start=0.5, end=2"),
        ({"start": True, "end": 2}, r"steps\[1\] has start=True, end=2"),
        ({"start": 0, "end": 2, "unit": "word"}, r"steps\[1\] has unit='word'"),
        ({"start": 2, "end": 1}, r"steps\[1\] is \[2, 1\) in tokens"),
        ({"start": -1, "end": 1}, r"steps\[1\] is \[-1, 1\) in tokens"),
        (
            {"start": 0, "end": 6, "unit": "char"},
            r"steps\[1\] is \[0, 6\) in chars, not a span of the sequence's 5 chars",
        ),
    ],
)
def test_a_step_that_is_not_a_span_is_refused_naming_it(tokenizer, step, message):
    """Malformed steps (not a dict, missing or non-integer bounds, unknown unit, reversed or out of range) raise
    `StepSpanError` naming the step and the expected shape, before any token is masked."""
    ids = tokenizer("hello", add_special_tokens=False)["input_ids"]
    steps = [{"start": 0, "end": 1}, step]
    with pytest.raises(StepSpanError, match=message) as err:
        build_step_loss_mask(ids, steps, tokenizer=tokenizer, text="hello")
    assert '"unit": "token" or "char"' in str(err.value)  # the fix: the step's expected shape
    with pytest.raises(StepSpanError, match=r"steps is \{'start'"):
        build_step_loss_mask(ids, {"start": 0, "end": 1})  # one step, not a list of them


def test_decode_offsets_with_multibyte_characters(tokenizer):
    text = 'ok <tool_call>{"name": "é€"}</tool_call> ü'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded, offsets = decode_offsets(tokenizer, ids)
    assert decoded == text
    # Independent reference: the fast tokenizer's own offsets, where every byte token of a character spans it.
    reference = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert offsets == [tuple(o) for o in reference]


def test_rl_step_starting_with_a_multibyte_character_masks_its_first_byte_tokens(tokenizer):
    """A step beginning with "é" (two byte tokens): the token holding its first byte is masked too."""
    text = "ok é€ crashed"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded, offsets = decode_offsets(tokenizer, ids)
    start = text.index("é")
    step = {"start": start, "end": len(text), "unit": "char", "type": "code", "metadata": {"exec_status": "crash"}}
    mask = build_step_loss_mask(ids, [step], text=decoded, offsets=offsets).mask.tolist()
    ref = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert mask == [0.0 if e > start else 1.0 for s, e in ref]
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "ok "


def test_nan_infinity_and_boolean_enum_are_rejected():
    tools = normalize_signatures({"f": {"type": "object", "properties": {"x": {"enum": [1, 2]}}}})
    assert validate_tool_call('{"name": "f", "arguments": {"x": NaN}}', tools).reason == "invalid_json"
    assert validate_tool_call('{"name": "f", "arguments": "{\\"x\\": -Infinity}"}', tools).reason == "invalid_json"
    assert validate_tool_call('{"name": "f", "arguments": {"x": true}}', tools).reason == "bad_arguments"
    assert validate_tool_call('{"name": "f", "arguments": {"x": 1}}', tools).valid
