r"""The math of trl_stable: pure torch, no TRL import; each function carries its formula and its paper.

| module | what |
|---|---|
| `normalization` | the mean/std family of GRPO, Dr.GRPO, LitePPO, RLOO (`normalize`) and GDPO's per-reward form |
| `advantages` | NGRPO, DAPO's overlong penalty and dynamic-sampling test, dense reward-to-go |
| `estimators` | the advantage-estimator registry both trainers select from |
| `gae` | GAE over tokens and turns, per-sequence lambda schedules |
| `kl` | the KL-estimator registry and the KL-coefficient controllers |
| `behaviour_weights` | the decoupled loss's behaviour weight and its IcePop / KPop filters |
| `policy_loss` | the clipped and decoupled PPO terms and their normalisation |
| `token_rewards` | PPO's per-token reward (KL penalty, dense rewards, score) |
| `value_loss` | PPO's clipped value loss |
| `masked_stats` | masked mean, moments and whitening, over every process if asked |
| `score_scaling` | running moments of PPO's scores and old TRL's score scaling |
| `positions` | position ids of padded rows, as the samplers number them |

Every public name of these modules is importable from `trl_stable.core`.
"""

from trl_stable.core.advantages import (
    dense_advantages,
    ngrpo_advantages,
    overlong_penalty,
    reward_to_go,
    zero_variance_groups,
)
from trl_stable.core.behaviour_weights import (
    behaviour_log_ratio,
    behaviour_weight,
    binary_kl,
    clamp_behaviour_weight,
    filter_behaviour_weight,
    icepop_mask,
    kpop_mask,
)
from trl_stable.core.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageOutputs,
    dr_grpo_estimator,
    gae_estimator,
    gdpo_estimator,
    get_advantage_estimator,
    grpo_estimator,
    is_sequence_level,
    liteppo_estimator,
    ngrpo_estimator,
    register_advantage_estimator,
    rloo_estimator,
    turn_gae_estimator,
)
from trl_stable.core.gae import (
    compute_gae,
    compute_turn_gae,
    count_turns,
    relative_position_lambda,
    vapo_lambda,
)
from trl_stable.core.kl import (
    FULL_KL,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    full_kl,
    kl_abs,
    kl_estimate,
    kl_estimator_names,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_low_var,
    register_kl_estimator,
)
from trl_stable.core.masked_stats import (
    Reduce,
    masked_mean,
    masked_moments,
    masked_whiten,
)
from trl_stable.core.normalization import (
    NORMALIZATION_LEVELS,
    NORMALIZATION_PRESETS,
    gdpo_advantages,
    gdpo_scores,
    normalize,
)
from trl_stable.core.policy_loss import (
    LOG_RATIO_BOUND,
    decoupled_ppo_loss,
    decoupled_ppo_term,
    fold_behaviour_weight,
    policy_clip_fraction,
    ppo_clip_term,
    pre_mask_token_mean,
)
from trl_stable.core.positions import (
    position_ids_from_mask,
)
from trl_stable.core.score_scaling import (
    RunningMoments,
    scale_scores,
)
from trl_stable.core.token_rewards import (
    TokenRewards,
    compose_token_rewards,
    last_action_index,
)
from trl_stable.core.value_loss import (
    clipped_value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageOutputs",
    "FULL_KL",
    "FixedKLController",
    "KLEstimator",
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "NORMALIZATION_LEVELS",
    "NORMALIZATION_PRESETS",
    "Reduce",
    "RunningMoments",
    "TokenRewards",
    "behaviour_log_ratio",
    "behaviour_weight",
    "binary_kl",
    "clamp_behaviour_weight",
    "clipped_value_loss",
    "compose_token_rewards",
    "compute_gae",
    "compute_turn_gae",
    "count_turns",
    "decoupled_ppo_loss",
    "decoupled_ppo_term",
    "dense_advantages",
    "dr_grpo_estimator",
    "filter_behaviour_weight",
    "fold_behaviour_weight",
    "full_kl",
    "gae_estimator",
    "gdpo_advantages",
    "gdpo_estimator",
    "gdpo_scores",
    "get_advantage_estimator",
    "grpo_estimator",
    "icepop_mask",
    "is_sequence_level",
    "kl_abs",
    "kl_estimate",
    "kl_estimator_names",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_low_var",
    "kpop_mask",
    "last_action_index",
    "liteppo_estimator",
    "masked_mean",
    "masked_moments",
    "masked_whiten",
    "ngrpo_advantages",
    "ngrpo_estimator",
    "normalize",
    "overlong_penalty",
    "policy_clip_fraction",
    "position_ids_from_mask",
    "ppo_clip_term",
    "pre_mask_token_mean",
    "register_advantage_estimator",
    "register_kl_estimator",
    "relative_position_lambda",
    "reward_to_go",
    "rloo_estimator",
    "scale_scores",
    "turn_gae_estimator",
    "vapo_lambda",
    "zero_variance_groups",
]
