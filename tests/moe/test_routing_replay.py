"""RoutingReplay on the tiny MoE model of every supported family."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from trl_stable.moe import SUPPORTED_ROUTERS, RoutingReplay, mask_routing
from trl_stable.testing import build_causal_lm
from trl_stable.testing.kit import MOE_FAMILIES

MODELING = {
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "mixtral": "transformers.models.mixtral.modeling_mixtral",
    "olmoe": "transformers.models.olmoe.modeling_olmoe",
    "deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3",
}
TEXTS = ["the cat sat on the mat and then it slept", "hello there", "a quiet morning by the river", "one more"]


def _batch(tokenizer, texts=TEXTS):
    return tokenizer(texts, return_tensors="pt", padding=True)  # the kit's tokenizer pads on the left


def _logps(model, input_ids, attention_mask):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def _routers(model):
    return [m for m in model.modules() if type(m).__name__ in SUPPORTED_ROUTERS]


def _perturb_routers(model, scale=1.0, seed=1):
    """Add noise to every router (and DeepSeek's selection bias): the routing a plain forward picks changes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in _routers(model):
            noise = torch.randn(router.weight.shape, generator=generator)
            router.weight.add_(noise * router.weight.std() * scale)
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.add_(torch.randn(router.num_experts, generator=generator) * 0.05)


class _ForcedTopk:
    """Stand-in for the `torch` module inside a modeling file: `torch.topk` over the experts returns the given
    indices (with the values at those indices), so the family's *own* router code computes the gates.
    Independent reference for the gating formulas in trl_stable.moe.adapters."""

    def __init__(self, per_call: list[torch.Tensor], num_experts: int):
        self.per_call, self.num_experts = list(per_call), num_experts

    def __getattr__(self, name):
        return getattr(torch, name)

    def topk(self, input, k, dim=-1, largest=True, sorted=True):
        if input.shape[-1] == self.num_experts and self.per_call and k == self.per_call[0].shape[-1]:
            index = self.per_call.pop(0).to(input.device)
            return input.gather(-1, index), index
        return torch.topk(input, k, dim=dim, largest=largest, sorted=sorted)


@pytest.fixture(params=MOE_FAMILIES)
def family(request):
    return request.param


def test_record_does_not_change_the_forward(tokenizer, family):
    model = build_causal_lm(family, tokenizer).eval()
    enc = _batch(tokenizer)
    with torch.no_grad():
        before = _logps(model, enc.input_ids, enc.attention_mask)
        replay = RoutingReplay(model)
        with replay.record():
            recorded = _logps(model, enc.input_ids, enc.attention_mask)
    assert torch.equal(before, recorded)
    routing = replay.export()
    assert routing.shape == (4, enc.input_ids.shape[1], 2, 2) and routing.dtype == torch.int16
    assert replay.families == [family]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_unperturbed_is_exact(tokenizer, family, dtype):
    """Gates recomputed at the recorded experts with the family's normalisation equal the router's own gates,
    bit for bit, also in bf16 (each family's dtype casts are mirrored)."""
    model = build_causal_lm(family, tokenizer, dtype=dtype).eval()
    enc = _batch(tokenizer)
    replay = RoutingReplay(model)
    with torch.no_grad():
        with replay.record():
            recorded = _logps(model, enc.input_ids, enc.attention_mask)
        with replay.replay():
            replayed = _logps(model, enc.input_ids, enc.attention_mask)
    assert torch.equal(recorded, replayed)
    metrics = replay.metrics()
    assert metrics["routing/agreement"] == 1.0 and metrics["routing/replayed_frac"] == 1.0


def test_perturbed_routers_replay_matches_forced_reference_and_recorded_pass(tokenizer, family, monkeypatch):
    model = build_causal_lm(family, tokenizer).eval()
    enc = _batch(tokenizer)
    replay = RoutingReplay(model)
    with torch.no_grad():
        with replay.record():
            recorded = _logps(model, enc.input_ids, enc.attention_mask)
    routing = replay.export()
    _perturb_routers(model)

    with replay.replay():
        replayed = _logps(model, enc.input_ids, enc.attention_mask)
    replayed.sum().backward()
    replay_grads = [r.weight.grad.clone() for r in _routers(model)]
    model.zero_grad()
    with torch.no_grad():
        plain = _logps(model, enc.input_ids, enc.attention_mask)
    agreement = replay.metrics()["routing/agreement"]
    assert agreement < 1.0, "the perturbation must change the routing a plain forward picks"

    # Independent reference: the family's own router code, with its top-k forced to the recorded experts.
    per_call = [routing[:, :, layer].reshape(-1, routing.shape[-1]).long() for layer in range(routing.shape[2])]
    monkeypatch.setattr(importlib.import_module(MODELING[family]), "torch", _ForcedTopk(per_call, 4))
    reference = _logps(model, enc.input_ids, enc.attention_mask)
    reference.sum().backward()
    monkeypatch.undo()
    torch.testing.assert_close(replayed, reference, rtol=0, atol=1e-6)
    for got, want in zip(replay_grads, [r.weight.grad for r in _routers(model)], strict=True):
        assert got.abs().sum() > 0, "the router must receive gradients in replay"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)

    real = enc.attention_mask[:, 1:].bool()
    replay_err = (replayed.detach() - recorded)[real].abs().max()
    plain_err = (plain - recorded)[real].abs().max()
    assert replay_err < plain_err


