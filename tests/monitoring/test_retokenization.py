"""Re-tokenization check: ids the sampler produced vs the trainer's re-encoding of the same conversation."""

import pytest
import torch

from trl_stable.monitoring import HealthConfig, HealthTracker, check_retokenization, drop_mismatched


def test_first_difference_and_keep_mask():
    sampler = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [1, 2, 3]]
    trainer = [[1, 2, 3, 4], [5, 60, 7], [8, 9, 10], [1, 2]]
    report = check_retokenization(sampler, trainer)
    assert report.first_diff == [-1, 1, 2, 2]  # equal; changed id; trainer longer; trainer shorter
    assert report.mismatched == [1, 2, 3]
    assert report.num_mismatched == 3
    assert report.keep.tolist() == [True, False, False, False]
    assert report.as_metrics() == {"retokenization/mismatched": 3.0, "retokenization/mismatched_frac": 0.75}
    text = report.describe(max_samples=2, context=1)
    assert "3/4 samples differ" in text
    assert "sample 1: first difference at token 1: sampler [5, 6, 7] vs trainer [5, 60, 7]" in text
    assert "and 1 more" in text


def test_padded_tensors_with_masks(tokenizer):
    texts = ["Hello there, tool output: 42", "short"]
    sampler = tokenizer(texts, return_tensors="pt", padding=True)  # left padding
    # The trainer re-encodes after a decode/encode round trip that lost a space in the second conversation.
    trainer_texts = ["Hello there, tool output: 42", " short"]
    trainer = tokenizer(trainer_texts, return_tensors="pt", padding=True)
    report = check_retokenization(
        sampler["input_ids"], trainer["input_ids"], sampler["attention_mask"], trainer["attention_mask"]
    )
    assert report.first_diff[0] == -1
    assert report.first_diff[1] == 0
    assert "sample 1" in report.describe(decode=tokenizer.decode)


def test_drop_mismatched_zeroes_rows():
    report = check_retokenization([[1, 2], [3, 4], [5]], [[1, 2], [3, 5], [5]])
    mask = torch.ones(3, 4)
    out = drop_mismatched(mask, report)
    assert out.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert mask.sum() == 12  # input untouched


def test_alarm_from_metrics():
    report = check_retokenization([[1, 2]], [[1, 3]])
    (event,) = HealthTracker(HealthConfig(patience=1)).update(report.as_metrics(), step=4)
    assert event.alarm == "retokenization" and event.step == 4


def test_errors():
    with pytest.raises(ValueError, match="samples"):
        check_retokenization([[1]], [[1], [2]])
    with pytest.raises(ValueError, match="mask"):
        check_retokenization([[1]], [[1]], sampler_mask=torch.ones(1, 1))
    report = check_retokenization([[1]], [[2]])
    with pytest.raises(ValueError, match="rows"):
        drop_mismatched(torch.ones(2, 3), report)
