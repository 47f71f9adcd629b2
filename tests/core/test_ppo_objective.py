"""PPO's per-token reward, score scaling and turn counting (`trl_stable.core`) against hand values."""

import pytest
import torch

from trl_stable.core.gae import count_turns
from trl_stable.core.ppo_objective import (
    RunningMoments,
    compose_token_rewards,
    last_action_index,
    masked_moments,
    scale_scores,
)


def test_compose_token_rewards_hand_values():
    kl = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    dense = torch.tensor([[0.5, 0.0, 0.0], [0.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = compose_token_rewards(kl, 0.1, dense, torch.tensor([10.0, 20.0]), mask)
    expected = torch.tensor([[0.5 - 0.1, -0.2, -0.3 + 10.0], [-0.4, 1.0 - 0.5 + 20.0, 0.0]])
    torch.testing.assert_close(out.rewards, expected)
    torch.testing.assert_close(out.kl_part + out.env_part, out.rewards)
    torch.testing.assert_close(out.env_part, torch.tensor([[0.5, 0.0, 10.0], [0.0, 21.0, 0.0]]))


def test_whitened_rewards_keep_the_mean_and_the_parts_add_up():
    kl = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = compose_token_rewards(kl, 1.0, torch.zeros(2, 2), torch.tensor([3.0, 6.0]), mask, whiten=True)
    raw = torch.tensor([-1.0, -2.0 + 3.0, -3.0 + 6.0])  # the three action tokens before whitening
    mean, std = raw.mean(), (raw.var(unbiased=True) + 1e-8).sqrt()
    torch.testing.assert_close(out.rewards[mask.bool()], (raw - mean) / std + mean)
    torch.testing.assert_close(out.kl_part[mask.bool()], torch.tensor([-1.0, -2.0, -3.0]) / std)
    torch.testing.assert_close(out.kl_part + out.env_part, out.rewards)
    m, s = masked_moments(raw.unsqueeze(0), torch.ones(1, 3), reduce_sum=lambda t: t * 2)  # two equal "processes"
    assert m.item() == pytest.approx(mean.item()) and s.item() == pytest.approx(
        (torch.cat([raw, raw]).var(unbiased=True) + 1e-8).sqrt().item(), rel=1e-5
    )


def test_last_action_index_and_count_turns():
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert last_action_index(mask).tolist() == [3, 0, 0]
    turns = torch.tensor([[0, 0, -1, 1, 1, 2], [-1, 0, -1, 0, -1, -1], [-1, -1, -1, -1, -1, -1]])
    assert count_turns(turns).tolist() == [3, 1, 0]


def test_scale_scores_running_std_norm_and_clip():
    running = RunningMoments()
    running.update(torch.tensor([1.0, 3.0]))  # mean 2, unbiased std sqrt(2)
    scores = torch.tensor([1.0, 5.0])
    torch.testing.assert_close(scale_scores(scores, running), scores / (2**0.5 + 1e-8))
    torch.testing.assert_close(scale_scores(scores, running, normalize=True), (scores - 2.0) / (2**0.5 + 1e-8))
    torch.testing.assert_close(scale_scores(scores, None, clip=2.0), torch.tensor([1.0, 2.0]))
