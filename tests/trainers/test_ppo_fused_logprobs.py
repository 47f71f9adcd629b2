"""PPO's log-prob passes through TRL's fused LM head: the same log-probs, entropies and values as the logits path, and
the LM head module (which would build the [B, R, V] logits) never runs in the rollout pass or the update, except
for full KL, which needs the whole distributions."""

import pytest
import torch
from tiny_configs import tiny_ppo_args

from trl_stable import PPOTrainer
from trl_stable.testing import build_causal_lm


def _queries(tokenizer):
    texts = ["The movie was", "I think", "A story about the", "We saw"]
    return [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]


def _trainer(tmp_path, tokenizer, family="qwen2", **kw):
    model = build_causal_lm(family, tokenizer, seed=0)
    kw.setdefault("fused_lm_head", True)  # on CPU the logits path is the default
    args = tiny_ppo_args(tmp_path, max_new_tokens=6, seed=0, temperature=0.7, **kw)
    return PPOTrainer(model, args=args, processing_class=tokenizer)


def test_the_logits_path_is_the_cpu_default_and_fused_lm_head_chooses(tmp_path, tokenizer):
    auto = _trainer(tmp_path / "auto", tokenizer, fused_lm_head=None)
    assert auto.accelerator.device.type == "cpu" and not auto.fused_policy and not auto.fused_ref
    calls, handle = _lm_head_calls(auto)
    try:
        auto.rollout_pass(_batch(auto, tokenizer))
    finally:
        handle.remove()
    assert calls  # the logits of the response positions (`logits_to_keep`), not the fused tiles
    on = _trainer(tmp_path / "on", tokenizer, fused_lm_head=True)
    assert on.fused_policy and on.fused_ref
    off = _trainer(tmp_path / "off", tokenizer, fused_lm_head=False)
    assert not off.fused_policy and not off.fused_ref


def _batch(trainer, tokenizer):
    queries = _queries(tokenizer)
    responses = trainer.generate(queries, return_prompt=False)
    return trainer.make_batch(queries, responses)


def _lm_head_calls(trainer):
    calls = []
    head = trainer.policy.get_output_embeddings()
    return calls, head.register_forward_hook(lambda *a: calls.append(1))


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_fused_scores_equal_the_logits_path(tmp_path, tokenizer, family):
    trainer = _trainer(tmp_path, tokenizer, family)
    assert trainer.fused_policy
    batch = _batch(trainer, tokenizer)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        fused, values = trainer._forward(trainer.model_wrapped, batch)
        plain, plain_values = trainer._forward(trainer.model_wrapped, batch, need_logits=True)
    assert fused.logits is None and plain.logits is not None
    # independent reference: log-softmax of the logits at the sampling temperature, gathered at the response tokens
    reference = torch.log_softmax(plain.logits.float() / 0.7, -1).gather(-1, batch["response_ids"][..., None])[..., 0]
    torch.testing.assert_close(fused.logprobs[mask], reference[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.entropy[mask], plain.entropy[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, plain_values)


def test_reference_scores_fused_equal_logits_path(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer)
    assert trainer.ref_model is not None and trainer.fused_ref
    batch = _batch(trainer, tokenizer)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        fused = trainer._ref_scores(batch)
        plain = trainer._ref_scores(batch, need_logits=True)
    torch.testing.assert_close(fused.logprobs[mask], plain.logprobs[mask], atol=1e-5, rtol=1e-5)


def test_the_lm_head_never_runs_outside_full_kl(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer)
    queries = _queries(tokenizer)
    responses = trainer.generate(queries, return_prompt=False)  # generation uses the LM head, as it must
    calls, handle = _lm_head_calls(trainer)
    try:
        stats = trainer.step(queries, responses, [[0.1] * len(r) for r in responses])
    finally:
        handle.remove()
    assert calls == [] and stats["val/ratio"] == pytest.approx(1.0, abs=1e-4)


def test_full_kl_keeps_the_logits_path(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, kl_penalty="full")
    batch = _batch(trainer, tokenizer)
    calls, handle = _lm_head_calls(trainer)
    try:
        rolled, _ = trainer.rollout_pass(batch)
    finally:
        handle.remove()
    assert calls  # the policy's forward built the logits full KL needs
    assert torch.isfinite(rolled["kl"]).all()


def test_a_step_is_the_same_with_and_without_the_fused_head(tmp_path, tokenizer):
    stats = {}
    for fused in (True, False):
        trainer = _trainer(tmp_path / str(fused), tokenizer, learning_rate=1e-3)
        trainer.fused_policy = trainer.fused_ref = fused
        torch.manual_seed(3)
        queries = _queries(tokenizer)
        responses = trainer.generate(queries, return_prompt=False)
        stats[fused] = trainer.step(queries, responses, [[0.1] * (len(r) - 1) + [1.0] for r in responses])
    for key in ("objective/kl", "loss/policy", "loss/value", "policy/approxkl", "objective/entropy"):
        assert stats[True][key] == pytest.approx(stats[False][key], abs=1e-5), key
