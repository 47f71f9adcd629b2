"""Version gate for the TRL release whose trainer hooks trl_stable builds on."""

from __future__ import annotations

import re

SUPPORTED_TRL = ((1, 16), (1, 17))  # [lower, upper): the GRPOTrainer hooks we override change between minors
SUPPORTED_TRL_RANGE = "trl>=1.16.0,<1.17"


def check_trl_version(version: str) -> None:
    """Raise ImportError unless `version` lies in the supported TRL range.

    trl_stable overrides GRPOTrainer internals (`_generate_and_score_completions`, `_compute_loss`, ...)
    whose signatures move between TRL minor releases, so an unchecked version would fail far from the cause.
    """
    lower, upper = SUPPORTED_TRL
    if not (lower <= tuple(int(part) for part in re.findall(r"\d+", version)[:2]) < upper):
        raise ImportError(
            f"trl_stable supports {SUPPORTED_TRL_RANGE}, but trl {version} is installed. "
            f"Fix: pip install '{SUPPORTED_TRL_RANGE}'"
        )
