import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "research_projects"
EVAL_SCRIPTS = REPO / "eval_scripts"
for path in (EXAMPLES, EVAL_SCRIPTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session", autouse=True)
def embedded_cache(tmp_path_factory):
    """Warmed-up embedded policies go to a per-session cache, never to the user's ~/.cache."""
    path = tmp_path_factory.mktemp("embedded_cache")
    old = os.environ.get("TRL_STABLE_CACHE")
    os.environ["TRL_STABLE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TRL_STABLE_CACHE", None)
    else:
        os.environ["TRL_STABLE_CACHE"] = old


@pytest.fixture(scope="session")
def load_script():
    """Import an example script by path under a unique name (two scripts are called ppo_intrinsic.py)."""

    def load(relative: str, name: str):
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, EXAMPLES / relative)
            sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[name])
        return sys.modules[name]

    return load
