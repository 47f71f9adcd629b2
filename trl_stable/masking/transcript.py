"""Find the steps of a chat transcript with tool calls (docs/agent_steps.md): tool-call blocks and fenced code blocks
of each assistant turn, located by rendering growing prefixes with the chat template, with the outcome a following
tool message reports (``exec_status`` / ``status``, or read from its output)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trl_stable.masking.mask import StepMask, build_step_loss_mask
from trl_stable.masking.token_offsets import encode_with_offsets
from trl_stable.masking.validation import find_tool_call_spans, parse_tool_call

DEFAULT_CODE_TOOLS = ("python", "code_interpreter", "execute_code", "run_code", "ipython", "exec", "bash", "shell")
TOOL_ROLES = ("tool", "ipython", "function", "observation")

_CODE_FENCE = re.compile(r"```(?:python|py|bash|sh|shell)?[ \t]*\n.*?```", flags=re.DOTALL)
_EXEC_PATTERNS = (
    ("oom", re.compile(r"out of memory|MemoryError|\bOOM\b|OutOfMemory", re.IGNORECASE)),
    ("timeout", re.compile(r"timed? ?out|TimeoutError|TimeoutExpired|deadline exceeded", re.IGNORECASE)),
    (
        "crash",
        re.compile(
            r"Traceback \(most recent call last\)|Segmentation fault|core dumped|^\w*(Error|Exception):|"
            r"exit(?:ed with)? (?:code|status) [1-9]",
            re.IGNORECASE | re.MULTILINE,
        ),
    ),
)


def classify_exec_output(output: str) -> str:
    """An execution outcome read from a tool's output by the patterns of tracebacks, timeouts and out-of-memory kills:
    "oom", "timeout", "crash" or "ok" (an environment that knows the outcome puts ``exec_status`` on the message)."""
    return next((status for status, pattern in _EXEC_PATTERNS if pattern.search(output or "")), "ok")


@dataclass
class TranscriptSteps:
    """A rendered transcript: its `text`, tokens (no special tokens beyond the template's) and their character
    `offsets`, its character-boundary `steps` in order, and per token 1 inside an assistant turn's content."""

    text: str
    input_ids: list[int]
    offsets: list[tuple[int, int]]
    steps: list[dict[str, Any]] = field(default_factory=list)
    assistant_mask: list[int] = field(default_factory=list)

    def loss_mask(self, tools: Any = None, assistant_only: bool = True, **kwargs: Any) -> StepMask:
        """The step loss mask (times the assistant mask when `assistant_only`); kwargs go to `build_step_loss_mask`."""
        result = build_step_loss_mask(
            self.input_ids, self.steps, text=self.text, offsets=self.offsets, tools=tools, **kwargs
        )
        if assistant_only:
            result.mask = result.mask * result.mask.new_tensor(self.assistant_mask)
        return result


def _tool_call_text(call: Mapping[str, Any], open_tag: str, close_tag: str) -> str:
    fn = call.get("function", call)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:  # a JSON-encoded string stays a string only when it is broken: keep it verbatim then
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f'{open_tag}\n{{"name": {json.dumps(fn.get("name"))}, "arguments": {arguments}}}\n{close_tag}'
    return f"{open_tag}\n{json.dumps({'name': fn.get('name'), 'arguments': arguments})}\n{close_tag}"


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template_kwargs: dict, gen: bool = False,
            strict: bool = True) -> str | None:  # fmt: skip
    """The chat template's text of `messages`; unless `strict`, None when the template rejects this prefix (e.g. one
    ending on a tool message)."""
    if not messages:
        return ""
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=gen, **template_kwargs
        )
    except Exception:  # noqa: BLE001 - fall back to locating the content
        if strict:
            raise
        return None


def _inline_tool_calls(tokenizer: Any, messages: list[dict], template_kwargs: dict, open_tag: str, close_tag: str):
    """Structured tool calls appended to the assistant content when the template does not render them; either way their
    ids are kept (``_tool_call_ids``) to match tool replies to calls."""
    if not any(m.get("role") == "assistant" and m.get("tool_calls") for m in messages):
        return [dict(m) for m in messages]
    stripped = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    # None: a template that cannot render structured calls at all
    with_calls, without = (_render(tokenizer, m, template_kwargs, strict=False) for m in (messages, stripped))
    renders_calls = None not in (with_calls, without) and with_calls != without
    out = [dict(m) if renders_calls or m.get("role") != "assistant" or not m.get("tool_calls") else b
           for m, b in zip(messages, stripped)]  # fmt: skip
    for entry, msg in zip(out, messages):
        calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
        if calls and not renders_calls:
            blocks = "\n".join(_tool_call_text(c, open_tag, close_tag) for c in calls)
            entry["content"] = f"{msg['content']}\n{blocks}" if msg.get("content") else blocks
        if calls:
            entry["_tool_call_ids"] = [c.get("id") for c in calls]
    return out


