"""Automatic step finding from chat transcripts with tool calls."""

import pytest

from trl_stable.masking import classify_exec_output, find_transcript_steps, step_mask_example

TOOLS = {"get_weather": {"city": "string"}, "python": {"code": "string"}}


def _kept(tokenizer, found, mask):
    return tokenizer.decode([i for i, m in zip(found.input_ids, mask.tolist()) if m])


def test_structured_tool_calls_code_crash_and_broken_json(tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "First I check.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Let me compute.\n```python\nprint(1/0)\n```"},
        {"role": "tool", "content": "Traceback (most recent call last):\nZeroDivisionError: division by zero"},
        {"role": "assistant", "content": "<tool_call>{bad json</tool_call> It is sunny."},
    ]
    found = find_transcript_steps(messages, tokenizer)
    kinds = [(s["type"], found.text[s["start"] : s["end"]]) for s in found.steps]
    # The tiny chat template drops structured tool calls, so they were inlined as a tool-call block.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert ("tool_call", call) in kinds
    assert ("code", "```python\nprint(1/0)\n```") in kinds
    assert ("tool_call", "<tool_call>{bad json</tool_call>") in kinds
    code = next(s for s in found.steps if s["type"] == "code")
    assert code["metadata"]["exec_status"] == "crash" and code["metadata"]["result_message_index"] == 4

    result = found.loss_mask(tools=TOOLS)
    assert [v.reason for v in result.verdicts if not v.valid] == ["exec_crash", "invalid_json"]
    kept = _kept(tokenizer, found, result.mask)
    assert "First I check." in kept and call in kept and "It is sunny." in kept
    assert "print(1/0)" not in kept and "bad json" not in kept
    # Only assistant content trains: no user turn, no tool output, no role header.
    assert "Weather in Paris" not in kept and "sunny<" not in kept and "Traceback" not in kept
    assert "assistant" not in kept
    # Without the assistant restriction the user turn trains too (invalid steps still do not).
    everything = _kept(tokenizer, found, found.loss_mask(tools=TOOLS, assistant_only=False).mask)
    assert "Weather in Paris" in everything and "bad json" not in everything


def test_explicit_status_and_out_of_order_tool_call_ids(tokenizer):
    messages = [
        {"role": "user", "content": "Run both."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "function": {"name": "python", "arguments": {"code": "slow()"}}},
                {"id": "b", "function": {"name": "python", "arguments": {"code": "ok()"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "done"},
        {"role": "tool", "tool_call_id": "a", "content": "", "exec_status": "timeout"},
        {"role": "assistant", "content": "One call timed out."},
    ]
    found = find_transcript_steps(messages, tokenizer)
    calls = [s for s in found.steps if s["type"] == "tool_call"]
    assert [c["metadata"]["tool_call_id"] for c in calls] == ["a", "b"]
    assert calls[0]["metadata"]["exec_status"] == "timeout"
    assert calls[1]["metadata"]["exec_status"] == "ok"
    result = found.loss_mask(tools=TOOLS)
    assert [v.reason for v in result.verdicts if v.reason != "ok"] == ["exec_timeout"]
    kept = _kept(tokenizer, found, result.mask)
    assert "slow()" not in kept and "ok()" in kept and "One call timed out." in kept


def test_step_mask_example_labels(tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": '<tool_call>{"name": "launch", "arguments": {}}</tool_call> hello'},
    ]
    row = step_mask_example({"messages": messages}, tokenizer, tools=TOOLS)
    assert row["num_steps"] == 2 and row["num_invalid_steps"] == 1
    trained = tokenizer.decode([i for i, label in zip(row["input_ids"], row["labels"]) if label != -100])
    assert trained.strip() == "hello<|endoftext|>"
    with pytest.raises(ValueError, match="needs 'messages'"):
        step_mask_example({"prompt": "x"}, tokenizer)


@pytest.mark.parametrize(
    "output, status",
    [
        ("Traceback (most recent call last):\n  File ...\nKeyError: 'x'", "crash"),
        ("torch.OutOfMemoryError: CUDA out of memory.", "oom"),
        ("Execution timed out after 30 s", "timeout"),
        ("ValueError: bad", "crash"),
        ("42\n", "ok"),
    ],
)
def test_classify_exec_output(output, status):
    assert classify_exec_output(output) == status


def test_template_that_renders_tool_calls_itself():
    from trl_stable.testing import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}\n<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
        "<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [
        {"role": "user", "content": "Two cities."},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "x", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                {"id": "y", "function": {"name": "get_weather", "arguments": {"city": 12}}},
            ],
        },
        {"role": "tool", "tool_call_id": "x", "content": "rain"},
    ]
    found = find_transcript_steps(messages, tok)
    assert found.text.count("<tool_call>") == 2  # rendered by the template, not inlined a second time
    calls = [s for s in found.steps if s["type"] == "tool_call"]
    assert [c["metadata"]["tool_call_id"] for c in calls] == ["x", "y"]
    assert calls[0]["metadata"]["result_message_index"] == 2
    result = found.loss_mask(tools=TOOLS)
    assert [v.reason for v in result.verdicts if not v.valid] == ["bad_arguments"]
    kept = _kept(tok, found, result.mask)
    assert '"Rome"' in kept and "12" not in kept and "Checking." in kept
