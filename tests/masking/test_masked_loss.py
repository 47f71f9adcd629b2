"""Masked cross-entropy: matches a hand-written reference, divides by valid tokens, no gradient on masked ones."""

import math

import torch

from trl_stable.masking import masked_cross_entropy


def _reference(logits, labels, mask):
    """Loop-by-loop next-token cross-entropy averaged over the positions whose target has mask 1."""
    total, count = 0.0, 0.0
    for b in range(labels.size(0)):
        for t in range(labels.size(1) - 1):
            target = int(labels[b, t + 1])
            weight = float(mask[b, t + 1])
            if target == -100 or weight == 0:
                continue
            logp = logits[b, t].double().log_softmax(-1)[target].item()
            total += -logp * weight
            count += weight
    return total / max(count, 1.0)


def test_matches_reference_and_divides_by_valid_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    labels = torch.randint(0, 11, (2, 6))
    labels[1, 4:] = -100  # padding
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    loss = masked_cross_entropy(logits, labels, mask)
    assert math.isclose(loss.item(), _reference(logits, labels, mask), rel_tol=1e-5)
    # Valid targets: row 0 -> t=1,4,5 (3); row 1 -> t=1,2,3 (3); so the sum is divided by 6.
    targets = labels[:, 1:].clamp(min=0).reshape(-1)
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), targets, reduction="none")
    per_token = per_token.view(2, 5)
    keep = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float32)
    assert math.isclose(loss.item(), ((per_token * keep).sum() / 6).item(), rel_tol=1e-5)


def test_masked_tokens_get_no_gradient():
    torch.manual_seed(1)
    logits = torch.randn(1, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (1, 5))
    mask = torch.tensor([[1, 1, 0, 0, 1]], dtype=torch.float32)
    masked_cross_entropy(logits, labels, mask).backward()
    # The mask applies to targets: positions 1 and 2 predict the masked targets 2 and 3.
    assert torch.all(logits.grad[0, 1] == 0) and torch.all(logits.grad[0, 2] == 0)
    assert logits.grad[0, 0].abs().sum() > 0 and logits.grad[0, 3].abs().sum() > 0
    assert torch.all(logits.grad[0, 4] == 0)  # the last position predicts nothing


def test_all_masked_is_a_finite_zero_even_with_inf_logits():
    logits = torch.randn(1, 4, 5)
    logits[0, 1] = float("inf")  # a masked position with a non-finite loss must not poison the sum
    logits.requires_grad_(True)
    labels = torch.zeros(1, 4, dtype=torch.long)
    loss = masked_cross_entropy(logits, labels, torch.zeros(1, 4))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(torch.nan_to_num(logits.grad, nan=1.0) == 0)


def test_unshifted_and_bool_mask():
    torch.manual_seed(2)
    logits = torch.randn(1, 3, 4)
    labels = torch.tensor([[1, 2, 3]])
    mask = torch.tensor([[True, False, True]])
    expected = -(logits[0, 0].log_softmax(-1)[1] + logits[0, 2].log_softmax(-1)[3]) / 2
    assert torch.allclose(masked_cross_entropy(logits, labels, mask, shift=False), expected)