def find_transcript_steps(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    open_tag: str = "<tool_call>",
    close_tag: str = "</tool_call>",
    code_tools: Sequence[str] = DEFAULT_CODE_TOOLS,
    infer_exec_status: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> TranscriptSteps:
    """Render `messages` with the tokenizer's chat template and find its steps.

    `messages` have ``role``, ``content``, optional ``tool_calls`` (tool replies: ``tool_call_id``, ``exec_status``);
    `tokenizer` is a fast one with a chat template; a call to one of `code_tools` is a code step whose outcome is its
    reply (read from the output when `infer_exec_status`); `template_kwargs` go to ``apply_chat_template``.
    """
    template_kwargs = dict(template_kwargs or {})
    msgs = _inline_tool_calls(tokenizer, [dict(m) for m in messages], template_kwargs, open_tag, close_tag)
    rendered_msgs = [{k: v for k, v in m.items() if not k.startswith("_")} for m in msgs]
    text = _render(tokenizer, rendered_msgs, template_kwargs)
    bodies = _assistant_bodies(tokenizer, rendered_msgs, text, template_kwargs)

    steps: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # executable steps of the last assistant turn, waiting for their outcome
    for k, msg in enumerate(msgs):
        if msg.get("role") == "assistant":
            turn = _assistant_steps(text, *bodies[k], k, list(msg.get("_tool_call_ids", [])), open_tag, close_tag)
            steps += turn
            pending = [step for step in turn if step["type"] != "text"]
        elif msg.get("role") in TOOL_ROLES and pending:
            _attach_outcome(pending, msg, k, code_tools, infer_exec_status)

    input_ids, offsets = encode_with_offsets(tokenizer, text)
    assistant = [int(any(s < b and e > a and e > s for a, b in bodies.values())) for s, e in offsets]
    return TranscriptSteps(text=text, input_ids=input_ids, offsets=offsets, steps=steps, assistant_mask=assistant)


def _assistant_bodies(
    tokenizer: Any, messages: list[dict[str, Any]], text: str, template_kwargs: dict
) -> dict[int, tuple[int, int]]:
    """Each assistant turn's own content in `text`: after its role header, trailing whitespace (end-of-turn newline)
    excluded; from rendering growing prefixes, or by locating the content when the template is not prefix-stable (e.g.
    it rewrites earlier turns)."""
    bodies: dict[int, tuple[int, int]] = {}
    prev_text, pos = "", 0
    for k, msg in enumerate(messages):
        cur = _render(tokenizer, messages[: k + 1], template_kwargs, strict=False)
        content = msg.get("content") or ""
        start = len(prev_text)
        if cur is not None and cur.startswith(prev_text) and text.startswith(cur):
            end = len(cur)
        else:  # the content's first occurrence from `pos` (find's -1: not found, stay at `pos`)
            start = max(text.find(content, pos), pos)
            end = start + len(content)
        if msg.get("role") == "assistant":
            with_header = _render(tokenizer, messages[:k], template_kwargs, gen=True, strict=False)
            if with_header is not None and text.startswith(with_header) and start <= len(with_header) <= end:
                body_start = len(with_header)
            else:
                body_start = max(text.find(content, start, end), start)
            bodies[k] = (body_start, body_start + len(text[body_start:end].rstrip()))
        prev_text, pos = (cur if cur is not None else text[:end]), end
    return bodies


def _assistant_steps(
    text: str, body_start: int, body_end: int, index: int, call_ids: list, open_tag: str, close_tag: str
) -> list[dict[str, Any]]:
    """The steps of one assistant turn ``text[body_start:body_end]``: tool-call blocks, fenced code blocks (outside
    tool calls) and the text between them. Tool calls get the structured call ids in order, and their tool name."""
    body = text[body_start:body_end]
    blocks = [(a, b, "tool_call") for a, b in find_tool_call_spans(body, open_tag, close_tag)]
    blocks += [
        (m.start(), m.end(), "code")
        for m in _CODE_FENCE.finditer(body)
        if not any(a <= m.start() < b for a, b, _ in blocks)
    ]
    steps: list[dict[str, Any]] = []
    cursor = 0
    for a, b, kind in sorted(blocks):
        if a > cursor:
            steps.append(_step(body_start + cursor, body_start + a, "text", message_index=index))
        step = _step(body_start + a, body_start + b, kind, message_index=index)
        if kind == "tool_call":
            step["metadata"]["tool_call_id"] = call_ids.pop(0) if call_ids else None
            try:
                step["metadata"]["tool_name"] = parse_tool_call(body[a:b], open_tag, close_tag).name
            except ValueError:
                step["metadata"]["tool_name"] = None
        steps.append(step)
        cursor = b
    if cursor < len(body):
        steps.append(_step(body_start + cursor, body_end, "text", message_index=index))
    return steps


def _attach_outcome(
    pending: list[dict[str, Any]], msg: Mapping[str, Any], index: int, code_tools: Sequence[str], infer: bool
) -> None:
    """Record a tool reply's outcome on the call it answers (by ``tool_call_id``, else the oldest unanswered one)."""
    call_id = msg.get("tool_call_id")
    target = next(
        (s for s in pending if call_id is not None and s["metadata"].get("tool_call_id") == call_id), pending[0]
    )
    pending.remove(target)
    status = msg.get("exec_status", msg.get("status"))
    is_code = target["type"] == "code" or target["metadata"].get("tool_name") in code_tools
    if status is None and infer and is_code:
        status = classify_exec_output(str(msg.get("content") or ""))
    if status is not None:
        target["metadata"]["exec_status"] = str(status)
    target["metadata"]["result_message_index"] = index


def _step(start: int, end: int, kind: str, **metadata: Any) -> dict[str, Any]:
    return {"start": start, "end": end, "unit": "char", "type": kind, "metadata": dict(metadata)}
