from trl_stable.trainers.grpo import GRPOConfig, GRPOTrainer
from trl_stable.trainers.ppo import PPOConfig, PPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "PPOConfig", "PPOTrainer"]
