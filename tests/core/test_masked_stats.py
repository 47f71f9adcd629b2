"""Masked statistics (`trl_stable.core.masked_stats`) against hand values."""

import pytest
import torch

from trl_stable.core.masked_stats import masked_mean, masked_moments


def test_masked_mean_counts_only_the_masked_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0  # an empty mask divides by 1, not 0


def test_masked_moments_over_two_processes_equal_the_joint_batch():
    raw = torch.tensor([-1.0, 1.0, 3.0])
    mean, std = masked_moments(raw.unsqueeze(0), torch.ones(1, 3))
    assert mean.item() == pytest.approx(1.0) and std.item() == pytest.approx((4.0 + 1e-8) ** 0.5)
    # reduce_sum of two equal "processes": the moments of [raw, raw]
    m, s = masked_moments(raw.unsqueeze(0), torch.ones(1, 3), reduce_sum=lambda t: t * 2)
    assert m.item() == pytest.approx(1.0)
    assert s.item() == pytest.approx((torch.cat([raw, raw]).var(unbiased=True) + 1e-8).sqrt().item(), rel=1e-5)
