"""The documentation holds together: relative links resolve, the README's feature table and quick start are intact,
and nothing cites documents that are not in the repository."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOC_FILES = [README, *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").rglob("README.md"))]
QUICK_START = [
    "python examples/research_projects/sentiment/ppo_intrinsic.py --use_intrinsic_reward",
    'python -m pytest -m "not slow" -n 2',
]
FORBIDDEN = [
    ("docs/sections", re.compile(r"docs/sections", re.I)),
    ("SPEC.md", re.compile(r"\bSPEC\.md\b", re.I)),
    ("SPEC <section>", re.compile(r"\bSPEC\b")),  # upper case only: "spec" is an ordinary word in code
    ("handbook", re.compile(r"handbook", re.I)),
]
SCANNED = ["trl_stable", "tests", "examples", "eval_scripts", "benchmarks", "docs", "README.md"]

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fence = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            continue
        if fence is None:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text only, lower case, punctuation dropped (not `_`), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    links = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
        links += _LINK.findall(line)
    return links


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # no scheme: http:, https:, mailto:, ...


def _all_links():
    return [
        pytest.param(path, target, id=f"{path.relative_to(REPO)}->{target}")
        for path in DOC_FILES
        for target in _links(path)
        if _relative(target)
    ]


def test_docs_have_links():
    assert len(DOC_FILES) > 5 and len(_all_links()) > 20


@pytest.mark.parametrize("path, target", _all_links())
def test_relative_link_resolves(path, target):
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    assert dest.exists(), f"{path.relative_to(REPO)}: link to missing {file_part}"
    assert REPO in dest.parents or dest == REPO, f"{path.relative_to(REPO)}: link leaves the repository: {target}"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{path.relative_to(REPO)}: no heading #{anchor} in {dest.relative_to(REPO)}"


def _feature_rows() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Features")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else None]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| feature")]


def test_readme_feature_table_links_one_docs_page_per_feature():
    rows = _feature_rows()
    assert len(rows) >= 10
    pages = []
    for row in rows:
        links = [t for t in _LINK.findall(row) if t.startswith("docs/")]
        assert len(links) == 1, f"feature row without exactly one docs/ page: {row}"
        assert (REPO / links[0].partition("#")[0]).is_file(), links[0]
        pages.append(links[0])
    assert len(set(pages)) == len(pages), "two features share a page"


def test_readme_quick_start_commands_verbatim():
    text = README.read_text(encoding="utf-8")
    start = text.index("## Quick start")
    section = text[start : text.index("\n## ", start + 1)]
    for command in QUICK_START:
        assert command in section, command


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--", *SCANNED], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def _tracked_lines():
    """(file, line number, line) of every tracked text file but this one (which names the patterns it forbids)."""
    for name in _tracked_files():
        if name == "tests/test_docs.py":
            continue
        try:
            text = (REPO / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (the dashboard PNG)
        for number, line in enumerate(text.splitlines(), 1):
            yield name, number, line


def test_no_references_to_documents_outside_the_repo():
    offenders = []
    for name, number, line in _tracked_lines():
        for label, pattern in FORBIDDEN:
            if pattern.search(line):
                offenders.append(f"{name}:{number}: {label}: {line.strip()[:100]}")
    assert not offenders, "cites documents that are not in the repository:\n" + "\n".join(offenders)


_REPO_PATH = re.compile(r"(?<![\w/.~$-])((?:docs|examples|benchmarks|eval_scripts|prompts)/[\w./<>*{}-]*[\w>*}/])")


def test_repo_paths_in_code_and_docs_exist():
    """A path such as `docs/agent_steps.md` or `benchmarks/bench_critic.py` named in a docstring, comment or page
    exists (placeholders such as `prompts/critic_<task>.txt` are skipped)."""
    missing = []
    for name, number, line in _tracked_lines():
        for path in _REPO_PATH.findall(line):
            if not any(c in path for c in "<>*{}") and not (REPO / path.rstrip("/.")).exists():
                missing.append(f"{name}:{number}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
