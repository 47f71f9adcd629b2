import torch

from trl_stable.core import position_ids_from_mask


def test_rows_numbered_from_their_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    expected = torch.tensor([[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 1, 1]])
    assert torch.equal(position_ids_from_mask(mask), expected)
    assert torch.equal(position_ids_from_mask(mask.bool()), expected)  # bool masks too
    assert position_ids_from_mask(mask).dtype == torch.long
