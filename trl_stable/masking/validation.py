"""Step validation: whether one step of an agent trace may train (docs/agent_steps.md). A step is invalid when it is
a tool call that is not JSON (``invalid_json``), names an unknown tool (``unknown_tool``) or passes arguments its
signature refuses (``bad_arguments``), or a code step that crashed, timed out or ran out of memory (``exec_crash`` /
``exec_timeout`` / ``exec_oom``). Plain functions over text and dicts, so SFT, GRPO and PPO share them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOOL_CALL_TYPES = ("tool_call", "function_call", "action")
CODE_TYPES = ("code", "code_exec", "code_execution")
FAILED_EXEC_STATUSES = ("crash", "timeout", "oom")
# Spellings environments use for the three failures; any other status (e.g. "ok", "success") trains.
EXEC_STATUS_ALIASES = {
    "error": "crash", "exception": "crash", "failed": "crash", "failure": "crash", "segfault": "crash",
    "timed_out": "timeout", "time_out": "timeout", "deadline_exceeded": "timeout",
    "out_of_memory": "oom", "memory_error": "oom", "oomkilled": "oom",
}  # fmt: skip

# Keys under which the tool-call formats in the wild (OpenAI, Hermes/Qwen, flat tool/args) put the name and arguments.
NAME_KEYS = ("name", "tool", "tool_name", "function")
ARGUMENT_KEYS = ("arguments", "args", "parameters", "tool_input", "input")

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                             "boolean": (bool,), "array": (list, tuple), "object": (dict,),
                                             "null": (type(None),)}  # fmt: skip
_SHORTHAND_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
                    "dict": "object", "none": "null"}  # fmt: skip


@dataclass
class ParsedToolCall:
    """A tool call read from text: `name` and `arguments` (a dict)."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepVerdict:
    """Whether a step may train, and why not: `reason` is "ok" or one of the failure kinds of this module."""

    valid: bool
    reason: str = "ok"
    detail: str = ""


OK = StepVerdict(True)


def _reject_constant(name: str) -> None:
    """`json.loads`'s NaN / Infinity / -Infinity refused: Python accepts them, JSON (and tool servers) do not."""
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)


