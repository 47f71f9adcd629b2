import os
import sys
from pathlib import Path

# No hub at test time: every model and tokenizer comes from trl_stable.testing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The helpers every test folder shares (tiny configs, the two-process launcher), imported by module name.
HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny models: threading costs more than it gives, and CI runs xdist workers


@pytest.fixture(scope="session")
def tokenizer():
    from trl_stable.testing import build_tokenizer

    return build_tokenizer()


def pytest_collection_finish(session):
    """Freeze the objects of the imported libraries out of the garbage collector's reach: `transformers.Trainer`
    calls `gc.collect()` at every `train()` (accelerate's `free_memory`), which otherwise walks all of torch's,
    transformers' and TRL's objects each time (a quarter second a tiny run). Later objects are collected as before."""
    import gc

    gc.freeze()
