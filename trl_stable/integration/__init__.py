"""How trl_stable stands on TRL and transformers: the registry of every private member it uses and piece of logic it
mirrors (`trl_members`, `mirrored`), and the generic helpers; docs/development.md, "TRL internals", has the table.
Nothing here imports another trl_stable package but this one.
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
