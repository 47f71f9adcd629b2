"""Reward components: dense (per-token) reward contract, critic rewards, step rewards and arena rewards."""

from trl_stable.rewards import critic
from trl_stable.rewards.arena import (
    ArenaResult,
    ArenaReward,
    LLMJudge,
    gar_rewards,
    parse_verdict,
    run_arena,
    run_arenas,
)
from trl_stable.rewards.critic import *  # noqa: F403 - the critic's public names (critic.__all__), re-exported
from trl_stable.rewards.dense import (
    RewardContractError,
    RewardTypeError,
    dense_reward,
    is_dense_reward,
    validate_dense_rewards,
)
from trl_stable.rewards.step_rewards import (
    PenaltyRule,
    StepReward,
    StepRewardWeights,
    invalid_call_penalty,
    parse_agent_step,
    tool_overuse_penalty,
)

__all__ = [
    "RewardContractError",
    "RewardTypeError",
    "dense_reward",
    "is_dense_reward",
    "validate_dense_rewards",
    # critic intrinsic rewards (Drlc / RELC)
    *critic.__all__,
    # agent-step rewards and group arena rewards (GAR)
    "ArenaResult",
    "ArenaReward",
    "LLMJudge",
    "PenaltyRule",
    "StepReward",
    "StepRewardWeights",
    "gar_rewards",
    "invalid_call_penalty",
    "parse_agent_step",
    "parse_verdict",
    "run_arena",
    "run_arenas",
    "tool_overuse_penalty",
]
