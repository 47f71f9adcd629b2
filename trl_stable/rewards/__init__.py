"""Reward components: dense (per-token) reward contract, critic rewards, step rewards and arena rewards."""

from trl_stable.rewards.dense import dense_reward, is_dense_reward, validate_dense_rewards

__all__ = ["dense_reward", "is_dense_reward", "validate_dense_rewards"]
