"""Pure-torch math of trl_stable (no TRL import): advantages, normalization, token filters, policy losses, GAE."""

from trl_stable.core.advantages import (  # noqa: F401
    dense_advantages,
    ngrpo_advantages,
    overlong_penalty,
    reward_to_go,
    zero_variance_groups,
)
from trl_stable.core.behaviour_weights import (  # noqa: F401
    behaviour_log_ratio,
    behaviour_weight,
    binary_kl,
    clamp_behaviour_weight,
    filter_behaviour_weight,
    icepop_mask,
    kpop_mask,
)
from trl_stable.core.estimators import (  # noqa: F401
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutputs,
    get_advantage_estimator,
    register_advantage_estimator,
)
from trl_stable.core.gae import compute_gae, compute_turn_gae, relative_position_lambda, vapo_lambda  # noqa: E402,F401
from trl_stable.core.normalization import NORMALIZATION_PRESETS, gdpo_advantages, gdpo_scores, normalize  # noqa: F401
from trl_stable.core.policy_loss import (  # noqa: F401
    decoupled_ppo_loss,
    decoupled_ppo_term,
    fold_behaviour_weight,
    ppo_clip_term,
    pre_mask_token_mean,
)
from trl_stable.core.positions import position_ids_from_mask  # noqa: F401
