"""PPO rollouts through TRL's vLLM helper, with a fake helper that behaves like `VLLMGeneration` (vLLM does not run on
CPU): the Rollout it yields, weight syncs, the sampler log-probs in the decoupled loss and the mismatch monitor, R3."""

import importlib.machinery
import math
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from tiny_configs import tiny_ppo_args

import trl_stable.trainers.ppo.step_rewards as ppo_step_rewards
import trl_stable.trainers.ppo.vllm as ppo_vllm
from trl_stable import PPOConfig, PPOTrainer
from trl_stable.testing import build_causal_lm, save_tiny

QUERIES = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9, 10]), torch.tensor([11])]


class FakeLLM:
    """The colocate engine (`VLLMGeneration.llm`): returns `RequestOutput`-like objects, with routed experts."""

    def __init__(self, num_layers=2, k=2, num_experts=4):
        self.shape, self.num_experts = (num_layers, k), num_experts

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        outs = []
        for p in prompts:
            tokens = len(p["prompt_token_ids"]) + FakeGeneration.completion_length
            routed = torch.arange(tokens * 4).reshape(tokens, *self.shape) % self.num_experts
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(routed_experts=routed.numpy())]))
        return outs


class FakeGeneration:
    """Stands in for `trl.generation.vllm_generation.VLLMGeneration`: same constructor keywords, same 4-tuple."""

    instances: list = []
    completion_length = 4

    def __init__(self, model, accelerator, processing_class, **kwargs):
        self.model, self.kwargs, self.syncs, self.calls = model, kwargs, 0, []
        self.max_completion_length = kwargs["max_completion_length"]
        self.llm_factory = ppo_vllm.trl_vllm.__dict__.get("LLM")  # what the helper would build its engine with
        self.llm = FakeLLM() if kwargs["mode"] == "colocate" else None
        self.eos = processing_class.eos_token_id
        FakeGeneration.instances.append(self)

    def sync_weights(self):
        self.syncs += 1

    def generate(self, prompts, images, num_generations):
        self.calls.append((prompts, self.max_completion_length))
        n = min(self.completion_length, self.max_completion_length)
        completions = [[20 + i + t for t in range(n)] for i in range(len(prompts))]
        if len(prompts) > 1:
            completions[1][1] = self.eos  # sample 1 ends early: trimmed after its EOS
        logprobs = [[[-0.1 * (i + 1) - 0.01 * t] for t in range(n)] for i in range(len(prompts))]
        logprobs[0][0] = [None]  # vLLM's NaN log-prob arrives as None
        if self.llm is not None:
            self.llm.generate([{"prompt_token_ids": p} for p in prompts])
        return prompts, completions, logprobs, None


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeGeneration.instances = []
    monkeypatch.setattr(ppo_vllm, "VLLMGeneration", FakeGeneration)
    return FakeGeneration


def _trainer(tmp_path, tokenizer, family="qwen2", **kw):
    path = save_tiny(tmp_path / "policy", build_causal_lm(family, tokenizer, seed=0), tokenizer)
    args = tiny_ppo_args(tmp_path / "out", **{"max_new_tokens": 6, "use_vllm": True, **kw})
    return PPOTrainer(path, args=args, processing_class=tokenizer)


def test_vllm_rollout_carries_responses_and_sampler_logprobs(tmp_path, tokenizer, fake_vllm):
    trainer = _trainer(tmp_path, tokenizer, vllm_gpu_memory_utilization=0.25, temperature=0.7, top_k=5)
    (gen,) = fake_vllm.instances
    assert gen.model is trainer.unwrapped().policy
    assert gen.kwargs["mode"] == "colocate" and gen.kwargs["gpu_memory_utilization"] == 0.25
    assert (gen.kwargs["temperature"], gen.kwargs["top_k"], gen.kwargs["logprobs"]) == (0.7, 5, 0)
    rollout = trainer.generate(QUERIES, return_prompt=False)
    assert gen.calls[0][0] == [q.tolist() for q in QUERIES]
    assert [r.tolist() for r in rollout] == [[20, 21, 22, 23], [21, tokenizer.eos_token_id], [22, 23, 24, 25]] + [
        [23, 24, 25, 26]
    ]
    assert math.isnan(rollout.sampler_logprobs[0][0])
    torch.testing.assert_close(rollout.sampler_logprobs[1], torch.tensor([-0.2, -0.21]))  # cut with its response
    assert rollout.routing is None and not rollout.with_prompt
    with_prompt = trainer.generate(QUERIES)
    assert with_prompt.with_prompt and with_prompt[0].tolist() == [5, 6, 20, 21, 22, 23]
    assert gen.syncs == 1  # the same PPO step: the weights are synced once
    trainer.step(QUERIES, rollout, scores=[1.0, 0.0, 1.0, 0.0])
    trainer.generate(QUERIES)
    assert gen.syncs == 2  # the policy changed: synced again


