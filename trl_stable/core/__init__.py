"""The math of trl_stable: pure torch, no TRL import; each function carries its formula and its paper (the modules:
docs/development.md). Every public name of these modules (their `__all__`) is importable from `trl_stable.core`, as
asyncio does it.
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
