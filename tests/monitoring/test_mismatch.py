"""Mismatch monitor: hand-computed values, and a tiny model whose sampler and trainer disagree by a known amount."""

import copy
import math

import numpy as np
import pytest
import torch

from trl_stable.monitoring import HealthConfig, HealthTracker, mismatch_stats
from trl_stable.testing import build_causal_lm


def test_hand_computed_values():
    sampler = torch.tensor([[-1.0, -2.0, -3.0, -0.5]])
    trainer = torch.tensor([[-1.1, -2.0, -2.9, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])  # the last token is padding: ignored
    stats = mismatch_stats(sampler, trainer, mask)
    # d = trainer - sampler = [-0.1, 0, 0.1]
    assert stats.num_tokens == 3
    assert stats.abs_diff_mean == pytest.approx(0.2 / 3)
    assert stats.abs_diff_max == pytest.approx(0.1)
    assert stats.ratio_min == pytest.approx(math.exp(-0.1))
    assert stats.ratio_mean == pytest.approx((math.exp(-0.1) + 1 + math.exp(0.1)) / 3)
    assert stats.ratio_max == pytest.approx(math.exp(0.1))
    # exp(-0.1) = 0.9048 is inside [0.9, 1.1]; exp(0.1) = 1.1052 is outside
    assert stats.ratio_outside_band == pytest.approx(1 / 3)
    assert stats.ppl_ratio_mean == pytest.approx(1.0)  # mean d = 0
    assert stats.nonfinite_frac == 0.0


def test_sequence_perplexity_ratio_per_sequence():
    sampler = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    trainer = torch.tensor([[-1.2, -1.4], [-2.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    stats = mismatch_stats(sampler, trainer, mask)
    # seq 0: mean d = -0.3 -> PPL_train / PPL_sampler = exp(0.3); seq 1: mean d = 0 -> 1
    assert stats.ppl_ratio_max == pytest.approx(math.exp(0.3))
    assert stats.ppl_ratio_min == pytest.approx(1.0)
    assert stats.ppl_ratio_mean == pytest.approx((math.exp(0.3) + 1) / 2)


def test_random_batch_against_a_numpy_reference():
    rng = np.random.default_rng(0)
    sampler = -rng.uniform(0.01, 4, size=(4, 9))
    trainer = sampler + rng.normal(0, 0.15, size=(4, 9))
    mask = rng.uniform(size=(4, 9)) < 0.7
    mask[:, 0] = True
    stats = mismatch_stats(torch.tensor(sampler), torch.tensor(trainer), torch.tensor(mask), band=(0.9, 1.1))
    d = (trainer - sampler)[mask]
    ratio = np.exp(d)
    ppl = [np.exp(-(trainer[i] - sampler[i])[mask[i]].mean()) for i in range(4)]
    expected = {
        "abs_diff_mean": np.abs(d).mean(),
        "abs_diff_max": np.abs(d).max(),
        "ratio_min": ratio.min(),
        "ratio_mean": ratio.mean(),
        "ratio_max": ratio.max(),
        "ratio_outside_band": np.mean((ratio < 0.9) | (ratio > 1.1)),
        "ppl_ratio_mean": np.mean(ppl),
        "ppl_ratio_min": np.min(ppl),
        "ppl_ratio_max": np.max(ppl),
    }
    got = stats.to_dict()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert stats.num_tokens == mask.sum() and 0 < stats.ratio_outside_band < 1


def test_nonfinite_and_empty():
    sampler = torch.tensor([[-1.0, -float("inf"), -1.0]])
    trainer = torch.tensor([[-1.0, -1.0, float("nan")]])
    stats = mismatch_stats(sampler, trainer)
    assert stats.num_tokens == 1 and stats.nonfinite_frac == pytest.approx(2 / 3)
    empty = mismatch_stats(sampler, trainer, torch.zeros(1, 3))
    assert empty.num_tokens == 0 and empty.abs_diff_mean == 0.0 and empty.ratio_mean == 1.0
    assert all(math.isfinite(v) for v in empty.as_metrics().values())


def test_bf16_inputs_are_compared_in_fp32():
    sampler = torch.full((2, 3), -1.0, dtype=torch.bfloat16)
    trainer = torch.full((2, 3), -1.0078125, dtype=torch.float32)  # one bf16 ulp below -1 at this magnitude
    assert mismatch_stats(sampler, trainer).abs_diff_mean == pytest.approx(0.0078125)


def test_bad_shapes():
    with pytest.raises(ValueError, match="same shape"):
        mismatch_stats(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="mask"):
        mismatch_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="band"):
        mismatch_stats(torch.zeros(2, 3), torch.zeros(2, 3), band=(1.1, 0.9))


def test_metric_names_feed_the_tracker():
    metrics = mismatch_stats(torch.zeros(1, 2), torch.full((1, 2), -0.05)).as_metrics()
    assert metrics["mismatch/logp_abs_diff/mean"] == pytest.approx(0.05)
    tracker = HealthTracker(HealthConfig(patience=1))
    (event,) = tracker.update(metrics, step=1)
    assert event.alarm == "mismatch" and "max 0.050" in event.symptom and "outside [0.9, 1.1]" in event.symptom


# --- a tiny model: sampler = HF generate, trainer = a fresh forward pass --------------------------------------------


@pytest.fixture(scope="module")
def rollout(tokenizer):
    torch.manual_seed(0)
    model = build_causal_lm("llama", tokenizer, seed=0).eval()
    prompts = tokenizer(["The movie was", "I think the weather"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **prompts,
            do_sample=True,
            max_new_tokens=8,
            min_new_tokens=8,
            top_k=0,
            top_p=1.0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    prompt_len = prompts["input_ids"].shape[1]
    completion = out.sequences[:, prompt_len:]
    sampler_logits = torch.stack(out.logits, dim=1).float()  # (B, T, V), raw logits of the sampler
    attention = torch.cat([prompts["attention_mask"], torch.ones_like(completion)], dim=1)
    return model, out.sequences, attention, prompt_len, completion, sampler_logits


def token_logps(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def trainer_logits(model, sequences, attention, prompt_len):
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention).logits.float()
    return logits[:, prompt_len - 1 : -1]


def numpy_reference(sampler, trainer):
    d = trainer.double().numpy() - sampler.double().numpy()
    ratio = np.exp(d)
    return {
        "abs_diff_mean": np.abs(d).mean(),
        "abs_diff_max": np.abs(d).max(),
        "ratio_min": ratio.min(),
        "ratio_max": ratio.max(),
        "ratio_outside_band": ((ratio < 0.9) | (ratio > 1.1)).mean(),
        "ppl_ratio_mean": np.exp(-d.mean(axis=1)).mean(),
    }


def test_same_model_agrees(rollout):
    model, sequences, attention, prompt_len, completion, sampler_logits = rollout
    trainer = token_logps(trainer_logits(model, sequences, attention, prompt_len), completion)
    sampler = token_logps(sampler_logits, completion)
    stats = mismatch_stats(sampler, trainer)
    assert stats.num_tokens == completion.numel()
    assert stats.abs_diff_max < 1e-4
    assert HealthTracker(HealthConfig(patience=1)).update(stats.as_metrics(), step=1) == []


def test_sampler_temperature_bug_is_measured_exactly(rollout):
    # Injected, known disagreement: the sampler scored tokens at temperature 0.7, the trainer at 1.0.
    model, sequences, attention, prompt_len, completion, sampler_logits = rollout
    trainer = token_logps(trainer_logits(model, sequences, attention, prompt_len), completion)
    sampler = token_logps(sampler_logits, completion, temperature=0.7)
    stats = mismatch_stats(sampler, trainer).to_dict()
    for key, expected in numpy_reference(sampler, trainer).items():
        assert stats[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    assert stats["abs_diff_mean"] > 0.01
    events = HealthTracker(HealthConfig(patience=1)).update(mismatch_stats(sampler, trainer).as_metrics(), step=1)
    assert [e.alarm for e in events] == ["mismatch"]


def test_perturbation_size_orders_the_mismatch(rollout, tokenizer):
    model, sequences, attention, prompt_len, completion, _ = rollout
    trainer = token_logps(trainer_logits(model, sequences, attention, prompt_len), completion)
    means = []
    for scale in (1e-3, 1e-2, 1e-1):
        sampler_model = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in sampler_model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=generator))
        sampler = token_logps(trainer_logits(sampler_model, sequences, attention, prompt_len), completion)
        means.append(mismatch_stats(sampler, trainer).abs_diff_mean)
    assert means[0] < means[1] < means[2]
    assert means[0] < 0.01 < means[2]


def test_bf16_sampler_differs_from_fp32_trainer(rollout):
    model, sequences, attention, prompt_len, completion, _ = rollout
    trainer = token_logps(trainer_logits(model, sequences, attention, prompt_len), completion)
    sampler_model = copy.deepcopy(model).to(torch.bfloat16)
    sampler = token_logps(trainer_logits(sampler_model, sequences, attention, prompt_len), completion)
    stats = mismatch_stats(sampler, trainer)
    assert stats.abs_diff_mean > 1e-4  # a dtype change is visible, the same-model case is < 1e-4
    assert stats.ratio_min <= 1.0 <= stats.ratio_max


def test_gather_combines_processes_like_one_batch():
    """Two 'processes' with different widths: the gathered statistics equal those of the joined batch."""
    g = torch.Generator().manual_seed(0)
    s1, t1 = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    s2, t2 = -torch.rand(2, 7, generator=g) * 3, -torch.rand(2, 7, generator=g) * 3
    m1, m2 = torch.ones(3, 5), torch.ones(2, 7)
    m2[1, 4:] = 0
    s2[0, 2] = -float("inf")  # a non-finite token on the second process
    captured = []
    mismatch_stats(s2, t2, m2, gather=lambda row: captured.append(row) or row)  # the other process's row
    combined = mismatch_stats(s1, t1, m1, gather=lambda row: torch.cat([row, captured[0]])).to_dict()
    pad = lambda x, v: torch.nn.functional.pad(x, (0, 2), value=v)  # noqa: E731
    joined = mismatch_stats(
        torch.cat([pad(s1, 0.0), s2]), torch.cat([pad(t1, 0.0), t2]), torch.cat([pad(m1, 0.0), m2])
    ).to_dict()
    for key, value in joined.items():
        assert combined[key] == pytest.approx(value, rel=1e-9), key
    assert joined["nonfinite_frac"] == pytest.approx(1 / 26)  # 15 + 11 masked tokens, one -inf
