import math

import pytest
import torch

from trl_stable.core import (
    behaviour_weight,
    binary_kl,
    clamp_behaviour_weight,
    filter_behaviour_weight,
    icepop_mask,
    kpop_mask,
)

LN = math.log


def lp(*ws):
    """log-probs pairs giving the listed ratios w = prox / behav, with behav = log 0.1."""
    behav = torch.full((len(ws),), LN(0.1))
    prox = behav + torch.log(torch.tensor(ws))
    return prox.view(1, -1), behav.view(1, -1)


def test_behaviour_weight_values_nonfinite_and_mask():
    prox = torch.tensor([[LN(0.2), float("nan"), float("-inf"), LN(0.5)]])
    behav = torch.tensor([[LN(0.1), LN(0.1), LN(0.1), LN(0.1)]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = behaviour_weight(prox, behav, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 1.0, 1.0]]))
    assert w.dtype == torch.float32 and not w.requires_grad


def test_icepop_token_band_is_inclusive():
    prox, behav = lp(0.5, 0.49, 1.0, 5.0, 5.1, 2.0)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    keep = icepop_mask(prox, behav, mask, lower=0.5, upper=5.0)
    assert keep.tolist() == [[True, False, True, True, False, False]]


def test_icepop_nonfinite_log_ratio_counts_as_zero():
    # Non-finite log-ratios are set to 0 (see trl_stable/core/behaviour_weights.py), so w = 1: kept by a band around
    # 1, dropped by a band above 1
    behav = torch.tensor([[LN(0.1), LN(0.1), float("-inf"), LN(0.1)]])
    prox = torch.tensor([[float("nan"), float("-inf"), LN(0.1), LN(0.8)]])  # last: w = 8, out of band
    mask = torch.ones(1, 4)
    assert icepop_mask(prox, behav, mask).tolist() == [[True, True, True, False]]
    assert icepop_mask(prox, behav, mask, lower=2.0, upper=10.0).tolist() == [[False, False, False, True]]
    # sequence level: log-ratios 0, 0, 0, ln 8 -> geometric mean 8 ** (1 / 4) ~ 1.68: in [0.5, 5], not in [0.5, 1.5]
    assert icepop_mask(prox, behav, mask, level="sequence").all()
    assert not icepop_mask(prox, behav, mask, upper=1.5, level="sequence").any()
    # clamp: w = 1 for the non-finite tokens, 8 -> 5
    w = clamp_behaviour_weight(prox, behav, mask, lower=0.5, upper=5.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0, 5.0]]))
    # sequence clamp: w_seq = 8 ** 0.25 clamped to 1.5 -> every token scaled by 1.5 / 8 ** 0.25
    w = clamp_behaviour_weight(prox, behav, mask, upper=1.5, level="sequence")
    scale = 1.5 / 8**0.25
    torch.testing.assert_close(w, torch.tensor([[scale, scale, scale, 8 * scale]]))


def test_icepop_sequence_level_geometric_mean_and_fully_masked_row():
    # row 0: ratios 4 and 0.25 -> geometric mean 1 -> kept although 0.25 is out of band token-wise
    # row 1: ratios 8 and 1 -> geometric mean sqrt(8) ~ 2.83 -> kept with upper 5, dropped with upper 2
    # row 2: fully masked
    behav = torch.full((3, 2), LN(0.01))
    prox = behav + torch.log(torch.tensor([[4.0, 0.25], [8.0, 1.0], [1.0, 1.0]]))
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    keep = icepop_mask(prox, behav, mask, level="sequence")
    assert keep.tolist() == [[True, True], [True, True], [False, False]]
    keep = icepop_mask(prox, behav, mask, upper=2.0, level="sequence")
    assert keep.tolist() == [[True, True], [False, False], [False, False]]
    keep = icepop_mask(prox, behav, mask, level="token")
    assert keep.tolist() == [[True, False], [False, True], [False, False]]


@pytest.mark.parametrize("lower, upper", [(0.5, 0.5), (2.0, 1.0), (0.0, 5.0), (-1.0, 5.0)])
def test_icepop_bad_bounds(lower, upper):
    with pytest.raises(ValueError, match="lower"):
        icepop_mask(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), lower=lower, upper=upper)


def test_binary_kl_hand_value():
    p, q = torch.tensor(0.5), torch.tensor(0.25)
    expected = 0.5 * LN(0.5 / 0.25) + 0.5 * LN(0.5 / 0.75)
    torch.testing.assert_close(binary_kl(p, q), torch.tensor(expected))


def test_kpop_token():
    # p=0.9 vs q=0.1: KL_B = 0.8*ln 9 = 1.7578 both ways -> kept at 2.0, dropped at 1.5
    # p=0.99 vs q=0.01: KL_B = 0.98*ln 99 = 4.503 -> dropped
    prox = torch.log(torch.tensor([[0.9, 0.99, 0.3]]))
    behav = torch.log(torch.tensor([[0.1, 0.01, 0.3]]))
    mask = torch.ones(1, 3)
    assert kpop_mask(prox, behav, mask).tolist() == [[True, False, True]]
    assert kpop_mask(prox, behav, mask, upper=1.5).tolist() == [[False, False, True]]
    torch.testing.assert_close(binary_kl(torch.tensor(0.9), torch.tensor(0.1)), torch.tensor(0.8 * LN(9)))


