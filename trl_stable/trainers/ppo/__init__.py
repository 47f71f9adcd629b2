"""trl_stable's PPOTrainer (a value model, per-token rewards) and its config."""

from trl_stable.trainers.ppo.ppo_config import PPOConfig
from trl_stable.trainers.ppo.ppo_trainer import (
    AdaptiveKLController,
    FixedKLController,
    LengthSampler,
    PPOTrainer,
    Rollout,
    RunningMoments,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "LengthSampler",
    "PPOConfig",
    "PPOTrainer",
    "Rollout",
    "RunningMoments",
]
