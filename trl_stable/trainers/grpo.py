"""trl_stable's GRPOTrainer: TRL's GRPOTrainer plus the stability options of trl_stable.

With every trl_stable option at its default the trainer is TRL's own, step for step: each override calls
``super()`` and only post-processes when an option asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import trl


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """Configuration for [`GRPOTrainer`]: every field of `trl.GRPOConfig`, plus trl_stable's options."""


class GRPOTrainer(trl.GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer`.

    Args:
        Same as `trl.GRPOTrainer`; `args` may be a `trl_stable.GRPOConfig` (a plain `trl.GRPOConfig` works too).
    """

    _tag_names = ["trl", "grpo", "trl_stable"]
