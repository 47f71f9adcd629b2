"""Critic prompt templates: the bundled few-shot files, reading a template, and filling its placeholders."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

# The templates are package data (setup.cfg: ``trl_stable = prompts/*.txt``), so a non-editable install finds them;
# the repository's top-level ``prompts/critic_*.txt`` are links to these files, for ``--prompt_file prompts/...``.
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "prompts"
_PLACEHOLDER_RE = re.compile(r"\{\}|\{prompt\}|\{completion\}|\{score\}")


def default_prompt_file(task: str) -> str:
    """Path of the bundled few-shot template of `task` (``trl_stable/prompts/critic_<task>.txt``, package data)."""
    return str(PROMPTS_DIR / f"critic_{task}.txt")


def load_critic_template(path: str | os.PathLike) -> str:
    """Read a critic template and check that it has a ``{}`` (or ``{completion}``) placeholder for the text."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"prompt_file {path!r} does not exist; pass the path of a critic template with a '{{}}'.")
    template = Path(path).read_text(encoding="utf-8")
    if "{}" not in template and "{completion}" not in template:
        raise ValueError(f"prompt_file {path!r} has no '{{}}' placeholder for the text to critique; add one.")
    return template


def fill_critic_template(template: str, text: str, prompt: str = "", completion: str = "", score: Any = None) -> str:
    """Fill the placeholders ``{}`` (the text), ``{prompt}``, ``{completion}`` and ``{score}`` of `template`, in one
    pass and literally (few-shot examples may hold braces; a completion holding "{}" is not substituted again)."""
    score_text = "n/a" if score is None else f"{float(score):.4g}"
    pieces = {"{prompt}": prompt, "{completion}": completion, "{score}": score_text, "{}": text}
    return _PLACEHOLDER_RE.sub(lambda m: pieces[m.group(0)], template)
