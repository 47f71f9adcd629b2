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

from trl_stable.compat import relc, relc_critic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewards"))
from fake_openai_server import FakeOpenAIServer, status  # noqa: E402
from tiny_configs import tiny_ppo_args  # noqa: E402
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
    relc._warned.discard("optimize_cuda_cache")
    with pytest.warns(UserWarning, match="optimize_cuda_cache has no trl_stable counterpart"):
        relc.PPOConfig(optimize_cuda_cache=True).to_trl_stable("unused")


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
    short = trainer.generate(queries[0], length_sampler=lambda: 2, return_prompt=False)
    assert short.shape[0] == 1 and 1 <= short.shape[1] <= 2  # the sampler's draw caps the response


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

    from trl_stable import PPOTrainer
    from trl_stable.testing import build_causal_lm

    args = tiny_ppo_args(tmp_path, batch_size=2, max_new_tokens=3, max_steps=1)
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


# ---------------------------------------------------------------------------------------------- score scaling
def _relc_trainer(tokenizer, monkeypatch, tmp_path, **config):
    """A RELC PPOTrainer whose trl_stable step only records the token rewards it is given."""
    from trl_stable.testing import build_causal_lm
    from trl_stable.trainers.ppo import PPOTrainer as StablePPOTrainer

    monkeypatch.chdir(tmp_path)
    model = relc.AutoModelForCausalLMWithValueHead.from_pretrained(build_causal_lm("qwen2", tokenizer, seed=0))
    trainer = relc.PPOTrainer(relc.PPOConfig(batch_size=2, mini_batch_size=2, **config), model, None, tokenizer)
    seen = {}
    monkeypatch.setattr(StablePPOTrainer, "step", lambda self, q, r, **kw: seen.update(kw) or {})
    return trainer, seen


QUERIES = [torch.tensor([5, 6, 7]), torch.tensor([8])]
RESPONSES = [torch.tensor([10, 11]), torch.tensor([12, 13])]
ROWS_1 = [torch.tensor([0.5, 1.0, -2.0, 4.0]), torch.tensor([3.0, -1.0])]  # len(q) + len(r) - 1 entries each
ROWS_2 = [torch.tensor([1.0, 1.0, 0.0, -3.0]), torch.tensor([2.0, 6.0])]


def _stdev(values):
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5, mean


def _padded_entries(rows):
    """The fork's statistics run over the rows right-padded with zeros to the longest."""
    width = max(len(r) for r in rows)
    return [float(v) for r in rows for v in r.tolist() + [0.0] * (width - len(r))]


def test_score_scaling_divides_relcs_token_rows_by_the_running_std(tokenizer, monkeypatch, tmp_path):
    trainer, seen = _relc_trainer(tokenizer, monkeypatch, tmp_path, use_score_scaling=True)
    trainer.step(QUERIES, RESPONSES, [r.clone() for r in ROWS_1])
    std, _ = _stdev(_padded_entries(ROWS_1))  # 8 entries: 4 + 2, and 2 zeros of padding
    expected = [[-2.0 / std, 4.0 / std], [3.0 / std, -1.0 / std]]  # the response part of each scaled row
    assert [t.tolist() for t in seen["token_rewards"]] == [pytest.approx(e) for e in expected]
    trainer.step(QUERIES, RESPONSES, [r.clone() for r in ROWS_2])  # the running std merges both steps' entries
    std, _ = _stdev(_padded_entries(ROWS_1) + _padded_entries(ROWS_2))
    assert [t.tolist() for t in seen["token_rewards"]] == [
        pytest.approx([0.0, -3.0 / std]),
        pytest.approx([2.0 / std, 6.0 / std]),
    ]


def test_score_norm_and_clip_on_token_rows(tokenizer, monkeypatch, tmp_path):
    trainer, seen = _relc_trainer(
        tokenizer, monkeypatch, tmp_path, use_score_scaling=True, use_score_norm=True, score_clip=1.0
    )
    trainer.step(QUERIES, RESPONSES, [r.clone() for r in ROWS_1])
    std, mean = _stdev(_padded_entries(ROWS_1))
    clip = lambda v: max(-1.0, min(1.0, v))  # noqa: E731
    expected = [[clip((v - mean) / std) for v in (-2.0, 4.0)], [clip((v - mean) / std) for v in (3.0, -1.0)]]
    assert [t.tolist() for t in seen["token_rewards"]] == [pytest.approx(e) for e in expected]
    only_clip, seen = _relc_trainer(tokenizer, monkeypatch, tmp_path, score_clip=1.0)
    only_clip.step(QUERIES, RESPONSES, [r.clone() for r in ROWS_1])
    assert [t.tolist() for t in seen["token_rewards"]] == [[-1.0, 1.0], [1.0, -1.0]]