def test_deepseek_bias_drift_replays_exactly(tokenizer):
    """DeepSeek-V3's correction bias steers selection only: replay of the recorded experts is exact."""
    model = build_causal_lm("deepseek_v3", tokenizer).eval()
    enc = _batch(tokenizer)
    replay = RoutingReplay(model)
    with torch.no_grad():
        with replay.record():
            recorded = _logps(model, enc.input_ids, enc.attention_mask)
        for router in _routers(model):
            router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.3, -0.3, 0.1]))
        plain = _logps(model, enc.input_ids, enc.attention_mask)
        with replay.replay():
            replayed = _logps(model, enc.input_ids, enc.attention_mask)
    assert torch.equal(replayed, recorded)
    assert (plain - recorded).abs().max() > 1e-5
    assert replay.metrics()["routing/agreement"] < 1.0


def test_router_gets_gradient_in_replay(tokenizer, family):
    model = build_causal_lm(family, tokenizer).eval()
    enc = _batch(tokenizer)
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record():
        model(**enc)
    _perturb_routers(model)
    with replay.replay():
        loss = -_logps(model, enc.input_ids, enc.attention_mask).mean()
    loss.backward()
    for router in _routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().max() > 0


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_recomputes_with_replayed_experts(tokenizer, use_reentrant):
    """Checkpointed layers are recomputed in backward: the recomputation must use the replayed experts too."""

    def run(model, replay, routing, enc):
        for chunk in (slice(0, 2), slice(2, 4)):  # two micro-batches: forward, backward, forward, backward
            with replay.replay(routing[chunk]):
                loss = -_logps(model, enc.input_ids[chunk], enc.attention_mask[chunk]).mean()
            loss.backward()  # outside the context, as in a trainer

    plain, checkpointed = (_checkpointed_grads(tokenizer, flag, run, use_reentrant) for flag in (False, True))
    torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-8)


def _checkpointed_grads(tokenizer, checkpointing, run, use_reentrant=False):
    """Gradients of every parameter after `run(model, replay, routing, enc)` on a perturbed qwen3_moe."""
    enc = _batch(tokenizer)
    model = build_causal_lm("qwen3_moe", tokenizer).train()
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record():
        model(**enc)
    routing = replay.export()
    _perturb_routers(model)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
        model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
    run(model, replay, routing, enc)
    assert all(not s.recompute_fifo for s in replay._states)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_gradient_checkpointing_with_one_backward_over_two_forwards(tokenizer):
    """Accumulating a loss over two same-shape forwards, then one backward: autograd recomputes the second forward
    first, so a plain FIFO would hand it the first forward's experts; each recomputation must get its own."""

    def run(model, replay, routing, enc):
        loss = 0.0
        for chunk in (slice(0, 2), slice(2, 4)):
            with replay.replay(routing[chunk]):
                loss = loss - _logps(model, enc.input_ids[chunk], enc.attention_mask[chunk]).mean()
        loss.backward()

    plain, checkpointed = (_checkpointed_grads(tokenizer, flag, run) for flag in (False, True))
    torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-8)


