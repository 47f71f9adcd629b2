"""trl_stable.compat.relc: RELC's TRL 0.x names and signatures, and a RELC-shaped script on 1 and 2 processes."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from trl_stable.compat import relc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewards"))
from fake_openai_server import FakeOpenAIServer, status  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainers"))
from two_processes import free_port  # noqa: E402

SCRIPT = Path(__file__).with_name("relc_shaped_script.py")
REPO = Path(__file__).resolve().parents[2]

# The signatures of RELC's fork (google-research relc/llm-intrinsic-reward/trl), written from reading its code.
RELC_SIGNATURES = {
    "PPOTrainer.__init__": [
        "self", "config", "model", "ref_model", "tokenizer", "dataset", "optimizer", "data_collator",
        "num_shared_layers", "lr_scheduler",
    ],
    "PPOTrainer.generate": ["self", "query_tensor", "length_sampler", "batch_size", "return_prompt"],
    "PPOTrainer.step": ["self", "queries", "responses", "scores", "response_masks"],
    "PPOTrainer.log_stats": ["self", "stats", "batch", "rewards", "columns_to_log"],
    "PPOTrainer.save_pretrained": ["self", "save_directory"],
    "create_reference_model": ["model", "num_shared_layers", "pattern"],
    "query_batch_span": ["queries", "max_workers", "max_tokens", "api_key"],
    "set_seed": ["seed"],
    "LengthSampler.__init__": ["self", "min_value", "max_value"],
}  # fmt: skip
RELC_DEFAULTS = {
    "generate": {"length_sampler": None, "batch_size": 4, "return_prompt": True},
    "query_batch_span": {"max_workers": 2, "max_tokens": 600, "api_key": None},
}
RELC_CONFIG = {
    "model_name": None, "query_dataset": None, "reward_model": None, "steps": 20000, "learning_rate": 1e-5,
    "adap_kl_ctrl": True, "init_kl_coef": 0.2, "kl_penalty": "kl", "target": 6, "horizon": 10000, "gamma": 1,
    "lam": 0.95, "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1, "batch_size": 256,
    "forward_batch_size": None, "mini_batch_size": 1, "gradient_accumulation_steps": 1, "ppo_epochs": 4,
    "remove_unused_columns": True, "log_with": None, "tracker_kwargs": {}, "accelerator_kwargs": {},
    "project_kwargs": {}, "tracker_project_name": "trl", "max_grad_norm": None, "seed": 0,
    "optimize_cuda_cache": False, "early_stopping": False, "target_kl": 1, "push_to_hub_if_best_kwargs": {},
    "compare_steps": 1, "ratio_threshold": 10.0, "use_score_scaling": False, "use_score_norm": False,
    "score_clip": None,
}  # fmt: skip
# every name RELC's sentiment, toxicity (+ PEFT) and summarization scripts import from the fork
RELC_IMPORTS = [
    "AutoModelForCausalLMWithValueHead", "AutoModelForSeq2Seq", "PPOConfig", "PPOTrainer", "create_reference_model",
    "set_seed", "LengthSampler", "query_batch_span", "RobertaHateSpeechDetector", "PerspectiveAPI",
]  # fmt: skip


def _params(fn):
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("name", sorted(RELC_SIGNATURES))
def test_signatures_match_relc(name):
    obj = relc
    for part in name.split("."):
        obj = getattr(obj, part)
    assert _params(obj)[: len(RELC_SIGNATURES[name])] == RELC_SIGNATURES[name]


def test_defaults_and_config_fields_match_relc():
    for fn, defaults in (
        (relc.PPOTrainer.generate, RELC_DEFAULTS["generate"]),
        (relc.query_batch_span, RELC_DEFAULTS["query_batch_span"]),
    ):
        sig = inspect.signature(fn)
        assert {k: sig.parameters[k].default for k in defaults} == defaults
    config = relc.PPOConfig()
    assert {k: getattr(config, k) for k in RELC_CONFIG} == RELC_CONFIG
    assert config.backward_batch_size == 1 and config.total_ppo_epochs == 79  # ceil(20000 / 256)
    assert all(hasattr(relc, n) for n in RELC_IMPORTS) and set(RELC_IMPORTS) <= set(relc.__all__)
    assert dataclasses.is_dataclass(relc.PPOConfig)  # tyro builds RELC's --ppo_config.* flags from the fields


def test_config_translates_to_trl_stable():
    config = relc.PPOConfig(batch_size=8, mini_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=None)
    stable = config.to_trl_stable(output_dir="unused")
    assert (stable.batch_size, stable.mini_batch_size, stable.gradient_accumulation_steps) == (8, 2, 2)
    assert stable.max_grad_norm == 0.0 and stable.early_stopping is False and stable.target_kl is None
    early = relc.PPOConfig(early_stopping=True, target_kl=0.5, adap_kl_ctrl=False, target=3).to_trl_stable("unused")
    assert (early.target_kl, early.adap_kl_ctrl, early.target) == (0.5, False, 6.0)  # old TRL ignored target=3
    assert stable.learning_rate == 1e-5 and stable.report_to == []
    with pytest.raises(ValueError, match="multiple"):
        relc.PPOConfig(batch_size=6, mini_batch_size=4)


def test_length_sampler_upper_bound_is_exclusive():
    torch.manual_seed(0)
    sampler = relc.LengthSampler(2, 4)
    assert {sampler() for _ in range(200)} == {2, 3}
    with pytest.raises(ValueError, match="exclusive"):
        relc.LengthSampler(3, 3)


def test_value_head_model_and_reference(tokenizer):
    from trl_stable.testing import build_causal_lm

    relc.set_seed(0)
    model = relc.AutoModelForCausalLMWithValueHead.from_pretrained(build_causal_lm("qwen2", tokenizer, seed=0))
    ids = torch.tensor([[5, 6, 7]])
    logits, _, value = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert logits.shape[:2] == (1, 3) and value.shape == (1, 3)
    ref = relc.create_reference_model(model, num_shared_layers=1)
    assert isinstance(ref, relc.AutoModelForCausalLMWithValueHead)
    assert not any(p.requires_grad for p in ref.parameters())
    shared = ref.pretrained_model.model.layers[0].self_attn.q_proj.weight
    assert shared is model.pretrained_model.model.layers[0].self_attn.q_proj.weight
    assert ref.pretrained_model.model.layers[1].self_attn.q_proj.weight is not (
        model.pretrained_model.model.layers[1].self_attn.q_proj.weight
    )
    with pytest.raises(NotImplementedError):
        relc.AutoModelForSeq2Seq.from_pretrained("t5-small")


def test_step_maps_relc_token_rewards_to_response_tokens(tokenizer, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # RELC's config has no output_dir: the default one is relative
    from trl_stable.testing import build_causal_lm
    from trl_stable.trainers.ppo import PPOTrainer as StablePPOTrainer

    model = relc.AutoModelForCausalLMWithValueHead.from_pretrained(build_causal_lm("qwen2", tokenizer, seed=0))
    trainer = relc.PPOTrainer(relc.PPOConfig(batch_size=2, mini_batch_size=2), model, None, tokenizer)
    seen = {}
    monkeypatch.setattr(StablePPOTrainer, "step", lambda self, q, r, **kw: seen.update(kw) or {})
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    responses = [torch.tensor([10, 11]), torch.tensor([12, 13, 14])]
    # RELC's rows: one per predicted token of query + response (len(q) + len(r) - 1); the last len(r) are the
    # response tokens, the rest sits on query positions the fork masked out
    rows = [torch.tensor([9.0, 9.0, 0.5, 1.0]), torch.tensor([9.0, 0.0, -1.0, 2.0])]
    trainer.step(queries, responses, rows)
    assert [t.tolist() for t in seen["token_rewards"]] == [[0.5, 1.0], [0.0, -1.0, 2.0]]
    trainer.step(queries, responses, [torch.tensor(0.25), torch.tensor(-1.0)])
    assert seen["scores"] == [0.25, -1.0]
    trainer.step(queries, responses, [torch.tensor([9.0, 0.0, 3.0, 4.0]), torch.tensor(1.5)])
    assert [t.tolist() for t in seen["token_rewards"]] == [[3.0, 4.0], [0.0, 0.0, 1.5]]
    with pytest.raises(ValueError, match=r"len\(query\) \+ len\(response\) - 1 = 4"):
        trainer.step(queries, responses, [torch.zeros(2), torch.zeros(4)])
    # a single query: old TRL's [1, len] tensor, prompt included by default
    out = trainer.generate(queries[0], max_new_tokens=3, min_length=-1, top_k=0.0)
    assert out.dim() == 2 and out[0, :3].tolist() == [5, 6, 7]


def test_query_batch_span_through_the_critic_backend(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    with FakeOpenAIServer(answer=lambda prompt: "Toxic Span 1: " + prompt.split(":")[-1].strip()) as server:
        server.script(status(400, match="broken"))  # a 4xx fails at once: a failed call
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            relc._warned.discard("failed_call")
            out = relc.query_batch_span(["q: idiot", "q: broken", "q: fool"], max_workers=2, max_tokens=20)
        assert out == ["Toxic Span 1: idiot", None, "Toxic Span 1: fool"]
        assert any("1 of 3 critic calls failed" in str(w.message) for w in caught)
        assert {r.body["max_tokens"] for r in server.received} == {20}
        assert {r.body["model"] for r in server.received} == {"gpt-3.5-turbo"}
        server.script(status(400, match="broken"))
        assert relc.query_batch_span(["q: broken"], failed_as="") == [""]


def _run_script(tmp_path, server, two_processes):
    env = {
        **os.environ,
        "OPENAI_BASE_URL": server.base_url,
        "OPENAI_API_KEY": "test-key",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, str(SCRIPT), str(tmp_path)]
    if two_processes:
        env["ACCELERATE_USE_CPU"] = "true"
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), str(SCRIPT), str(tmp_path),
        ]  # fmt: skip
    try:
        # the limit only turns a hang (e.g. a save that waits on a barrier) into a failure with its output
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the RELC-shaped script hung; stderr tail:\n{(exc.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    n = 2 if two_processes else 1
    return [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in range(n)]


def _check_run(tmp_path, results, server):
    world = len(results)
    main = results[0]
    assert [r["world"] for r in results] == [world] * world
    assert all(r["head_is_model_head"] for r in results)  # the optimizer built over model.parameters() trains it
    assert len(main["stats"]) == 2 and all(s["loss/value"] > 0 for s in main["stats"])
    assert main["spans"] == ["Negative span: plot"] * 8
    assert len(server.received) == 8 * world  # 4 samples x 2 steps per process, each one critic call
    for step in ("step_0", "step_1", "final"):
        assert (tmp_path / step / "value_head.safetensors").is_file()
        assert (tmp_path / step / "config.json").is_file()
    # log_stats: the reward statistics of every process, the same on each
    table = main["game_log"]
    assert table is not None and len(table["reward"]) == 4 * world and len(table["query"]) == 4 * world
    mean = sum(table["reward"]) / len(table["reward"])
    assert main["reward_logs"][-1]["env/reward_mean"] == pytest.approx(mean, abs=1e-6)
    assert mean > 0  # 0.1 per word of query + response
    for other in results[1:]:
        assert other["game_log"] is None  # only the main process keeps tables
        assert other["reward_logs"][-1]["env/reward_mean"] == pytest.approx(mean, abs=1e-6)
        assert other["policy_sum"] == pytest.approx(main["policy_sum"], rel=1e-9)  # DDP kept them in sync


@pytest.fixture
def critic_server():
    with FakeOpenAIServer(answer=lambda prompt: "Negative span: plot") as server:
        yield server


def test_relc_shaped_script_one_process(tmp_path, critic_server):
    _check_run(tmp_path, _run_script(tmp_path, critic_server, two_processes=False), critic_server)


def test_relc_shaped_script_two_processes_saves_under_is_main_process(tmp_path, critic_server):
    _check_run(tmp_path, _run_script(tmp_path, critic_server, two_processes=True), critic_server)


def test_train_logs_a_completions_table(tmp_path, tokenizer):
    from datasets import Dataset

    from trl_stable import PPOConfig, PPOTrainer
    from trl_stable.testing import build_causal_lm

    args = PPOConfig(output_dir=str(tmp_path), batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=3,
                     max_steps=1, report_to="none", disable_tqdm=True, save_strategy="no")  # fmt: skip
    ds = Dataset.from_dict({"prompt": ["The movie", "A story"]})
    trainer = PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=lambda completion_ids, **kw: [float(len(c)) for c in completion_ids],
        args=args,
        processing_class=tokenizer,
        train_dataset=ds,
    )
    trainer.train()
    table = trainer.tables["completions"]
    assert sorted(table["prompt"]) == ["A story", "The movie"] and table["step"] == [1, 1]
    assert all(r in (1.0, 2.0, 3.0) for r in table["reward"]) and len(table["completion"]) == 2
