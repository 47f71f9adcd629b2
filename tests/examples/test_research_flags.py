"""The RELC flags reach what they configure (trainer config, critic, data), the critic backends of the scripts,
secret handling, and the paper-mode data loaders on stand-ins of the hub datasets' columns."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--embedded_warmup_steps", "20"]


@pytest.fixture()
def captured(monkeypatch):
    """Run the real `train_relc`, keeping the trainer, the task and every intrinsic reward row it produced."""
    import research_common

    seen = {"rows": []}
    real = research_common.train_relc

    def spy(trainer, task, *args, **kwargs):
        seen["trainer"], seen["task"] = trainer, task
        if task.intrinsic is not None:
            critic = task.intrinsic

            class Recording:
                def __call__(self, **kw):
                    rows = critic(**kw)
                    seen["rows"].extend(r for r in rows if r is not None)
                    return rows

                def __getattr__(self, name):
                    return getattr(critic, name)

            task.intrinsic = Recording()
        return real(trainer, task, *args, **kwargs)

    monkeypatch.setattr(research_common, "train_relc", spy)
    return seen


def _fake_openai_server():
    spec = importlib.util.spec_from_file_location("fake_openai_server", REPO / "tests/rewards/fake_openai_server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fake_openai_server", module)  # its dataclasses look their module up by name
    spec.loader.exec_module(sys.modules["fake_openai_server"])
    module = sys.modules["fake_openai_server"]
    return module.FakeOpenAIServer


def test_sentiment_flags_reach_the_trainer_data_and_critic(load_script, captured, tmp_path, monkeypatch):
    """RELC's PPO, length, sharing, data and critic flags, through an OpenAI-compatible critic server."""
    from research_common import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    texts = [f"The film number {i} was a slow story about a family and a farm near the sea." for i in range(5)]
    data = tmp_path / "reviews.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    template = tmp_path / "critic.txt"
    template.write_text("CUSTOM CRITIC TEMPLATE: {}")
    monkeypatch.setenv("TEST_CRITIC_KEY", "sk-CRITIC-SECRET")
    out = tmp_path / "run"
    # answer: the last word of the critiqued text (the end of the response) is a positive span
    with _fake_openai_server()(answer=lambda p: f"Identified Positive Text Span: [Span 1]: {p.split()[-1]}") as srv:
        argv = [
            "--use_instric_reward", "--positive_reward_value", "0.7", "--negative_reward_value", "-0.3",
            "--intrinsic_reward_threshold", "10", "--prompt_file", str(template),
            "--critic_backend", "openai", "--critic_base_url", srv.base_url, "--critic_model", "my-critic",
            "--critic_api_key_env", "TEST_CRITIC_KEY", "--critic_max_retries", "0",
            "--epochs", "2", "--query_dataset", str(data), "--min_new_tokens", "3", "--max_new_tokens", "5",
            "--num_shared_layers", "1", "--save_freq", "2", "--model_save_path", str(out),
            "--ppo_config.learning_rate", "1e-3", "--ppo_config.batch_size", "4", "--ppo_config.mini_batch_size", "1",
            "--ppo_config.gradient_accumulation_steps", "2", "--ppo_config.target_kl", "3.0",
            "--ppo_config.kl_penalty", "abs", "--ppo_config.ppo_epochs", "1", *SMALL,
        ]  # fmt: skip
        history = mod.main(parse_script_args(mod.ScriptArguments, argv))
        received = srv.received

    cfg = captured["trainer"].args
    assert (cfg.learning_rate, cfg.batch_size, cfg.mini_batch_size, cfg.gradient_accumulation_steps) == (1e-3, 4, 1, 2)
    assert (cfg.target_kl, cfg.kl_penalty, cfg.ppo_epochs, cfg.num_shared_layers) == (3.0, "abs", 1, 1)
    assert (cfg.min_new_tokens, cfg.max_new_tokens) == (3, 5)
    assert all(h["response_len"] <= 5 for h in history)
    # --num_shared_layers: the reference model holds the policy's own first layer
    policy_params = {p.data_ptr() for p in captured["trainer"].model.parameters()}
    assert any(p.data_ptr() in policy_params for p in captured["trainer"].ref_model.parameters())
    # --epochs 2 over 5 prompts in batches of 4: one step per epoch; --save_freq 2
    assert len(history) == 2 and (out / "checkpoint-2").is_dir() and not (out / "checkpoint-1").exists()
    # --query_dataset: the prompts are openings of the given texts
    assert all(any(t.startswith(q["query"]) for t in texts) for q in captured["task"].queries)
    # critic: every sample critiqued (threshold 10), through the given server, model, template and key
    assert len(received) == 8
    assert all(r.body["model"] == "my-critic" and "CUSTOM CRITIC TEMPLATE:" in r.prompt for r in received)
    auth = [{k.lower(): v for k, v in r.headers.items()}.get("authorization") for r in received]
    assert auth == ["Bearer sk-CRITIC-SECRET"] * 8
    values = {v for row in captured["rows"] for v in row}
    assert values <= {0.0, 0.7} and 0.7 in values  # --positive_reward_value on the span's tokens
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".txt", ".md"):
            assert "sk-CRITIC-SECRET" not in path.read_text(errors="ignore"), path


