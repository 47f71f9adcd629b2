"""trl_stable's PPOTrainer (a value model, per-token rewards) and its config."""

from trl_stable.core.kl import AdaptiveKLController, FixedKLController
from trl_stable.core.score_scaling import RunningMoments
from trl_stable.trainers.ppo.ppo_config import PPOConfig
from trl_stable.trainers.ppo.ppo_trainer import PPOTrainer
from trl_stable.trainers.ppo.rollout import LengthSampler, Rollout

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "LengthSampler",
    "PPOConfig",
    "PPOTrainer",
    "Rollout",
    "RunningMoments",
]