def test_kpop_clamps_probabilities_and_nonfinite():
    # prox -inf -> p clamped to 1e-8; q = 0.5 -> KL_B(q||p) = 0.5 ln(0.5/1e-8) + 0.5 ln(0.5/(1-1e-8)) ~ 8.52
    prox = torch.tensor([[float("-inf"), float("nan"), 0.0]])
    behav = torch.log(torch.tensor([[0.5, 0.5, 1.0]]))
    keep = kpop_mask(prox, behav, torch.tensor([[1, 1, 1]]), upper=8.0)
    assert keep.tolist() == [[False, True, True]]
    keep = kpop_mask(prox, behav, torch.tensor([[1, 1, 1]]), upper=9.0)
    assert keep.tolist() == [[True, True, True]]


def test_kpop_sequence_and_masked():
    prox = torch.log(torch.tensor([[0.9, 0.5], [0.5, 0.5]]))
    behav = torch.log(torch.tensor([[0.1, 0.5], [0.5, 0.5]]))
    mask = torch.tensor([[1, 1], [0, 0]])
    # row 0 mean KL = 1.7578 / 2 = 0.88 -> kept at upper 1.0 though its first token alone would not be
    keep = kpop_mask(prox, behav, mask, upper=1.0, level="sequence")
    assert keep.tolist() == [[True, True], [False, False]]
    assert kpop_mask(prox, behav, mask, upper=1.0).tolist() == [[False, True], [False, False]]
    with pytest.raises(ValueError, match="upper"):
        kpop_mask(prox, behav, mask, upper=0.0)
    with pytest.raises(ValueError, match="level"):
        kpop_mask(prox, behav, mask, level="batch")


def test_clamp_token_and_sequence():
    prox, behav = lp(0.1, 1.0, 10.0)
    mask = torch.tensor([[1, 1, 1]])
    w = clamp_behaviour_weight(prox, behav, mask, lower=0.5, upper=5.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 5.0]]))
    # sequence: ratios 8, 8 -> w_seq = 8 -> clamp to 5 -> every token scaled by 5/8
    prox, behav = lp(8.0, 8.0, 3.0)
    w = clamp_behaviour_weight(prox, behav, torch.tensor([[1, 1, 0]]), upper=5.0, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[5.0, 5.0, 1.0]]))
    prox, behav = lp(4.0, 1.0)  # w_seq = 2, in band: unchanged
    w = clamp_behaviour_weight(prox, behav, torch.ones(1, 2), level="sequence")
    torch.testing.assert_close(w, torch.tensor([[4.0, 1.0]]))


def test_kpop_takes_the_larger_direction():
    # p = 0.5, q = 0.01: KL_B(p||q) = 0.5 ln 50 + 0.5 ln(0.5/0.99) ~ 1.614 ; KL_B(q||p) = 0.01 ln 0.02 + 0.99 ln 1.98
    # ~ 0.637. With upper 1.0 only the larger direction drops the token, whichever side is the trainer's.
    forward = 0.5 * LN(50) + 0.5 * LN(0.5 / 0.99)
    backward = 0.01 * LN(0.02) + 0.99 * LN(0.99 / 0.5)
    torch.testing.assert_close(binary_kl(torch.tensor(0.5), torch.tensor(0.01)), torch.tensor(forward))
    torch.testing.assert_close(binary_kl(torch.tensor(0.01), torch.tensor(0.5)), torch.tensor(backward))
    assert backward < 1.0 < forward
    a, b = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.01]]))
    assert kpop_mask(a, b, torch.ones(1, 1), upper=1.0).tolist() == [[False]]
    assert kpop_mask(b, a, torch.ones(1, 1), upper=1.0).tolist() == [[False]]
    assert kpop_mask(a, b, torch.ones(1, 1), upper=1.7).tolist() == [[True]]


def test_filter_behaviour_weight_picks_the_filter():
    prox, behav = lp(0.4, 1.0, 6.0)
    mask = torch.tensor([[1, 1, 1]])
    w, keep = filter_behaviour_weight(prox, behav, mask, None)
    torch.testing.assert_close(w, torch.tensor([[0.4, 1.0, 6.0]]))
    assert keep is None
    w, keep = filter_behaviour_weight(prox, behav, mask, "icepop", "mask", 0.5, 5.0)
    torch.testing.assert_close(w, torch.tensor([[0.4, 1.0, 6.0]]))
    assert keep.tolist() == [[False, True, False]]
    w, keep = filter_behaviour_weight(prox, behav, mask, "icepop", "clamp", 0.5, 5.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 5.0]]))
    assert keep is None
    # prox 0.6 vs behav 0.1: max binary KL = 0.6 ln 6 + 0.4 ln(0.4 / 0.9) ~ 0.751 > 0.5; 0.04 vs 0.1: ~ 0.034
    w, keep = filter_behaviour_weight(prox, behav, mask, "kpop", upper=0.5)
    assert keep.tolist() == [[True, True, False]]
    with pytest.raises(ValueError, match="kind"):
        filter_behaviour_weight(prox, behav, mask, "tis")