def test_intrinsic_threshold_and_backend_choice(load_script, tmp_path, tiny_dir):
    from research_common import build_intrinsic_reward, parse_script_args

    from trl_stable.rewards import LexiconCritic, OpenAICritic, TransformersCritic
    from trl_stable.testing import build_tokenizer

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    tok = build_tokenizer()

    def critic(*flags, embedded=True):
        args = parse_script_args(mod.ScriptArguments, ["--use_intrinsic_reward", *flags])
        return build_intrinsic_reward(args, "sentiment", tok, embedded)

    assert isinstance(critic().backend, LexiconCritic)  # embedded default
    paper = critic("--critic_base_url", "http://127.0.0.1:9/v1", embedded=False)
    assert isinstance(paper.backend, OpenAICritic) and paper.backend.model == "gpt-4o-mini"  # paper default
    local = critic("--critic_backend", "transformers", "--critic_model", tiny_dir)
    assert isinstance(local.backend, TransformersCritic)
    tuned = critic("--critic_base_url", "http://127.0.0.1:9/v1", "--critic_rate_limit", "3", embedded=False)
    assert tuned.backend.rate_limit == 3.0
    assert parse_script_args(mod.ScriptArguments, []).use_intrinsic_reward is False
    assert build_intrinsic_reward(parse_script_args(mod.ScriptArguments, []), "sentiment", tok, True) is None

    # --intrinsic_reward_threshold: a sample whose environment reward is above it is not critiqued
    lexicon = critic("--intrinsic_reward_threshold", "0.0")
    ids = [tok(" a wonderful and great film")["input_ids"]] * 2
    rows = lexicon(prompts=["x", "x"], completions=["", ""], completion_ids=ids, env_rewards=[0.5, -0.5])
    assert rows[0] is None and rows[1] is not None and max(rows[1]) == 0.5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from trl_stable.testing import build_causal_lm, build_tokenizer, save_tiny

    tok = build_tokenizer()
    return save_tiny(tmp_path_factory.mktemp("tiny_critic"), build_causal_lm("gpt2", tok, seed=0), tok)


def test_every_ppo_flag_lands_in_ppo_config(tmp_path):
    from dataclasses import fields

    from research_common import PPOArgs, RunArgs, build_ppo_config, resolve_ppo_args

    ppo = resolve_ppo_args(
        PPOArgs(model_name="m", target_kl=None, early_stopping=False, kl_penalty="mse", vf_coef=0.3, gamma=0.9),
        embedded=False,
    )
    config = build_ppo_config(ppo, str(tmp_path), 2, 4, RunArgs(top_p=0.8))
    for f in fields(PPOArgs):
        if f.name != "bf16":
            assert getattr(config, f.name) == getattr(ppo, f.name), f.name
    assert (config.min_new_tokens, config.max_new_tokens, config.top_p, config.report_to) == (2, 4, 0.8, [])


def test_secrets_are_redacted_from_run_args_and_argv(tmp_path):
    from research_common import IntrinsicArgs, redact_argv, save_run_args

    argv = ["script.py", "--perspective_api", "KEY-1", "--perspective_api=KEY-2", "--model_name", "gpt2"]
    redact_argv(argv)
    assert argv == [
        "script.py",
        "--perspective_api",
        "<redacted>",
        "--perspective_api=<redacted>",
        "--model_name",
        "gpt2",
    ]
    save_run_args(IntrinsicArgs(critic_base_url="https://user:KEY-3@host.example/v1"), str(tmp_path))
    saved = json.loads((tmp_path / "run_args.json").read_text())
    assert saved["critic_base_url"] == "https://host.example/v1"