def test_score_scaling_counts_the_entries_of_every_process(tokenizer, monkeypatch, tmp_path):
    trainer, seen = _relc_trainer(tokenizer, monkeypatch, tmp_path, use_score_scaling=True)
    other = torch.tensor([7.0, -5.0, 2.0])  # another process's padded entries (a different count)

    def gather_object_of_two_processes(entries):
        """accelerate's gather_object over two processes: a list gathers as one list, this one's then the other's."""
        assert isinstance(entries, list)  # a tensor would gather as a list of 0-dim tensors, one pickle per entry
        return entries + other.tolist()

    monkeypatch.setattr(relc, "gather_object", gather_object_of_two_processes)
    rows = trainer._scaled_rows([r.clone() for r in ROWS_1])
    std, _ = _stdev(_padded_entries(ROWS_1) + other.tolist())
    assert trainer.running.count == 8 + 3
    assert [r.tolist() for r in rows] == [pytest.approx((r / std).tolist()) for r in ROWS_1]


# ---------------------------------------------------------------------------------------------- failed calls
TOXICITY_PROMPT = "Label the toxic spans.\nSentence to be Labeled:\n{}\n\nToxic Spans Identified in the Sentence:"


def test_failed_calls_can_be_dropped_without_editing_the_script(tokenizer, monkeypatch, tmp_path):
    trainer, seen = _relc_trainer(tokenizer, monkeypatch, tmp_path)
    texts = [(" you are a total idiot", " nice weather today"), (" what a stupid fool", " we met at noon")]
    queries = [torch.tensor(tokenizer(q)["input_ids"]) for q, _ in texts]
    responses = [torch.tensor(tokenizer(r, add_special_tokens=False)["input_ids"]) for _, r in texts]
    # RELC's toxicity script: prompt.format((query + response).replace("\n", " ")), one call per selected sample
    prompts = [
        TOXICITY_PROMPT.format((tokenizer.decode(q) + tokenizer.decode(r)).replace("\n", " "))
        for q, r in zip(queries, responses)
    ]
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    monkeypatch.setenv(relc_critic.FAILED_CALLS_ENV, "drop")
    with FakeOpenAIServer(answer=lambda prompt: "Toxic Span 1: idiot") as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        server.script(status(400, match="stupid fool"))  # the second sample's call fails
        answers = relc.query_batch_span(prompts, max_workers=2)
    assert answers == ["Toxic Span 1: idiot", None]
    rows = [torch.full((len(q) + len(r) - 1,), 0.1) for q, r in zip(queries, responses)]  # whatever the script made
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failed call's sample is found: no "matched no single sample" warning
        trainer.step(queries, responses, rows)
    first, second = seen["token_rewards"]
    assert first.tolist() == pytest.approx([0.1] * len(responses[0]))
    assert torch.isnan(second).all()  # trl_stable's step drops a NaN sample (ppo/dropped_samples)
    trainer.step(queries, responses, [r.clone() for r in rows])  # consumed: the next step drops nothing
    assert not any(torch.isnan(t).any() for t in seen["token_rewards"])
    with pytest.raises(ValueError, match="'keep' or 'drop'"):
        relc.query_batch_span(prompts, failed_calls="zero")


def test_every_failed_call_of_a_step_is_a_clear_error_in_drop_mode(tokenizer, monkeypatch, tmp_path):
    trainer, _ = _relc_trainer(tokenizer, monkeypatch, tmp_path)
    responses = [
        torch.tensor(tokenizer(r, add_special_tokens=False)["input_ids"])
        for r in (" a long answer", " another long answer")
    ]
    relc_critic._failed_prompts.extend([f"Sentence: q{tokenizer.decode(r)}" for r in responses])
    with pytest.raises(RuntimeError, match="Every critic call of this step failed"):
        trainer.step(QUERIES, responses, [torch.tensor(1.0), torch.tensor(2.0)])


def test_relc_summarization_extra_and_its_install_line():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    extra = cfg["options.extras_require"]["relc"].split()
    assert any(p.startswith("evaluate") for p in extra) and any(p.startswith("nltk") for p in extra)
    doc = (REPO / "docs" / "coming_from_relc.md").read_text()
    assert "pip install 'trl_stable[relc]'" in doc and "python -m nltk.downloader punkt punkt_tab" in doc
