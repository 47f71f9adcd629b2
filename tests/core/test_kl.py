"""KL estimators and controllers of `trl_stable.core.kl` against hand values."""

import math

import pytest
import torch

from trl_stable.core.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    full_kl,
    kl_estimate,
    kl_estimator_names,
)

LOGP = torch.tensor([[-1.0, -2.0, -0.1]])
REF = torch.tensor([[-1.5, -1.0, -30.0]])


def _k3(logp, ref):
    r = ref - logp
    return math.exp(r) - r - 1.0


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("kl", [0.5, -1.0, 29.9]),
        ("abs", [0.5, 1.0, 29.9]),
        ("mse", [0.125, 0.5, 0.5 * 29.9**2]),
        ("k3", [_k3(-1.0, -1.5), _k3(-2.0, -1.0), _k3(-0.1, -30.0)]),
        # verl's low_var_kl: the log-ratio -29.9 is clamped to -20, the result to at most 10
        ("low_var_kl", [_k3(-1.0, -1.5), _k3(-2.0, -1.0), min(math.exp(-20.0) + 20.0 - 1.0, 10.0)]),
    ],
)
def test_estimators_hand_values(kind, expected):
    torch.testing.assert_close(kl_estimate(LOGP, REF, kind), torch.tensor([expected]))


def test_k3_is_non_negative_and_zero_on_agreement():
    logp = torch.randn(4, 5)
    assert (kl_estimate(logp, logp + torch.randn(4, 5), "k3") >= 0).all()
    assert kl_estimate(logp, logp, "k3").abs().max() == 0.0
    assert set(KL_ESTIMATORS) == {"kl", "abs", "mse", "k3", "low_var_kl"}
    with pytest.raises(ValueError, match="Unknown KL estimator 'k4'.*register_kl_estimator"):
        kl_estimate(logp, logp, "k4")


def test_valid_kl_penalties_are_the_registry_and_full():
    assert kl_estimator_names() == ("kl", "abs", "mse", "k3", "low_var_kl", "full")


def test_full_kl_matches_a_direct_sum_in_chunks():
    torch.manual_seed(0)
    logits, ref = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    p, q = logits.log_softmax(-1), ref.log_softmax(-1)
    direct = (p.exp() * (p - q)).sum(-1)
    torch.testing.assert_close(full_kl(logits, ref, chunk_size=2), direct)
    # a hand case: two tokens, p = (1/2, 1/2), q = (e/(1+e), 1/(1+e))
    two = full_kl(torch.zeros(1, 1, 2), torch.tensor([[[1.0, 0.0]]]))
    q1 = math.e / (1 + math.e)
    assert two.item() == pytest.approx(0.5 * math.log(0.5 / q1) + 0.5 * math.log(0.5 / (1 - q1)), rel=1e-6)


def test_controllers():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=3.0, n_steps=500)  # error clipped to -0.2
    assert ctl.value == pytest.approx(0.2 * (1 - 0.2 * 500 / 10000))
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 10)
    assert fixed.value == 0.3