def parse_tool_call(text: str, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> ParsedToolCall:
    """Parse one tool call from `text` (the JSON object, optionally inside tags or a code fence): OpenAI / Hermes
    ``{"name", "arguments"}``, flat ``{"tool", "args"}`` or OpenAI's ``{"function": {"name", "arguments": "<json>"}}``
    (string arguments decoded). ValueError when the payload or its arguments are not a JSON object."""
    payload = text.strip()  # the tags and a Markdown code fence around the JSON payload stripped
    if open_tag and payload.startswith(open_tag):
        payload = payload[len(open_tag) :].rstrip().removesuffix(close_tag)
    fence = re.fullmatch(r"```[A-Za-z0-9_-]*\s*\n?(.*?)\n?```", payload.strip(), flags=re.DOTALL)
    payload = fence.group(1).strip() if fence else payload.strip()
    try:
        obj = json.loads(payload, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise ValueError(f"tool call is not valid JSON: {err.msg} at position {err.pos}") from err
    if not isinstance(obj, dict):
        raise ValueError(f"tool call must be a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("function"), dict):  # OpenAI message format nests the call
        obj = obj["function"]
    name = next((obj[k] for k in NAME_KEYS if k in obj), None)
    arguments: Any = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=_reject_constant) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"tool-call arguments are not valid JSON: {err.msg}") from err
    arguments = {} if arguments is None else arguments
    if not isinstance(arguments, dict):
        raise ValueError(f"tool-call arguments must be a JSON object, got {type(arguments).__name__}")
    return ParsedToolCall(name=name if isinstance(name, str) else None, arguments=arguments)


def load_tools(value: Any) -> Any:
    """Tools given as a JSON string or a JSON file's path decoded, checked (`normalize_signatures`) and returned as
    given, so a config refuses a bad tool list when it is built; ValueError for an unreadable string, tools that are
    no list of names / specs or ``{name: signature}`` dict, or a spec without a name."""
    if isinstance(value, str):
        try:
            value = json.loads(Path(value).read_text(encoding="utf-8") if os.path.isfile(value) else value)
        except (json.JSONDecodeError, OSError) as err:
            raise ValueError(
                f"Tools given as a string must be JSON or the path of a JSON file ({err}). Pass a list of tool names, "
                "a {name: signature} dict, or a path to a JSON file."
            ) from err
    if value is not None and (isinstance(value, str) or not isinstance(value, (Mapping, Sequence))):
        raise ValueError(
            f"Tools must be a list of tool names or specs, a {{name: signature}} dict, a JSON string or the path of a "
            f"JSON file; got {type(value).__name__} {value!r:.120}."
        )
    if isinstance(value, Mapping) and (value.get("type") == "function" or isinstance(value.get("name"), str)):
        raise ValueError(f"{value!r:.120} is one tool spec; pass a list of specs ([spec]).")
    normalize_signatures(value)  # raises on a spec without a name or a signature that is not a dict
    return value


def normalize_signatures(tools: Mapping[str, Any] | Sequence[Any] | None) -> dict[str, dict[str, Any] | None]:
    """``{name: parameters schema or None}`` from a list of names (no argument check), a ``{name: schema}`` dict, or a
    list of OpenAI tool specs or ``{"name", "parameters"}`` dicts; a schema is JSON-schema-like or the shorthand
    ``{"city": "string", "days": "integer"}`` (every listed argument required)."""
    if tools is None:
        return {}
    if isinstance(tools, Mapping):
        return {str(name): _normalize_schema(schema) for name, schema in tools.items()}
    out: dict[str, dict[str, Any] | None] = {}
    for tool in tools:
        if isinstance(tool, str):
            out[tool] = None
        elif isinstance(tool, Mapping):
            spec = tool.get("function", tool) if isinstance(tool.get("function"), Mapping) else tool
            if not isinstance(spec.get("name"), str) or not spec["name"]:
                raise ValueError(f"A tool spec needs a non-empty 'name'; got {dict(spec)!r:.120}.")
            out[str(spec["name"])] = _normalize_schema(spec.get("parameters"))
        else:
            raise ValueError(f"A tool must be a name or a spec dict, got {type(tool).__name__}.")
    return out


def _normalize_schema(schema: Any) -> dict[str, Any] | None:
    if schema is None:
        return None
    if not isinstance(schema, Mapping):
        raise ValueError(f"A tool signature must be a dict (JSON schema or {{arg: type}}), got {schema!r}.")
    if "type" in schema or "properties" in schema:
        return dict(schema)
    # Shorthand {arg: "type"}: every listed argument is required, no others allowed.
    properties = {
        arg: (_normalize_schema(spec) if isinstance(spec, Mapping) else {"type": _type_name(spec)})
        for arg, spec in schema.items()
    }
    return {"type": "object", "properties": properties, "required": list(schema), "additionalProperties": False}


def _type_name(spec: Any) -> str | list[str]:
    if isinstance(spec, type):
        spec = spec.__name__
    if isinstance(spec, (list, tuple)):
        return [_type_name(s) for s in spec]  # type: ignore[misc]
    name = str(spec).lower()
    name = _SHORTHAND_TYPES.get(name, name)
    if name not in _JSON_TYPES:
        raise ValueError(f"Unknown argument type {spec!r}; use one of {', '.join(_JSON_TYPES)}.")
    return name


def schema_errors(value: Any, schema: Mapping[str, Any] | None, path: str = "arguments") -> list[str]:
    """Mismatches between `value` and a JSON-schema-like `schema` (``type``, ``enum``, ``properties``, ``required``,
    ``additionalProperties`` (bool), ``items``); booleans are not integers or numbers (JSON's view, not Python's)."""
    if schema is None:
        return []
    errors: list[str] = []
    expected = schema.get("type")
    if expected is not None:
        names = [expected] if isinstance(expected, str) else list(expected)
        if not any(_is_type(value, _SHORTHAND_TYPES.get(n, n)) for n in names):
            return [f"{path}: expected {'/'.join(names)}, got {type(value).__name__}"]
    if "enum" in schema and not any(_json_equal(value, option) for option in schema["enum"]):
        errors.append(f"{path}: {value!r} not in {schema['enum']!r}")
    if isinstance(value, dict):
        properties = schema.get("properties", {}) or {}
        errors += [f"{path}: missing required {key!r}" for key in schema.get("required") or [] if key not in value]
        for key, item in value.items():
            if key in properties:
                errors.extend(schema_errors(item, properties[key], f"{path}.{key}"))
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path}: unexpected argument {key!r}")
    if isinstance(value, (list, tuple)) and isinstance(schema.get("items"), Mapping):
        for k, item in enumerate(value):
            errors.extend(schema_errors(item, schema["items"], f"{path}[{k}]"))
    return errors


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON sees it: ``true`` is not ``1`` (Python's ``True == 1`` would let a boolean pass an enum)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _is_type(value: Any, name: str) -> bool:
    if name not in _JSON_TYPES:
        return True  # an unknown type keyword constrains nothing (JSON schema semantics)
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES[name])


