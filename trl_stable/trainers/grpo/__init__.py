"""trl_stable's GRPOTrainer (TRL's, plus the stability options) and its config."""

from trl_stable.trainers.grpo.grpo_config import GRPOConfig
from trl_stable.trainers.grpo.grpo_trainer import GRPOTrainer, RolloutRecord

__all__ = ["GRPOConfig", "GRPOTrainer", "RolloutRecord"]
