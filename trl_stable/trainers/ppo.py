"""PPO with a value model and per-token rewards (placeholder until the PPO trainer lands)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PPOConfig:
    """Placeholder: the PPO trainer of trl_stable is not implemented yet."""

    def __post_init__(self):
        raise NotImplementedError(
            "trl_stable.PPOConfig is not implemented yet in this release; use trl_stable.GRPOConfig for now."
        )


class PPOTrainer:
    """Placeholder: the PPO trainer of trl_stable is not implemented yet."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "trl_stable.PPOTrainer is not implemented yet in this release; use trl_stable.GRPOTrainer for now."
        )