def validate_tool_call(
    text: str,
    tools: Mapping[str, dict[str, Any] | None] | None = None,
    open_tag: str = "<tool_call>",
    close_tag: str = "</tool_call>",
) -> StepVerdict:
    """Validate one tool call against `tools` (``{name: schema or None}``; None checks only JSON and a name): a name
    outside it is ``unknown_tool``, a schema mismatch ``bad_arguments``."""
    try:
        call = parse_tool_call(text, open_tag, close_tag)
    except ValueError as err:
        return StepVerdict(False, "invalid_json", str(err))
    if call.name is None:
        return StepVerdict(False, "unknown_tool", "tool call has no name")
    if tools is not None:
        if call.name not in tools:
            return StepVerdict(False, "unknown_tool", f"{call.name!r} is not one of {sorted(tools)}")
        errors = schema_errors(call.arguments, tools[call.name])
        if errors:
            return StepVerdict(False, "bad_arguments", "; ".join(errors))
    return OK


def validate_step(
    step: Mapping[str, Any],
    text: str | None = None,
    tools: Mapping[str, dict[str, Any] | None] | Sequence[Any] | None = None,
    open_tag: str = "<tool_call>",
    close_tag: str = "</tool_call>",
) -> StepVerdict:
    """Validate one step dict ``{"start", "end", "type", "metadata"}``.

    Args:
        step: The step; its ``type`` selects the checks (`TOOL_CALL_TYPES`, `CODE_TYPES`; anything else passes). Keys
            read from it or its ``metadata``: ``text`` and ``valid_tools`` / ``tools`` (override the arguments),
            ``exec_status`` / ``status`` (a code step's outcome), ``valid`` (a verdict set upstream).
        text: The step's text (needed for tool calls unless the step carries ``text``).
        tools: Valid tools for tool-call steps (see `normalize_signatures`); None skips the name and argument checks.
    """
    # None values are dropped: a datasets/Arrow round trip fills the keys other rows use with None.
    merged = {**(step.get("metadata") or {}), **step}
    meta = {k: v for k, v in merged.items() if v is not None and k != "metadata"}
    if meta.get("valid") is False:
        return StepVerdict(False, str(meta.get("reason", "marked_invalid")))
    kind = str(meta.get("type", "text"))
    status = str(meta.get("exec_status", meta.get("status", "ok"))).strip().lower().replace("-", "_")
    status = EXEC_STATUS_ALIASES.get(status, status)
    if status in FAILED_EXEC_STATUSES and kind in (*CODE_TYPES, *TOOL_CALL_TYPES):
        return StepVerdict(False, f"exec_{status}", f"code step ended in {status}")
    if kind in TOOL_CALL_TYPES:
        step_tools = meta.get("valid_tools", meta.get("tools", tools))
        step_text = meta.get("text", text)
        if step_text is None:
            raise ValueError("A tool_call step needs its text: pass `text` or put 'text' in the step.")
        signatures = normalize_signatures(step_tools) if step_tools is not None else None
        return validate_tool_call(step_text, signatures, open_tag, close_tag)
    return OK


def find_tool_call_spans(
    text: str, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"
) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the tool-call blocks in `text`, tags included; a block with no closing tag
    runs to the end of the text (a truncated call is still a call, to be validated, not trained on)."""
    pattern = re.escape(open_tag) + "(?s:.*?)(?:" + re.escape(close_tag) + r"|\Z)"
    return [m.span() for m in re.finditer(pattern, text)]
