"""trl_stable: stable RL for language models on top of HuggingFace TRL.

Drop-in for TRL: ``from trl_stable import GRPOTrainer, GRPOConfig`` behaves exactly like ``from trl import ...``
until a trl_stable option is switched on.
"""

__version__ = "0.1.0"

try:
    import trl as _trl
except ImportError as err:  # pragma: no cover - the dependency is declared in setup.cfg
    raise ImportError("trl_stable needs TRL. Fix: pip install 'trl>=1.16.0,<1.17'") from err

from trl_stable.integration.version import check_trl_version

check_trl_version(_trl.__version__)

# The SFT trainer costs nothing extra: the GRPO trainer's step masks already import trl_stable.masking.
from trl_stable.masking.sft import StepMaskedSFTConfig, StepMaskedSFTTrainer  # noqa: E402
from trl_stable.trainers.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_stable.trainers.ppo import PPOConfig, PPOTrainer  # noqa: E402

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "PPOConfig",
    "PPOTrainer",
    "StepMaskedSFTConfig",
    "StepMaskedSFTTrainer",
    "__version__",
]
