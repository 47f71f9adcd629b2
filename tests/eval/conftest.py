import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The evaluation scripts import their helpers (eval_utils) and the shared scorers (examples/research_projects) by name.
for path in (REPO / "examples" / "research_projects", REPO / "eval_scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session", autouse=True)
def embedded_cache(tmp_path_factory):
    """Any embedded policy an evaluation builds goes to a per-session cache, never to the user's ~/.cache."""
    old = os.environ.get("TRL_STABLE_CACHE")
    os.environ["TRL_STABLE_CACHE"] = str(tmp_path_factory.mktemp("embedded_cache"))
    yield
    if old is None:
        os.environ.pop("TRL_STABLE_CACHE", None)
    else:
        os.environ["TRL_STABLE_CACHE"] = old
