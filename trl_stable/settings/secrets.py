"""Secrets out of everything a run writes: one rule for which fields hold secrets ([`is_secret_name`]), applied by
every writer (run_args.json: [`redact`]; the command line: [`redact_argv`]; pickles, logs and tracker configs:
[`SecretsNotPickled`]), and `*_env` fields that refuse a key typed where a variable's name belongs
([`check_env_fields`]). Which channel does what: docs/research_reproductions.md, "Secrets".
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import Any

REDACTED = "<redacted>"

_SECRET_SUFFIXES = ("_token", "_key", "_secret", "_password", "_passwd", "_credentials", "_apikey")
_SECRET_NAMES = frozenset({
    "token", "key", "secret", "password", "passwd", "credentials", "api_key", "apikey", "auth", "authorization",
    "bearer", "cookie", "perspective_api",  # perspective_api: RELC's flag for the Perspective API key
})  # fmt: skip
_SECRET_PARTS = ("password", "secret", "api_key", "apikey", "authorization", "credential", "access_token")
# Named like secrets, hold none: tokenizer special tokens, and fields that point at a secret (a variable's name, a
# file) rather than hold it.
_NOT_SECRET = frozenset({f"{kind}_token" for kind in ("pad", "eos", "bos", "unk", "sep", "cls", "mask")})
_POINTER_SUFFIXES = ("_env", "_file", "_path", "_dir", "_id", "_ids", "_name")

_URL_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")
_QUERY_SECRET = re.compile(
    r"([?&](?:api[_-]?key|key|token|access_token|secret|password|auth|sig|signature)=)[^&#\s]+", re.IGNORECASE
)
# Placeholders transformers' TrainingArguments.to_dict already puts in place of `*_token` fields ("<HUB_TOKEN>")
_PLACEHOLDER = re.compile(r"<[A-Z_]+>|" + re.escape(REDACTED))


def _normalize(name: str) -> str:
    """`--grpo.hub-token` -> `hub_token`: the last dotted part, lowercase, dashes as underscores."""
    return str(name).lstrip("-").rsplit(".", 1)[-1].lower().replace("-", "_")


def is_secret_name(name: str) -> bool:
    """Whether a field, mapping key or flag called `name` holds a secret (the rule docs/research_reproductions.md,
    "Secrets", spells out): not special-token fields such as `pad_token`, nor fields that point at one (`*_env`, ...).

    Example:
        >>> [is_secret_name(n) for n in ("hub_token", "--grpo.hub_token", "pad_token", "critic_api_key_env")]
        [True, True, False, False]
    """
    name = _normalize(name)
    if name in _NOT_SECRET or name.endswith(_POINTER_SUFFIXES):
        return False
    return name in _SECRET_NAMES or name.endswith(_SECRET_SUFFIXES) or any(part in name for part in _SECRET_PARTS)


def redact_text(text: str) -> str:
    """`text` without URL credentials (``scheme://user:key@host`` -> ``scheme://host``) and with secret query
    parameters (``?api_key=...``, ``&token=...``) replaced by `REDACTED`."""
    text = _URL_USERINFO.sub(r"\1", text)
    return _QUERY_SECRET.sub(lambda m: m.group(1) + REDACTED, text)


def _hidden(name: str, value: Any) -> bool:
    """Whether field `name`'s value is replaced: a secret that is set, or a key typed where a variable's name belongs
    (the configs refuse that; belt and braces, for one typed after the config was built)."""
    if is_secret_name(name):  # an unset one (None, "", a placeholder) is shown: the reader learns none was given
        return value is not None and value != "" and not (isinstance(value, str) and _PLACEHOLDER.fullmatch(value))
    return _normalize(name).endswith("_env") and isinstance(value, str) and value != "" and not is_env_var_name(value)


def redact(value: Any, replacement: Any = REDACTED) -> Any:
    """`value` as plain data (a dataclass becomes a dict of its fields; mappings, lists and tuples are copied) with
    every secret-named field or key (`is_secret_name`) that is set replaced by `replacement`, and every string
    cleaned by `redact_text`. Anything else is returned as it is.

    Example:
        >>> redact({"hub_token": "hf_abc", "model_init_kwargs": {"token": "x"}, "url": "https://u:p@host/v1"})
        {'hub_token': '<redacted>', 'model_init_kwargs': {'token': '<redacted>'}, 'url': 'https://host/v1'}
    """
    if is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, Mapping):
        return {key: replacement if _hidden(str(key), v) else redact(v, replacement) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(item, replacement) for item in value) if type(value) in (list, tuple) else value
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_argv(argv: list[str]) -> list[str]:
    """Replace, in place, the values of secret flags (`--hub_token X`, `--grpo.hub_token=X`, `--perspective_api X`)
    and URL credentials in a command line; returns `argv`. Call it once the command line is parsed: trackers such
    as wandb record `sys.argv` with the run."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and is_secret_name(name):
            if eq:
                argv[i] = f"{name}={REDACTED}"
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                argv[i + 1] = REDACTED
        elif isinstance(arg, str):
            argv[i] = redact_text(arg)
    return argv


class Secret:
    """Holds a key; prints as '***' so it cannot leak through repr, logs or saved configs, and refuses to pickle."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("A key is not picklable; pass the name of the environment variable that holds it instead.")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Prefixes of API keys and tokens (OpenAI, Stripe, Hugging Face, Groq, Fireworks, Replicate, xAI, Perplexity, NVIDIA,
# Cerebras, GitHub, GitLab, Slack, Google), with or without a separator; AWS access key ids are AKIA/ASIA and 16
# upper-case letters or digits.
_KEY_PREFIX = re.compile(
    r"(?:sk|pk|rk|hf|gsk|fw|r8|xai|pplx|nvapi|csk|ghp|gho|ghu|ghs|ghr|github_pat|glpat|xox[abprs]|AIza|ya29)"
    r"[-_.]?(?P<rest>.*)",
    re.DOTALL,
)
_AWS_KEY_ID = re.compile(r"(?:AKIA|ASIA)[A-Z0-9]{16}")


def _digit_switches(text: str) -> int:
    """Adjacent letter/digit pairs (``a1`` or ``1a``): a name has a few (``GPT4``, ``V2``), a random key many."""
    return sum(a.isdigit() != b.isdigit() for a, b in zip(text, text[1:]) if a.isalnum() and b.isalnum())


def _case_switches(text: str) -> int:
    return sum(a.isupper() != b.isupper() for a, b in zip(text, text[1:]) if a.isalpha() and b.isalpha())


def looks_like_secret(value: str) -> bool:
    """Whether `value`, given where an environment variable's name belongs, looks like a key instead: names are made
    of words and short numbers (``OPENAI_API_KEY``, ``MY_CRITIC_KEY_2``, ``CriticKey``), keys are long random strings
    whatever their provider's prefix and case (the rules: docs/research_reproductions.md, "Secrets").

    Example:
        >>> [looks_like_secret(v) for v in ("OPENAI_API_KEY", "gsk_" + "aB3" * 10, "r8_" + "x7Q" * 10, "fw_3Zk9Xq2")]
        [False, True, True, True]
    """
    value = str(value)
    if _AWS_KEY_ID.fullmatch(value):
        return True
    prefixed = _KEY_PREFIX.match(value)
    if prefixed and len(re.sub(r"[\W_]", "", prefixed["rest"])) >= 8 and _digit_switches(prefixed["rest"]) >= 2:
        return True
    parts = [p for p in re.split(r"[\W_]+", value) if p]
    if sum(_digit_switches(p) for p in parts) >= 6:
        return True
    for part in parts:
        mixed = re.search(r"\d", part) and re.search(r"[A-Za-z]", part)
        if len(part) >= 24 or (len(part) >= 16 and (mixed or _case_switches(part) >= len(part) // 2)):
            return True
    return False


def is_env_var_name(value: Any) -> bool:
    """Whether `value` can be an environment variable's name: an identifier that does not look like a key."""
    return isinstance(value, str) and _ENV_NAME.fullmatch(value) is not None and not looks_like_secret(value)


def check_env_var_name(field_name: str, value: Any, example: str = "OPENAI_API_KEY") -> None:
    """Raise ValueError unless `value` is an environment variable's name that does not look like a key. The message
    names `field_name` and never repeats `value` (it may be the key itself, and errors end up in logs)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field_name} must name an environment variable holding the key, e.g. {example!r}.")
    if is_env_var_name(value):
        return
    what = (
        "looks like a key (a variable really named so needs a name like MY_API_KEY)"
        if _ENV_NAME.fullmatch(value) is not None
        else "is not a valid environment variable name (letters, digits and underscores, not starting with a digit)"
    )
    raise ValueError(
        f"{field_name} takes the NAME of the environment variable that holds the key, not the key itself; the value "
        f"given {what} and is not shown here. Put the key in an environment variable (export {example}=...) and "
        f"pass its name: {field_name}={example!r}."
    )


def _scrub(name: str, value: Any, replacement: Any) -> Any:
    """`value` with secrets replaced (`_hidden`), keeping its type (a pickled config must load back as the same
    objects): plain dicts are copied with their secret keys replaced, strings cleaned, anything else kept."""
    if _hidden(name, value):
        return replacement
    if isinstance(value, dict) and type(value) is dict:
        return {key: _scrub(str(key), item, replacement) for key, item in value.items()}
    if isinstance(value, str):
        return redact_text(value)
    return value


def check_env_fields(config: Any) -> None:
    """`check_env_var_name` on every ``*_env`` field of a dataclass config that is set (one rule for every trl_stable
    config: such a field names an environment variable, and a key typed there is refused without being shown)."""
    for f in fields(config):
        value = getattr(config, f.name, None)
        if f.name.endswith("_env") and value is not None:
            check_env_var_name(f.name, value)


class SecretsNotPickled:
    """Mixin for configs (dataclasses; for `TrainingArguments` subclasses put it first among the bases).

    - Pickling leaves its secret fields (`hub_token`, `token` in `model_init_kwargs`, URL credentials, see
      [`is_secret_name`]) unset (None): transformers' `Trainer` saves `torch.save(self.args)` as
      `training_args.bin` next to the weights and in every checkpoint and uploads it with `push_to_hub`, and a loaded
      `training_args.bin` then falls back to the environment's credentials. `copy.copy` / `copy.deepcopy` keep them.
    - `repr`, `str` and `to_dict` (what the logs and the tracker configs show) redact them. The `__repr__` is set on
      every subclass as it is created, before `@dataclass` runs, which then keeps it instead of writing its own.
    - `__post_init__` refuses a key typed into any ``*_env`` field (`check_env_fields`), then runs the next base's.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__repr__" not in cls.__dict__:
            cls.__repr__ = SecretsNotPickled.__repr__

    def __post_init__(self) -> None:
        check_env_fields(self)
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()

    def __getstate__(self) -> dict[str, Any]:
        return {name: _scrub(name, value, None) for name, value in self.__dict__.items()}

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict[int, Any]):
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        return new

    def to_dict(self) -> dict[str, Any]:
        parent = getattr(super(), "to_dict", None)
        values = parent() if parent is not None else asdict(self)
        return {name: _scrub(name, value, REDACTED) for name, value in values.items()}

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={_scrub(f.name, getattr(self, f.name, None), REDACTED)!r}" for f in fields(self) if f.repr
        )
        return f"{type(self).__name__}({shown})"

    def __str__(self) -> str:
        # TrainingArguments.__str__'s layout; it hides `*_token` fields only, not a token inside a dict or a URL
        shown = sorted((f.name, _scrub(f.name, getattr(self, f.name, None), REDACTED)) for f in fields(self))
        return f"{type(self).__name__}(\n{''.join(f'{name}={value},{chr(10)}' for name, value in shown)})"
