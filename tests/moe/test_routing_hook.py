"""`RoutingHook`: the named routing-replay points a trainer calls, on a tiny Qwen2-MoE."""

import pytest
import torch

from trl_stable.moe.hook import RoutingHook
from trl_stable.testing import build_causal_lm


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    return build_causal_lm("qwen2_moe", tokenizer).eval()


def test_off_is_a_no_op(model):
    hook = RoutingHook(model, "off")
    with hook.sampling() as sampled, hook.rollout_pass(torch.ones(1, 3)) as rollout, hook.update_pass(None):
        pass
    assert sampled.routing is None and rollout.routing is None and hook.take_metrics() == {}
    with pytest.raises(ValueError, match="routing_replay must be one of"):
        RoutingHook(model, "r2")


def test_r2_records_in_the_rollout_pass_and_replays_exactly(model):
    hook = RoutingHook(model, "R2")
    ids = torch.randint(3, 100, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad(), hook.rollout_pass(mask) as rollout:
        before = model(input_ids=ids, attention_mask=mask).logits
    routing = rollout.routing
    assert routing.shape[:2] == (2, 6) and (routing[0, :2] == -1).all() and (routing[1] >= 0).all()
    with torch.no_grad(), hook.update_pass(routing):
        again = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(again, before)
    metrics = hook.take_metrics("routing/")
    assert metrics["routing/agreement"] == 1.0 and hook.take_metrics() == {}


def test_r3_records_the_sampler_and_needs_it_in_the_rollout_pass(model, tokenizer):
    hook = RoutingHook(model, "R3")
    prompt = torch.tensor([[0, 5, 6], [7, 8, 9]])
    attention = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with torch.no_grad(), hook.sampling() as sampled:
        out = model.generate(
            input_ids=prompt,
            attention_mask=attention,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,
        )
    per_seq = sampled.per_sequence([2, 3], [3, 3])
    # the last sampled token is never fed back: its routing row is missing
    assert [tuple(r.shape[:1]) for r in per_seq] == [(4,), (5,)]
    with pytest.raises(ValueError, match="needs the sampler's routing"):
        with hook.rollout_pass(torch.ones_like(out)):
            pass
