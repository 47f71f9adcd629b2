"""`trl_stable.core` is pure torch, exports every public name of its modules, and the names the docs cite exist."""

import ast
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

import pytest

import trl_stable.core as core

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "trl_stable" / "core"
MODULES = sorted(m.name for m in pkgutil.iter_modules(core.__path__))
# What the math may import: the standard library, torch, and itself.
ALLOWED_ROOTS = {"torch"} | set(sys.stdlib_module_names)
# Documentation and the package's own docstrings and comments; the changelog keeps the old names on purpose.
CITING = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "trl_stable").rglob("*.py"))]
# `trl_stable.core.X.Y`, and a bare `core.X` (not `trl.core.X`: old TRL's module)
_DOTTED = re.compile(r"trl_stable\.core((?:\.[A-Za-z_]\w*)+)|(?<![\w.])core((?:\.[A-Za-z_]\w*)+)")


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_imports_only_torch_the_standard_library_and_itself(path):
    bad = [
        name
        for name in _imports(path)
        if name.split(".")[0] not in ALLOWED_ROOTS
        and not (name == "trl_stable.core" or name.startswith("trl_stable.core."))
    ]
    assert not bad, f"{path.name} imports {bad}: trl_stable.core is pure torch (no TRL, transformers or trainer code)"


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_is_exported_from_trl_stable_core(name):
    module = importlib.import_module(f"trl_stable.core.{name}")
    defined = {
        attr
        for attr, obj in vars(module).items()
        if not attr.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    }
    assert defined <= set(module.__all__), f"public but not in {name}.__all__: {sorted(defined - set(module.__all__))}"
    for attr in module.__all__:
        assert attr in core.__all__, f"{name}.{attr} is not in trl_stable.core.__all__"
        assert getattr(core, attr) is getattr(module, attr)


def test_core_all_is_exactly_the_modules_public_names():
    from_modules = [attr for name in MODULES for attr in importlib.import_module(f"trl_stable.core.{name}").__all__]
    assert sorted(core.__all__) == sorted(from_modules)
    assert len(set(core.__all__)) == len(core.__all__)


def test_public_functions_and_classes_have_docstrings():
    missing = [
        f"{obj.__module__}.{attr}"
        for attr in core.__all__
        if (inspect.isfunction(obj := getattr(core, attr)) or inspect.isclass(obj)) and not inspect.getdoc(obj)
    ]
    assert not missing


def _resolve(dotted: str):
    obj = core
    for part in dotted.split("."):
        if not hasattr(obj, part) and inspect.ismodule(obj):
            importlib.import_module(f"{obj.__name__}.{part}")  # a submodule not imported yet
        obj = getattr(obj, part)
    return obj


def _citations():
    found = {}
    for path in CITING:
        text = path.read_text(encoding="utf-8")
        for match in _DOTTED.finditer(text):
            found.setdefault((match.group(1) or match.group(2)).lstrip("."), path.relative_to(REPO))
    return sorted(found.items())


def test_the_docs_cite_core_names():
    cited = dict(_citations())
    assert {"gdpo_scores", "register_kl_estimator", "estimators"} <= set(cited)  # the scan finds citations


@pytest.mark.parametrize("dotted, where", _citations(), ids=[c[0] for c in _citations()])
def test_every_cited_core_name_exists(dotted, where):
    try:
        _resolve(dotted)
    except (AttributeError, ModuleNotFoundError):
        pytest.fail(f"{where} cites trl_stable.core.{dotted}, which does not exist")