def test_gradient_checkpointing_without_graph_task_api_is_refused(tokenizer, monkeypatch):
    """Without torch's graph-task id a recomputation would route freely: replay must refuse, not mis-train."""
    from trl_stable.moe import replay as replay_module

    monkeypatch.setattr(replay_module, "_current_graph_task_id", None)

    def run(model, replay, routing, enc):
        with replay.replay(routing):
            (-_logps(model, enc.input_ids, enc.attention_mask).mean()).backward()

    with pytest.raises(RuntimeError, match="_current_graph_task_id"):
        _checkpointed_grads(tokenizer, True, run)
    assert _checkpointed_grads(tokenizer, False, run).abs().sum() > 0  # no checkpointing: nothing to tell apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_gate_equals_the_family_router_at_forced_experts(tokenizer, family, norm_topk_prob, dtype):
    """Unit check of each adapter's gate against the family's own router forward (its top-k forced to random
    experts): softmax vs sigmoid, norm_topk_prob both ways, Mixtral's fp32 renormalisation, DeepSeek's unbiased
    scores times routed_scaling_factor under group-limited selection, and every dtype cast."""
    from trl_stable.moe.adapters import adapter_for

    router = _routers(build_causal_lm(family, tokenizer))[0].to(dtype)
    if hasattr(router, "norm_topk_prob"):
        router.norm_topk_prob = norm_topk_prob
    elif norm_topk_prob is False:
        pytest.skip("Mixtral always renormalises")
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.copy_(torch.tensor([0.5, -0.2, 0.1, 0.0]))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, router.weight.shape[1], generator=generator).to(dtype)
    index = torch.rand(64, router.num_experts, generator=generator).argsort(-1)[:, : router.top_k]
    module = importlib.import_module(MODELING[family])
    original_torch = module.torch
    module.torch = _ForcedTopk([index], router.num_experts)
    try:
        logits, want, got_index = router(hidden)
    finally:
        module.torch = original_torch
    assert torch.equal(got_index, index)
    gate = adapter_for(router).gate
    got = gate(router, logits, index)
    assert got.dtype == want.dtype and torch.equal(got, want)
    if hasattr(router, "norm_topk_prob"):  # the check can fail: the other normalisation gives other weights
        router.norm_topk_prob = not norm_topk_prob
        assert not torch.allclose(gate(router, logits, index), want)


def test_chunks_and_shuffled_minibatches_stay_aligned(tokenizer, family):
    model = build_causal_lm(family, tokenizer).eval()
    enc = _batch(tokenizer)
    replay = RoutingReplay(model)
    with torch.no_grad():
        with replay.record():  # recorded in chunks of 3 + 1, as a chunked log-prob pass does
            recorded = torch.cat(
                [_logps(model, enc.input_ids[s], enc.attention_mask[s]) for s in (slice(0, 3), slice(3, 4))]
            )
    routing = mask_routing(replay.export(), enc.attention_mask)
    _perturb_routers(model)
    with torch.no_grad():
        with replay.replay(routing):  # one call over the whole batch
            whole = _logps(model, enc.input_ids, enc.attention_mask)
        order = torch.tensor([2, 0, 3, 1])
        shuffled = {k: v[order] for k, v in enc.items()}
        minibatches = []
        for rows in (slice(0, 2), slice(2, 4)):  # routing travels with its rows
            with replay.replay(routing[order][rows]):
                minibatches.append(_logps(model, shuffled["input_ids"][rows], shuffled["attention_mask"][rows]))
    torch.testing.assert_close(torch.cat(minibatches), whole[order], rtol=0, atol=1e-6)
    real = enc.attention_mask.sum()
    assert replay.metrics()["routing/replayed_frac"] == pytest.approx(float(real) / enc.attention_mask.numel())
    # left padding: the masked rows are exactly the pad positions
    assert ((routing == -1).all(-1).all(-1) == (enc.attention_mask == 0)).all()
    assert recorded.shape == whole.shape


