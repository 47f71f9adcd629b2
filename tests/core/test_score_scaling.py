"""Old TRL's score scaling (`trl_stable.core.score_scaling`) against hand values."""

import torch

from trl_stable.core.score_scaling import RunningMoments, scale_scores


def test_scale_scores_running_std_norm_and_clip():
    running = RunningMoments()
    running.update(torch.tensor([1.0, 3.0]))  # mean 2, unbiased std sqrt(2)
    scores = torch.tensor([1.0, 5.0])
    torch.testing.assert_close(scale_scores(scores, running), scores / (2**0.5 + 1e-8))
    torch.testing.assert_close(scale_scores(scores, running, normalize=True), (scores - 2.0) / (2**0.5 + 1e-8))
    torch.testing.assert_close(scale_scores(scores, None, clip=2.0), torch.tensor([1.0, 2.0]))
