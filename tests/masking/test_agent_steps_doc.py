"""The runnable examples of the agent-step documentation page run as written (tiny kit, CPU)."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "agent_steps.md"


def _section() -> str:
    # The whole page is the agent-step documentation (it was the README's "Agent-step quality" section).
    return DOC.read_text(encoding="utf-8")


def _blocks() -> list[str]:
    blocks = re.findall(r"^(`{3,})python\n(.*?)^\1$", _section(), re.S | re.M)
    # Skipped: config fragments with "..." and the LLM-judge example (it needs an API key).
    return [code for _, code in blocks if "(..." not in code and "OpenAICritic(" not in code]


def test_section_has_runnable_examples():
    assert len(_blocks()) >= 3


@pytest.mark.parametrize("code", _blocks())
def test_doc_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_example__"})