def test_export_matches_the_experts_the_blocks_ran(tokenizer, family):
    """Independent check of the [B, S, layers, k] layout: capture top_k_index at each experts module."""
    model = build_causal_lm(family, tokenizer).eval()
    enc = _batch(tokenizer)
    seen = []
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    handles = [e.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())) for e in experts]
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record():
        model(**enc)
    for h in handles:
        h.remove()
    routing = replay.export()
    batch, seq_len = enc.input_ids.shape
    for layer, index in enumerate(seen):
        assert torch.equal(routing[:, :, layer].long(), index.view(batch, seq_len, -1))

    # import into a fresh model: replay there uses exactly these experts
    other = build_causal_lm(family, tokenizer, seed=3).eval()
    seen.clear()
    experts = [m for name, m in other.named_modules() if name.endswith("mlp.experts")]
    handles = [e.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())) for e in experts]
    imported = RoutingReplay(other)
    with torch.no_grad(), imported.replay(routing.to(torch.int32)):
        other(**enc)
    for h in handles:
        h.remove()
    for layer, index in enumerate(seen):
        assert torch.equal(index.view(batch, seq_len, -1), routing[:, :, layer].long())


def test_mixtral_jitter_does_not_change_replayed_experts(tokenizer):
    model = build_causal_lm("mixtral", tokenizer, router_jitter_noise=0.9)
    enc = _batch(tokenizer)
    seen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
    replay = RoutingReplay(model)
    model.eval()
    with torch.no_grad(), replay.record():
        recorded = _logps(model, enc.input_ids, enc.attention_mask)
    routing = replay.export()
    model.train()  # jitter on
    seen.clear()
    torch.manual_seed(0)
    with torch.no_grad(), replay.replay():
        model(**enc)
    for layer, index in enumerate(seen):
        assert torch.equal(index.view(*enc.input_ids.shape, -1), routing[:, :, layer].long())
    assert replay.metrics()["routing/agreement"] < 1.0  # the jittered router alone would have chosen otherwise

    replay.remove()  # a second instance needs the first removed
    exact = RoutingReplay(model, disable_router_jitter=True)
    with torch.no_grad(), exact.replay(routing):
        replayed = _logps(model, enc.input_ids, enc.attention_mask)
    torch.testing.assert_close(replayed, recorded, rtol=0, atol=1e-6)
    assert all(block.jitter_noise == 0.9 for block in (m for m in model.modules() if hasattr(m, "jitter_noise")))


def test_deep_copy_of_a_hooked_model_is_independent(tokenizer):
    """A reference model deep-copied from a hooked policy carries the hooks along; they must ignore the copy."""
    import copy

    model = build_causal_lm("qwen2_moe", tokenizer).eval()
    enc = _batch(tokenizer)
    replay = RoutingReplay(model)
    reference = copy.deepcopy(model)
    _perturb_routers(reference)
    with torch.no_grad():
        plain_reference = _logps(reference, enc.input_ids, enc.attention_mask)
        with replay.record():
            recorded = _logps(model, enc.input_ids, enc.attention_mask)
            _logps(reference, enc.input_ids, enc.attention_mask)  # not recorded: would break export
        assert replay.recorded_shapes == [tuple(enc.input_ids.shape)]
        with replay.replay():
            replayed = _logps(model, enc.input_ids, enc.attention_mask)
            assert torch.equal(_logps(reference, enc.input_ids, enc.attention_mask), plain_reference)
    assert torch.equal(recorded, replayed)
    RoutingReplay(reference)  # the copy can get its own


def test_missing_rows_fall_back_to_the_router(tokenizer):
    model = build_causal_lm("olmoe", tokenizer).eval()
    enc = _batch(tokenizer)
    replay = RoutingReplay(model)
    with torch.no_grad():
        plain = _logps(model, enc.input_ids, enc.attention_mask)
        routing = torch.full((4, enc.input_ids.shape[1], 2, 2), -1, dtype=torch.int32)
        with replay.replay(routing):
            replayed = _logps(model, enc.input_ids, enc.attention_mask)
    assert torch.equal(plain, replayed)
    assert replay.metrics() == {"routing/replayed_frac": 0.0}


