"""Dense rewards from an LLM critic (Drlc / RELC, Cao et al., EMNLP 2024), one module per concept."""

from trl_stable.rewards.critic.alignment import (
    SpanAlignment,
    align_span,
    align_spans,
    locate_span,
    rewards_from_alignments,
    span_token_rewards,
    token_char_offsets,
)
from trl_stable.rewards.critic.backend import CriticBackend
from trl_stable.rewards.critic.config import CriticBackendConfig, CriticRewardConfig
from trl_stable.rewards.critic.counters import CriticCounters
from trl_stable.rewards.critic.factory import build_critic_backend
from trl_stable.rewards.critic.jobs import CriticJob
from trl_stable.rewards.critic.lexicon import LexiconCritic
from trl_stable.rewards.critic.local import TransformersCritic
from trl_stable.rewards.critic.openai_critic import OpenAICritic
from trl_stable.rewards.critic.parsing import ParsedCritique, continuation_header, parse_critic_answer
from trl_stable.rewards.critic.reward import (
    CriticFailureError,
    CriticIntrinsicReward,
    make_intrinsic_reward,
    scale_intrinsic_rewards,
)

__all__ = [
    "CriticBackend",
    "CriticBackendConfig",
    "CriticCounters",
    "CriticFailureError",
    "CriticIntrinsicReward",
    "CriticJob",
    "CriticRewardConfig",
    "LexiconCritic",
    "OpenAICritic",
    "ParsedCritique",
    "SpanAlignment",
    "TransformersCritic",
    "align_span",
    "align_spans",
    "build_critic_backend",
    "continuation_header",
    "locate_span",
    "make_intrinsic_reward",
    "parse_critic_answer",
    "rewards_from_alignments",
    "scale_intrinsic_rewards",
    "span_token_rewards",
    "token_char_offsets",
]