def test_vllm_logprobs_feed_the_decoupled_loss_and_the_mismatch_monitor(tmp_path, tokenizer, fake_vllm, monkeypatch):
    seen = {}
    real = ppo_step_rewards.mismatch_stats

    def spy(behav, prox, mask, gather=None):
        seen["behav"], seen["prox"] = behav.clone(), prox.clone()
        return real(behav, prox, mask, gather=gather)

    monkeypatch.setattr(ppo_step_rewards, "mismatch_stats", spy)
    trainer = _trainer(tmp_path, tokenizer, use_decoupled_loss=True, token_filter="icepop")
    rollout = trainer.generate(QUERIES, return_prompt=False)
    stats = trainer.step(QUERIES, rollout, scores=[1.0, 0.0, 1.0, 0.0])
    for i, row in enumerate(rollout.sampler_logprobs):
        # vLLM's missing log-prob (NaN) takes the rollout pass's value: weight 1 instead of a NaN loss
        expected = torch.where(torch.isnan(row), seen["prox"][i, : len(row)], row)
        torch.testing.assert_close(seen["behav"][i, : len(row)], expected)
    assert math.isfinite(stats["loss/total"])
    assert any(k.startswith("mismatch/") for k in stats), sorted(stats)


def test_length_sampler_sets_vllms_cap(tmp_path, tokenizer, fake_vllm):
    trainer = _trainer(tmp_path, tokenizer, min_new_tokens=2, max_new_tokens=2)
    rollout = trainer.generate(QUERIES, return_prompt=False)
    assert fake_vllm.instances[0].calls[0][1] == 2 and all(len(r) <= 2 for r in rollout)
    with pytest.raises(ValueError, match="set sampling on PPOConfig"):
        trainer.generate(QUERIES, top_p=0.5)


def test_colocate_needs_a_named_policy(tmp_path, tokenizer, fake_vllm):
    args = tiny_ppo_args(tmp_path, mini_batch_size=4, use_vllm=True)
    with pytest.raises(ValueError, match="starts vLLM from the policy's name or path"):
        PPOTrainer(build_causal_lm("qwen2", tokenizer), args=args, processing_class=tokenizer)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(vllm_mode="remote"), "vllm_mode must be one of"),
        (dict(use_vllm=True, vllm_gpu_memory_utilization=0.0), "vllm_gpu_memory_utilization"),
        (dict(use_vllm=True, routing_replay="R3", vllm_mode="server"), "returns no routed experts"),
        (dict(use_vllm=True, load_in_8bit=True), "load_in_8bit"),
    ],
)
def test_vllm_config_validation(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(output_dir=str(tmp_path), **fields)


def _fake_vllm_module(monkeypatch, version, routed):
    @dataclass
    class EngineArgs:
        model: str = ""

    @dataclass
    class CompletionOutput:
        token_ids: list = None

    if routed:
        EngineArgs = dataclass(
            type(
                "EngineArgs",
                (EngineArgs,),
                {"__annotations__": {"enable_return_routed_experts": bool}, "enable_return_routed_experts": False},
            )
        )  # noqa: E501
        CompletionOutput = dataclass(
            type(
                "CompletionOutput",
                (CompletionOutput,),
                {"__annotations__": {"routed_experts": object}, "routed_experts": None},
            )
        )  # noqa: E501
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.__version__, vllm.EngineArgs = version, EngineArgs
    outputs = types.ModuleType("vllm.outputs")
    outputs.__spec__ = importlib.machinery.ModuleSpec("vllm.outputs", None)
    outputs.CompletionOutput = CompletionOutput
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.outputs", outputs)


def test_r3_refused_naming_the_vllm_version(tmp_path, tokenizer, fake_vllm, monkeypatch):
    _fake_vllm_module(monkeypatch, "0.10.9", routed=False)
    with pytest.raises(ValueError, match=r"vLLM 0\.10\.9 does not return routed experts .*EngineArgs\.enable_return"):
        _trainer(tmp_path, tokenizer, "qwen2_moe", routing_replay="R3")


def test_r3_refused_without_vllm(tmp_path, tokenizer, fake_vllm, monkeypatch):
    monkeypatch.setattr(ppo_vllm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="vLLM is not installed"):
        _trainer(tmp_path, tokenizer, "qwen2_moe", routing_replay="R3")


def test_r3_takes_vllms_routed_experts(tmp_path, tokenizer, fake_vllm, monkeypatch):
    _fake_vllm_module(monkeypatch, "0.99.0", routed=True)

    def engine(**kwargs):
        return kwargs

    monkeypatch.setattr(ppo_vllm.trl_vllm, "LLM", engine, raising=False)
    trainer = _trainer(tmp_path, tokenizer, "qwen2_moe", routing_replay="R3")
    (gen,) = fake_vllm.instances
    assert gen.llm_factory(model="m") == {"model": "m", "enable_return_routed_experts": True}
    assert ppo_vllm.trl_vllm.LLM is engine  # the patch lasts for the helper's construction only
    rollout = trainer.generate(QUERIES, return_prompt=False)
    for q, r, route in zip(QUERIES, rollout, rollout.routing):
        tokens = len(q) + FakeGeneration.completion_length
        expected = torch.arange(tokens * 4).reshape(tokens, 2, 2) % 4
        torch.testing.assert_close(route, expected[: len(q) + len(r)])
    assert "generate" not in vars(gen.llm)  # the capture patch is undone
    stats = trainer.step(QUERIES, rollout, scores=[1.0, 0.0, 1.0, 0.0])
    assert 0.0 <= stats["routing/rollout_agreement"] <= 1.0  # the rollout pass replayed vLLM's routing
