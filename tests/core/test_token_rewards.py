"""PPO's per-token reward (`trl_stable.core.token_rewards`) against hand values."""

import torch

from trl_stable.core.token_rewards import compose_token_rewards, last_action_index


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


def test_last_action_index():
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert last_action_index(mask).tolist() == [3, 0, 0]
