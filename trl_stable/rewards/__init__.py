"""Reward components: dense (per-token) reward contract, critic rewards, step rewards and arena rewards."""

from trl_stable.rewards.arena import (
    ArenaResult,
    ArenaReward,
    LLMJudge,
    gar_rewards,
    parse_verdict,
    run_arena,
    run_arenas,
)
from trl_stable.rewards.critic_backends import (
    CriticBackend,
    CriticJob,
    LexiconCritic,
    OpenAICritic,
    TransformersCritic,
)
from trl_stable.rewards.critic_parsing import ParsedCritique, parse_critic_answer
from trl_stable.rewards.dense import (
    RewardContractError,
    RewardTypeError,
    dense_reward,
    is_dense_reward,
    validate_dense_rewards,
)
from trl_stable.rewards.intrinsic import (
    CriticFailureError,
    CriticIntrinsicReward,
    CriticRewardConfig,
    build_critic_backend,
    make_intrinsic_reward,
    scale_intrinsic_rewards,
)
from trl_stable.rewards.span_alignment import locate_span, span_token_rewards, token_char_offsets
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
    "CriticBackend",
    "CriticFailureError",
    "CriticIntrinsicReward",
    "CriticJob",
    "CriticRewardConfig",
    "LexiconCritic",
    "OpenAICritic",
    "ParsedCritique",
    "TransformersCritic",
    "build_critic_backend",
    "locate_span",
    "make_intrinsic_reward",
    "parse_critic_answer",
    "scale_intrinsic_rewards",
    "span_token_rewards",
    "token_char_offsets",
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