def test_errors(tokenizer):
    dense = build_causal_lm("llama", tokenizer)
    with pytest.raises(ValueError, match="Qwen2MoeTopKRouter.*DeepseekV3TopkRouter"):
        RoutingReplay(dense)

    class FooSparseMoeBlock(nn.Module):
        pass

    dense.model.layers[0].mlp = FooSparseMoeBlock()
    with pytest.raises(ValueError, match="unsupported classes: FooSparseMoeBlock"):
        RoutingReplay(dense)

    model = build_causal_lm("qwen3_moe", tokenizer).eval()
    enc = _batch(tokenizer)
    replay = RoutingReplay(model)
    with pytest.raises(ValueError, match="already hooked"):
        RoutingReplay(model)
    with pytest.raises(ValueError, match="Nothing to replay"):
        with replay.replay():
            pass
    with pytest.raises(ValueError, match=r"shape \[B, S, num_layers=2, k=2\]"):
        replay.load(torch.zeros(4, 3, 2))
    with pytest.raises(ValueError, match="outside"):
        replay.load(torch.full((1, 3, 2, 2), 7))
    with torch.no_grad(), replay.record():
        model(**enc)
    with pytest.raises(ValueError, match="sequence length"), torch.no_grad(), replay.replay():
        model(input_ids=enc.input_ids[:, 1:])
    with pytest.raises(ValueError, match="ran out"), torch.no_grad(), replay.replay():
        model(**enc)
        model(**enc)
    with pytest.raises(RuntimeError, match="do not nest"), replay.record(), replay.record():
        pass
    replay.remove()
    with torch.no_grad():
        model(**enc)  # unhooked model runs as before
    RoutingReplay(model)  # and can be hooked again

    # a transformers release whose routers return another layout is refused, not silently mis-replayed
    other = build_causal_lm("olmoe", tokenizer).eval()
    RoutingReplay(other)
    for router in _routers(other):
        router.forward = lambda hidden, router=router: torch.nn.functional.linear(hidden, router.weight)
    with pytest.raises(RuntimeError, match="routes differently"), torch.no_grad():
        other(**enc)


def test_disabled_jitter_stays_off_in_checkpoint_recomputation(tokenizer):
    """`disable_router_jitter` must hold for backward's recomputation too, which runs after the context exits:
    a jittered recomputation would differentiate another function than the forward computed."""
    enc = _batch(tokenizer)
    grads = {}
    for checkpointing in (False, True):
        model = build_causal_lm("mixtral", tokenizer, router_jitter_noise=0.5).train()
        replay = RoutingReplay(model, disable_router_jitter=True)
        with torch.no_grad(), replay.record():
            model(**enc)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        with replay.replay():
            loss = -_logps(model, enc.input_ids, enc.attention_mask).mean()
        loss.backward()
        grads[checkpointing] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert all(m.jitter_noise == 0.5 for m in model.modules() if hasattr(m, "jitter_noise"))
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gate_at_experts_whose_probabilities_underflow_is_finite(tokenizer, family):
    """A router that drifted far from the recorded experts (logit gap ~200) gives them fp32 probabilities of exactly
    0; renormalising those is 0 / 0. The gate then takes its exact value, the softmax over the replayed experts'
    logits, and its gradient stays finite; a row without underflow keeps the family's own value."""
    from trl_stable.moe.adapters import adapter_for

    router = _routers(build_causal_lm(family, tokenizer))[0]
    if hasattr(router, "norm_topk_prob"):
        router.norm_topk_prob = True
    logits = torch.tensor([[200.0, 0.0, -5.0, 1.0], [0.5, 0.1, -0.3, 0.2]], requires_grad=True)
    index = torch.tensor([[1, 2], [1, 2]])
    weights = adapter_for(router).gate(router, logits, index)
    assert torch.allclose(weights[0], torch.softmax(torch.tensor([0.0, -5.0]), -1))
    probs = torch.softmax(logits[1].detach(), -1)[[1, 2]]
    assert torch.allclose(weights[1], probs / probs.sum())
    (weights * torch.tensor([[1.0, 2.0], [1.0, 2.0]])).sum().backward()
    assert torch.isfinite(logits.grad).all()
