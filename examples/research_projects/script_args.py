"""A script's arguments from `--config FILE` (YAML) and the command line, with RELC's underscore flag names.

Every research script has one argument dataclass; `parse_script_args` fills it from, in order of precedence: the
dataclass defaults, its mode defaults (embedded or paper mode, `mode_defaults`), the YAML file, the command line.
"""

from __future__ import annotations

import sys
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import tyro
import yaml
from relc_flags import warn_ignored_relc_flags

from trl_stable.settings.secrets import redact_argv

T = TypeVar("T")


def parse_script_args(
    cls: type[T],
    argv: Sequence[str] | None = None,
    description: str | None = None,
    file_values: Mapping[str, Any] | None = None,
) -> T:
    """A script's arguments from `--config FILE` (YAML) and the command line, with RELC's underscore flag names.

    Precedence: the dataclass defaults, then its mode defaults, then the YAML file, then the command line. YAML values
    are converted to each field's declared type by the same parser that reads the flags (so `learning_rate: 1e-4`
    is a float, not YAML's string), nested mappings go to nested dataclasses (`ppo_config:`, `grpo:`, ...).

    Args:
        cls: The script's argument dataclass. Defaults that depend on other flags (the embedded or paper mode) come
            from its static method `mode_defaults`, if it has one: `cls.mode_defaults(first)` gives nested field
            values for a second parse, `first` being a parse with `cls.mode_defaults(None)` (defaults loose enough
            for any flags the second parse accepts). Its static method `finalize`, if any, converts the parsed
            arguments once (RELC's length flags). A class attribute `config_algorithm` names the `algorithm:` a
            config file of the algorithm family (`sentiment/configs/*.yaml`) may declare for this script.
        argv: The flags (default `sys.argv[1:]`).
        description: The help text's headline.
        file_values: Values already read from a config file (instead of a `--config` flag).
    """
    from_sys_argv = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file, argv = pop_config_flag(argv)
    values = dict(file_values or {})
    values.update(script_values(cls, read_config(config_file), config_file))
    base = cls()

    def parse(extra: Mapping[str, Any]) -> T:
        default = with_values(with_values(base, extra, "mode defaults"), values, config_file or "config")
        with warnings.catch_warnings():
            # TrainingArguments turns its accelerator_config into an object its own annotation does not name
            warnings.filterwarnings("ignore", message=".*AcceleratorConfig.*does not match", category=UserWarning)
            return tyro.cli(cls, args=argv, use_underscores=True, description=description, default=default)

    mode_defaults = getattr(cls, "mode_defaults", None)
    if mode_defaults is None or "-h" in argv or "--help" in argv:
        args = parse({})
    else:
        args = parse(mode_defaults(parse(mode_defaults(None))))
        # RELC flags whose meaning differs from the field they map onto (a length range) are converted once, here
        finalize = getattr(cls, "finalize", None)
        args = finalize(args) if finalize is not None else args
        warn_ignored_relc_flags(args)
    if from_sys_argv:  # parsed: trackers (wandb) record sys.argv with the run, so its secrets go now
        redact_argv(sys.argv)
    return args


def script_values(cls: type, values: dict[str, Any], source: str | None) -> dict[str, Any]:
    """A config file's values for `cls`: the family's files name their `algorithm:`, which a script without that
    field accepts when it is the one the script runs (`cls.config_algorithm`) and refuses otherwise."""
    if "algorithm" not in values or "algorithm" in {f.name for f in fields(cls)}:
        return values
    values = dict(values)
    algorithm, runs = values.pop("algorithm"), getattr(cls, "config_algorithm", None)
    if algorithm != runs:
        raise ValueError(
            f"{source}: algorithm {algorithm!r} is not what this script runs ({runs!r}); run "
            "examples/research_projects/sentiment/grpo_intrinsic.py with it."
        )
    return values


def pop_config_flag(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the file of `--config FILE` or `--config=FILE`, the other flags)."""
    rest, config = [], None
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name == "--config":
            config = value if eq else next(args, None)
            if not config:
                raise ValueError("--config needs a YAML file.")
        else:
            rest.append(arg)
    return config, rest


def read_config(path: str | None) -> dict[str, Any]:
    """The mapping of a YAML config file ({} for None)."""
    if path is None:
        return {}
    if not Path(path).is_file():
        raise ValueError(f"--config {path!r} does not exist.")
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file is a mapping of field names to values.")
    return data


def with_values(instance: T, values: Mapping[str, Any], source: str = "config") -> T:
    """`instance` with `values` (nested mappings for nested dataclasses), each converted to its field's type."""
    if not values:
        return instance
    hints = typing.get_type_hints(type(instance))
    names = {f.name for f in fields(instance) if f.init}
    changes = {}
    for name, value in values.items():
        if name not in names:
            raise ValueError(f"{source}: {type(instance).__name__} has no field {name!r}.")
        current = getattr(instance, name)
        if is_dataclass(current) and isinstance(value, Mapping):
            changes[name] = with_values(current, value, source)
        else:
            changes[name] = typed_value(hints[name], value)
    return replace(instance, **changes)


def typed_value(hint: Any, value: Any) -> Any:
    """`value` read as a command-line value of type `hint` (tyro's conversion; YAML reads `1e-4` as a string)."""
    if isinstance(value, Mapping):  # dict fields (generation_kwargs, ...) have no command-line form to go through
        return dict(value)
    if isinstance(value, str) and str in (typing.get_args(hint) or (hint,)):
        return value  # a string field takes the text as it is (tyro would read "-x" as a flag)
    tokens = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return tyro.cli(hint, args=tokens)
