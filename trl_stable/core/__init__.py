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

Every public name of these modules (their `__all__`) is importable from `trl_stable.core`, as asyncio does it.
"""

from trl_stable.core import (
    advantages,
    behaviour_weights,
    estimators,
    gae,
    kl,
    masked_stats,
    normalization,
    policy_loss,
    positions,
    score_scaling,
    token_rewards,
    value_loss,
)
from trl_stable.core.advantages import *  # noqa: F403
from trl_stable.core.behaviour_weights import *  # noqa: F403
from trl_stable.core.estimators import *  # noqa: F403
from trl_stable.core.gae import *  # noqa: F403
from trl_stable.core.kl import *  # noqa: F403
from trl_stable.core.masked_stats import *  # noqa: F403
from trl_stable.core.normalization import *  # noqa: F403
from trl_stable.core.policy_loss import *  # noqa: F403
from trl_stable.core.positions import *  # noqa: F403
from trl_stable.core.score_scaling import *  # noqa: F403
from trl_stable.core.token_rewards import *  # noqa: F403
from trl_stable.core.value_loss import *  # noqa: F403

# `+=` of each module's `__all__`: the form static checkers (pyright, mypy) read
__all__: list[str] = []
__all__ += advantages.__all__
__all__ += behaviour_weights.__all__
__all__ += estimators.__all__
__all__ += gae.__all__
__all__ += kl.__all__
__all__ += masked_stats.__all__
__all__ += normalization.__all__
__all__ += policy_loss.__all__
__all__ += positions.__all__
__all__ += score_scaling.__all__
__all__ += token_rewards.__all__
__all__ += value_loss.__all__