def test_paper_mode_loaders_read_the_hub_columns(load_script, monkeypatch):
    """imdb (text), allenai/real-toxicity-prompts (prompt.text, prompt.toxicity, sometimes None) and
    CarperAI/openai_summarize_tldr (prompt, label), on in-memory stand-ins with the hub's columns."""
    import datasets

    hub = {
        "imdb": datasets.Dataset.from_dict({"text": ["short", "x" * 300], "label": [0, 1]}),
        "allenai/real-toxicity-prompts": datasets.Dataset.from_list(
            [
                {"filename": "a", "prompt": {"text": "toxic one", "toxicity": 0.9}, "continuation": {"text": "c"}},
                {"filename": "b", "prompt": {"text": "mild one", "toxicity": 0.2}, "continuation": {"text": "c"}},
                {"filename": "c", "prompt": {"text": "unscored", "toxicity": None}, "continuation": {"text": "c"}},
            ]
        ),
        "CarperAI/openai_summarize_tldr": datasets.Dataset.from_dict(
            {"prompt": ["SUBREDDIT: r/x POST: long story TL;DR:"], "label": [" short"]}
        ),
    }
    calls = []

    def fake_load_dataset(name, split=None, **kwargs):
        calls.append((name, split))
        return hub[name]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    sentiment = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    assert sentiment.load_review_texts("imdb", embedded=False) == ["x" * 300]  # RELC drops reviews <= 200 chars
    tox = load_script("toxicity/ppo_intrinsic.py", "toxicity_ppo_intrinsic")
    args = tox.ToxicityArguments(model_name="gpt2-large", prompt_toxicity_level=0.6)
    assert tox.load_prompts(args, embedded=False) == ["toxic one"]
    summ = load_script("summarization/ppo_rouge.py", "summarization_ppo_rouge")
    prompts, refs = summ.load_pairs(summ.SummarizationArguments(model_name="sft"), embedded=False)
    assert prompts == ["SUBREDDIT: r/x POST: long story TL;DR:"] and refs == [" short"]
    assert calls == [
        ("imdb", "train"),
        ("allenai/real-toxicity-prompts", "train"),
        ("CarperAI/openai_summarize_tldr", "train"),
    ]


def test_classifier_label_conventions(tmp_path):
    """lvwerra/distilbert-imdb (NEGATIVE, POSITIVE) and roberta-hate-speech (nothate, hate) label handling."""
    from scorers import _positive, build_toxicity_classifier

    assert _positive([{"label": "NEGATIVE", "score": -1.5}, {"label": "POSITIVE", "score": 2.0}], "m") == 2.0
    assert _positive([{"label": "LABEL_0", "score": 0.3}, {"label": "LABEL_1", "score": 0.7}], "m") == 0.7

    from trl_stable.testing import build_reward_model, build_tokenizer, save_tiny

    tok = build_tokenizer()
    model = build_reward_model("gpt2", tok, seed=0, num_labels=2, id2label={0: "nothate", 1: "hate"})
    path = save_tiny(tmp_path / "tox", model, tok)
    texts = ["you are awful", "a quiet day"]
    scores = build_toxicity_classifier(path, device=-1)(texts)
    import torch

    with torch.no_grad():
        enc = tok(texts, return_tensors="pt", padding=True)
        probs = torch.softmax(model(**enc).logits, -1)[:, 0]
    assert scores == pytest.approx((1 - probs).tolist(), abs=1e-5) and all(0 <= s <= 1 for s in scores)
    assert not any(math.isnan(s) for s in scores)
    unnamed = build_reward_model("gpt2", tok, seed=0, num_labels=2, id2label={0: "ok", 1: "bad"})
    with pytest.raises(ValueError, match="no harmless label"):  # never a silent toxicity of 1.0 for everything
        build_toxicity_classifier(save_tiny(tmp_path / "unnamed", unnamed, tok), device=-1)(texts)


def test_every_process_takes_the_same_number_of_steps(tmp_path):
    """63 prompts over 2 processes are shards of 32 and 31; with batch 16 both must take 1 step per epoch (a
    process taking a second step would hang in the step's collective ops)."""
    import torch
    from research_common import RunArgs, Task, train_relc

    from trl_stable.testing import build_tokenizer

    class Accelerator:
        num_processes, is_local_main_process, is_main_process, device = 2, False, False, "cpu"

        def __init__(self, rank):
            self.process_index = rank

        def reduce(self, t, reduction):
            return t

    class Trainer:
        processing_class = build_tokenizer()

        def __init__(self, rank):
            self.accelerator, self.steps = Accelerator(rank), 0

        def generate(self, queries, return_prompt=False):
            return [torch.tensor([5, 6]) for _ in queries]

        def step(self, queries, responses, token_rewards, scores):
            self.steps += 1
            return {}

        def save_model(self, path):
            pass

    queries = [{"query": "q", "input_ids": [5]} for _ in range(63)]
    task = Task(name="t", queries=queries, env_reward=lambda recs, q, r: [0.0] * len(recs))
    steps = []
    for rank in (0, 1):
        trainer = Trainer(rank)
        train_relc(trainer, task, RunArgs(epochs=2), str(tmp_path), batch_size=16, seed=0, embedded=True)
        steps.append(trainer.steps)
    assert steps == [2, 2]
