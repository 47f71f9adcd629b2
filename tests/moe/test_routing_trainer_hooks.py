"""Routing replay at the named points of trl_stable's GRPOTrainer (R2 and R3), on top of TRL's batch building."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args
from tiny_data import length_reward

from trl_stable import GRPOTrainer
from trl_stable.moe.hook import ROUTED_EXPERTS_KEY, RoutingHook, batch_routing, check_routing_replay_mode
from trl_stable.testing import build_causal_lm


class _Trainer(GRPOTrainer):
    """Captures what the update passes saw, to check the routing that travelled with the batch."""

    def _compute_loss(self, model, inputs):
        self.seen_batches = getattr(self, "seen_batches", [])
        self.seen_batches.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return super()._compute_loss(model, inputs)


def _run(tmp_path, tokenizer, mode, max_steps=2, gradient_checkpointing=False, pad_to_multiple_of=None):
    dataset = Dataset.from_dict({"prompt": ["the cat sat", "hello there my friend", "a quiet day", "one"]})
    args = tiny_grpo_args(
        tmp_path,
        routing_replay=mode,
        max_completion_length=6,
        num_iterations=2,  # makes TRL run the old-logprob pass
        max_steps=max_steps,
        learning_rate=5e-2,
        seed=0,
        gradient_checkpointing=gradient_checkpointing,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    model = build_causal_lm("qwen3_moe", tokenizer)
    trainer = _Trainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    ("mode", "gradient_checkpointing", "pad_to_multiple_of"),
    [("R2", False, None), ("R3", False, 8), ("R2", True, None)],
)
def test_grpo_routing_replay_runs_and_logs_agreement(
    tmp_path, tokenizer, mode, gradient_checkpointing, pad_to_multiple_of
):
    router_before = build_causal_lm("qwen3_moe", tokenizer).model.layers[0].mlp.gate.weight.detach().clone()
    trainer = _run(
        tmp_path, tokenizer, mode, gradient_checkpointing=gradient_checkpointing, pad_to_multiple_of=pad_to_multiple_of
    )
    assert all(not state.recompute_fifo for state in trainer.routing.replay._states)
    logs = [entry for entry in trainer.state.log_history if "routing/agreement" in entry]
    assert len(logs) == 2, trainer.state.log_history
    # first update runs on the weights of the recording pass: every replayed expert set is what the router picks,
    # which also proves the routing tensor stayed aligned with its tokens through TRL's shuffle and split
    assert logs[0]["routing/agreement"] == 1.0
    assert 0.0 <= logs[1]["routing/agreement"] <= 1.0
    assert "routing/agreement/layer_1" in logs[0]
    for batch, entry in zip(trainer.seen_batches, logs, strict=True):
        routing = batch[ROUTED_EXPERTS_KEY]
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        assert routing.shape[:2] == attention.shape and routing.shape[2:] == (2, 2)
        covered, attended = (routing >= 0).all(-1).all(-1), attention.bool()
        if mode == "R2":
            assert torch.equal(covered, attended)
        else:  # generate never feeds the last sampled token, so at most that one row per sequence is missing
            assert not (covered & ~attended).any() and ((attended & ~covered).sum(1) <= 1).all()
        if mode == "R2":
            assert entry["routing/replayed_frac"] == pytest.approx(attention.float().mean().item())
    if mode == "R3":
        rollout = [entry for entry in trainer.state.log_history if "routing/rollout_agreement" in entry]
        assert rollout and rollout[0]["routing/rollout_agreement"] == 1.0  # sampler and trainer share weights
    router_after = trainer.model.model.layers[0].mlp.gate.weight.detach()
    assert not torch.equal(router_before, router_after), "routers must keep training under replay"


def test_grpo_off_adds_nothing(tmp_path, tokenizer):
    trainer = _run(tmp_path, tokenizer, "off", max_steps=1)
    assert trainer.routing.replay is None and not trainer.routing.active
    assert all(ROUTED_EXPERTS_KEY not in batch for batch in trainer.seen_batches)
    assert not any("routing/agreement" in entry for entry in trainer.state.log_history)


def test_config_validation():
    with pytest.raises(ValueError, match="routing_replay must be one of 'off', 'R2', 'R3'"):
        check_routing_replay_mode("r2")


def test_sampled_routing_and_batch_routing(tokenizer):
    model = build_causal_lm("mixtral", tokenizer).eval()
    hook = RoutingHook(model, "R3")
    replay = hook.replay
    prompts = [tokenizer(t).input_ids for t in ["the cat sat on", "hi"]]
    enc = tokenizer(["the cat sat on", "hi"], return_tensors="pt", padding=True)
    with torch.no_grad(), hook.sampling() as sampled:
        out = model.generate(**enc, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    per_sequence = sampled.per_sequence([len(p) for p in prompts], [3, 3])
    assert [len(r) for r in per_sequence] == [len(prompts[0]) + 2, len(prompts[1]) + 2]  # last token never fed
    prompt_width = enc.input_ids.shape[1] + 1  # the trainer pads one wider
    attention = torch.cat([torch.zeros(2, 1, dtype=torch.long), enc.attention_mask, torch.ones(2, 3)], 1).long()
    routing = batch_routing(per_sequence, attention, prompt_width)
    ids = torch.cat([torch.full((2, 1), tokenizer.pad_token_id), out], dim=1)
    with torch.no_grad(), replay.record():
        model(input_ids=ids, attention_mask=attention)
    full = replay.export()
    covered = routing[..., 0, 0] >= 0
    assert covered.sum() == sum(len(r) for r in per_sequence)
    assert torch.equal(routing[covered], full[covered].int())


@pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")
def test_grpo_r3_accepts_routed_experts_from_a_rollout_func(tmp_path, tokenizer):
    """A vLLM-style sampler hands back per-sequence `routed_experts` [tokens, layers, k] with its completions."""
    from trl_stable.moe import generate_with_routing, unpad_routing

    def rollout_func(prompts, trainer):
        model = trainer.model
        replay = trainer.routing.replay
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out, routing = generate_with_routing(
                model, replay, input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                max_new_tokens=4, min_new_tokens=4, do_sample=True, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        replay.clear()
        width = enc.input_ids.shape[1]
        lengths = enc.attention_mask.sum(1).tolist()
        completions = out.sequences[:, width:]
        steps = [torch.log_softmax(s, -1).gather(-1, completions[:, i, None])[:, 0] for i, s in enumerate(out.logits)]
        logps = torch.stack(steps, 1)
        per_sequence = unpad_routing(routing, [width - n for n in lengths], [n + 4 for n in lengths])
        return {
            "prompt_ids": [ids[width - n :].tolist() for ids, n in zip(enc.input_ids, lengths, strict=True)],
            "completion_ids": completions.tolist(),
            "logprobs": logps.tolist(),
            ROUTED_EXPERTS_KEY: [r.numpy() for r in per_sequence],  # numpy, as a sampler returns it
        }

    dataset = Dataset.from_dict({"prompt": ["the cat sat", "hello there my friend"]})
    args = tiny_grpo_args(tmp_path, routing_replay="R3", max_completion_length=4, num_iterations=2, seed=0)
    trainer = _Trainer(
        model=build_causal_lm("olmoe", tokenizer), reward_funcs=length_reward, args=args, train_dataset=dataset,
        processing_class=tokenizer, rollout_func=rollout_func,
    )  # fmt: skip
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["routing/rollout_agreement"] == 1.0 and log["routing/agreement"] == 1.0
    assert ROUTED_EXPERTS_KEY in trainer.seen_batches[0]
