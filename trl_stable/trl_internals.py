"""Deprecated location, kept only until the modules below import from `trl_stable.integration`; to be deleted then.

The registry of TRL / transformers members is `trl_stable.integration.trl_members`; the generic helpers are in
`trl_stable.integration` (`patching`, `reward_calls`, `hf_names`); what reads `trl.GRPOTrainer`'s own state is in
`trl_stable.trainers.grpo` (`trl_logs`, `trl_batch`, `trl_rewards`, `forward_passes`). Still imported from here by
`trl_stable/masking/sft.py` and `trl_stable/trainers/ppo/` (`ppo_trainer.py`, `plumbing.py`, `rewards.py`,
`vllm.py`).
"""

from trl_stable.integration.hf_names import model_name_of
from trl_stable.integration.patching import wrapped_method
from trl_stable.integration.reward_calls import call_reward_func, reward_event_loop

__all__ = ["call_reward_func", "model_name_of", "reward_event_loop", "wrapped_method"]
