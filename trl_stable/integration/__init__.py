"""How trl_stable stands on TRL and transformers.

- `trl_members` and `mirrored`: the registry, data only: every private TRL / transformers member trl_stable
  overrides, calls, reads or patches ([`Member`]), and every piece of TRL logic it mirrors or relies on
  ([`Mirrored`]), each checked against the installed versions by `tests/integration/test_trl_members.py`.
- `patching`: [`wrapped_method`], a method replaced on one instance for the duration of a call.
- `reward_calls`: calling a reward function as TRL does ([`call_reward_func`], [`reward_event_loop`]).
- `hf_names`: names transformers gives things ([`model_name_of`], [`rng_state_file`]).
- `version`: the version gate, one clear ImportError at import time for a TRL release trl_stable does not support.

What reads or writes `trl.GRPOTrainer`'s own state lives with the GRPO trainer (`trl_stable.trainers.grpo`), PPO's
with PPO. Nothing here imports another trl_stable package but this one.
"""

from trl_stable.integration.hf_names import model_name_of, rng_state_file
from trl_stable.integration.mirrored import MIRRORED, Mirrored
from trl_stable.integration.patching import wrapped_method
from trl_stable.integration.reward_calls import call_reward_func, reward_event_loop
from trl_stable.integration.trl_members import Member

__all__ = [
    "MIRRORED",
    "Member",
    "Mirrored",
    "call_reward_func",
    "model_name_of",
    "reward_event_loop",
    "rng_state_file",
    "wrapped_method",
]
