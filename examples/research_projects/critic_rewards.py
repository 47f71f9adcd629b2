"""The scripts' dense critic reward (`trl_stable.rewards.CriticIntrinsicReward`) and its per-token rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from relc_flags import relc_toxicity_values


def build_intrinsic_reward(config, task: str, tokenizer, backend=None):
    """The dense critic reward a `CriticRewardConfig` asks for, for `task`, or None when it is off. `backend`
    replaces the backend the config names."""
    if not config.use_intrinsic_reward:
        return None
    from trl_stable.rewards import CriticIntrinsicReward
    from trl_stable.settings.checks import field_default

    if config.critic_task not in (field_default(config, "critic_task"), task):
        raise ValueError(f"--critic_task {config.critic_task}: this script's task is {task}; leave the flag out.")
    config = replace(config, critic_task=task)
    if task == "toxicity" and config.positive_reward_value != 0.0:
        config = relc_toxicity_values(config)
    return CriticIntrinsicReward(config, tokenizer, backend=backend)


def critic_token_rewards(critic, prompts: Sequence[str], completions: Sequence[str], responses, env_scores):
    """Per-token intrinsic rewards of `responses` (1-D token tensors): the critic's, or zeros without a critic and
    for the samples it did not critique (environment reward above the threshold, failed request)."""
    rewards = [[0.0] * len(r) for r in responses]
    if critic is None:
        return rewards
    rows = critic(
        prompts=list(prompts),
        completions=list(completions),
        completion_ids=[r.tolist() for r in responses],
        env_rewards=list(env_scores),
    )
    for sample, row in zip(rewards, rows):
        if row is not None:
            sample[:] = [float(v) for v in row]
    return rewards
