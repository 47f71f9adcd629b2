"""A KL estimator registered with `trl_stable.core.register_kl_estimator` is a valid `kl_penalty` and the one the
trainer's reward uses."""

import pytest
import torch
from tiny_configs import tiny_ppo_args

from trl_stable import PPOConfig, PPOTrainer
from trl_stable.core.kl import KL_ESTIMATORS, register_kl_estimator
from trl_stable.testing import build_causal_lm


@pytest.fixture
def mine():
    calls = []

    def shifted_k1(logp, ref_logp):
        calls.append((logp.detach().clone(), ref_logp.detach().clone()))
        return logp - ref_logp + 0.25  # the offset makes it visible: the policy starts equal to the reference

    register_kl_estimator("mine")(shifted_k1)
    yield calls
    del KL_ESTIMATORS["mine"]


def test_unregistered_kl_penalty_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"kl_penalty must be one of \('kl', .*'full'\) or a name registered"):
        PPOConfig(output_dir=str(tmp_path), kl_penalty="mine")


def test_registered_estimator_is_accepted_and_used(tmp_path, tokenizer, mine):
    args = tiny_ppo_args(tmp_path, kl_penalty="mine", init_kl_coef=0.5, adap_kl_ctrl=False)
    trainer = PPOTrainer(build_causal_lm("qwen2", tokenizer, seed=0), args=args, processing_class=tokenizer)
    texts = ["The movie was", "I think", "A story about", "We saw"]
    queries = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    lengths = [3, 2, 1, 3]
    responses = [torch.arange(5, 5 + n) for n in lengths]
    stats = trainer.step(queries, responses, scores=[1.0, 0.0, 1.0, 0.0])

    assert len(mine) == 2  # one call per rollout minibatch of 2
    logp = torch.cat([c[0] for c in mine])
    ref_logp = torch.cat([c[1] for c in mine])
    assert logp.shape == (4, 3)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(3)] for n in lengths])
    per_sample = ((logp - ref_logp + 0.25) * mask).sum(1)
    assert stats["objective/kl"] == pytest.approx(per_sample.mean().item(), abs=1e-6)
    assert stats["objective/kl"] == pytest.approx(0.25 * sum(lengths) / 4, abs=1e-3)  # logp = ref_logp at step 1
    assert stats["objective/non_score_reward"] == pytest.approx(-0.5 * per_sample.mean().item(), abs=1e-6)


def test_registering_twice_or_as_full_is_refused(mine):
    with pytest.raises(ValueError, match="'mine' is already registered"):
        register_kl_estimator("mine")(lambda logp, ref_logp: logp - ref_logp)
    with pytest.raises(ValueError, match="'full' is the exact KL over the vocabulary"):
        register_kl_estimator("full")(lambda logp, ref_logp: logp - ref_logp)
