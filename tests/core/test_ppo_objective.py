"""PPO's per-token reward, score scaling and turn counting (`trl_stable.core`) against hand values."""

import threading

import pytest
import torch

from trl_stable.core.gae import count_turns
from trl_stable.core.ppo_objective import (
    RunningMoments,
    compose_token_rewards,
    gdpo_scores,
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


def test_gdpo_scores_hand_values():
    # column 0: valid [1, 3] -> mean 2, unbiased std sqrt(2); column 1: [10, 30, 20] -> mean 20, std 10
    nan = float("nan")
    rewards = torch.tensor([[1.0, 10.0], [3.0, 30.0], [nan, 20.0], [nan, nan]])
    scores = gdpo_scores(rewards, [1.0, 0.5], eps=0.0)
    half = 2**-0.5
    torch.testing.assert_close(scores[:3], torch.tensor([-half - 0.5, half + 0.5, 0.0]))
    assert torch.isnan(scores[3])  # no reward applies: stays NaN (the trainer drops the sample)
    # eps enters the denominator of every column
    with_eps = gdpo_scores(rewards[:2], eps=1.0)
    # [1, 3]: std sqrt(2); [10, 30]: std sqrt(200); 1 / (sqrt(2) + 1) + 10 / (sqrt(200) + 1) = 1.074627
    torch.testing.assert_close(with_eps, torch.tensor([-1.074627, 1.074627]))


def test_gdpo_scores_rescaling_one_reward_changes_nothing():
    # the point of normalising before the sum: a reward's unit (x1000) no longer decides the score
    rewards = torch.tensor([[0.0, 1.0], [1.0, 3.0], [1.0, 2.0], [0.0, 5.0]])
    scaled = rewards * torch.tensor([1000.0, 1.0])
    torch.testing.assert_close(gdpo_scores(rewards, eps=0.0), gdpo_scores(scaled, eps=0.0))


def test_gdpo_scores_one_valid_sample_gets_zero_and_bad_weights_raise():
    nan = float("nan")
    torch.testing.assert_close(gdpo_scores(torch.tensor([[4.0], [nan]]))[:1], torch.tensor([0.0]))
    with pytest.raises(ValueError, match="one weight per reward function"):
        gdpo_scores(torch.ones(3, 2), [1.0])


def test_gdpo_scores_over_two_processes_equal_the_global_batch():
    # a fake all-reduce between two threads: each "process" holds half the batch
    nan = float("nan")
    rewards = torch.tensor([[1.0, 10.0], [3.0, 30.0], [nan, 20.0], [5.0, 0.0]])
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def run(rank):
        def reduce_sum(t):
            slots[rank] = t
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read before the next call overwrites the slots
            return total

        out[rank] = gdpo_scores(rewards[2 * rank : 2 * rank + 2], [2.0, 1.0], reduce_sum=reduce_sum)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat(out), gdpo_scores(rewards, [2.0, 1.0]))
