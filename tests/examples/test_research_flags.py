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
    """Run a script's real loop, keeping its trainer, prompt records and every intrinsic reward row of its critic."""
    seen = {"rows": []}

    def spy_on(module):
        trainer_cls, build, batches_cls = module.PPOTrainer, module.build_intrinsic_reward, module.PromptBatches

        class Trainer(trainer_cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                seen["trainer"] = self

        def build_intrinsic_reward(*args, **kwargs):
            critic = build(*args, **kwargs)

            class Recording:
                def __call__(self, **kw):
                    rows = critic(**kw)
                    seen["rows"].extend(r for r in rows if r is not None)
                    return rows

                def __getattr__(self, name):
                    return getattr(critic, name)

            return None if critic is None else Recording()

        class PromptBatches(batches_cls):
            def __init__(self, records, *args, **kwargs):
                seen["queries"] = records
                super().__init__(records, *args, **kwargs)

        monkeypatch.setattr(module, "PPOTrainer", Trainer)
        monkeypatch.setattr(module, "build_intrinsic_reward", build_intrinsic_reward)
        monkeypatch.setattr(module, "PromptBatches", PromptBatches)

    seen["spy_on"] = spy_on
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
    from script_args import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    captured["spy_on"](mod)
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
            "--intrinsic_reward_max_sum", "None",  # RELC's unbounded values (the embedded default bounds the sum)
        ]  # fmt: skip
        history = mod.main(parse_script_args(mod.ScriptArguments, argv))
        received = srv.received

    cfg = captured["trainer"].args
    assert (cfg.learning_rate, cfg.batch_size, cfg.mini_batch_size, cfg.gradient_accumulation_steps) == (1e-3, 4, 1, 2)
    assert (cfg.target_kl, cfg.kl_penalty, cfg.ppo_epochs, cfg.num_shared_layers) == (3.0, "abs", 1, 1)
    assert (cfg.min_new_tokens, cfg.max_new_tokens) == (3, 4)  # RELC's flags: the upper bound is excluded
    assert all(h["response_len"] <= 4 for h in history)
    # --num_shared_layers: the reference model holds the policy's own first layer
    policy_params = {p.data_ptr() for p in captured["trainer"].policy.parameters()}
    assert any(p.data_ptr() in policy_params for p in captured["trainer"].ref_model.parameters())
    # --epochs 2 over 5 prompts in batches of 4: one step per epoch; --save_freq 2
    assert len(history) == 2 and (out / "checkpoint-2").is_dir() and not (out / "checkpoint-1").exists()
    # --query_dataset: the prompts are openings of the given texts
    assert all(any(t.startswith(q["query"]) for t in texts) for q in captured["queries"])
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
    from critic_rewards import build_intrinsic_reward
    from script_args import parse_script_args

    from trl_stable.rewards import LexiconCritic, OpenAICritic, TransformersCritic
    from trl_stable.testing import build_tokenizer

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    tok = build_tokenizer()

    def critic(*flags, embedded=True):
        paper = [] if embedded else ["--ppo_config.model_name", "gpt2-large"]
        args = parse_script_args(mod.ScriptArguments, ["--use_intrinsic_reward", *flags, *paper])
        return build_intrinsic_reward(args.critic, "sentiment", tok)

    assert isinstance(critic().backend, LexiconCritic)  # embedded default
    paper = critic("--critic_base_url", "http://127.0.0.1:9/v1", embedded=False)
    assert isinstance(paper.backend, OpenAICritic) and paper.backend.model == "gpt-4o-mini"  # paper default
    local = critic("--critic_backend", "transformers", "--critic_model", tiny_dir)
    assert isinstance(local.backend, TransformersCritic)
    tuned = critic("--critic_base_url", "http://127.0.0.1:9/v1", "--critic_rate_limit", "3", embedded=False)
    assert tuned.backend.rate_limit == 3.0
    assert parse_script_args(mod.ScriptArguments, []).critic.use_intrinsic_reward is False
    assert build_intrinsic_reward(parse_script_args(mod.ScriptArguments, []).critic, "sentiment", tok) is None

    # --intrinsic_reward_threshold: a sample whose environment reward is above it is not critiqued
    lexicon = critic("--intrinsic_reward_threshold", "0.0")
    ids = [tok(" a wonderful and great film")["input_ids"]] * 2
    rows = lexicon(prompts=["x", "x"], completions=["", ""], completion_ids=ids, env_rewards=[0.5, -0.5])
    assert rows[0] is None and rows[1] is not None
    # "wonderful" and "great" get +0.5 each; the embedded default bounds the row's sum at 0.5 (halves them)
    assert sorted(v for v in rows[1] if v) == [0.25, 0.25]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from trl_stable.testing import build_causal_lm, build_tokenizer, save_tiny

    tok = build_tokenizer()
    return save_tiny(tmp_path_factory.mktemp("tiny_critic"), build_causal_lm("gpt2", tok, seed=0), tok)


def test_every_ppo_flag_lands_in_ppo_config(load_script, tmp_path):
    """The flat RELC flags of the toxicity script are PPOConfig's own fields; the loop's config keeps them."""
    from ppo_args import loop_ppo_config
    from script_args import parse_script_args

    tox = load_script("toxicity/ppo_intrinsic.py", "toxicity_ppo_intrinsic")
    flags = {"model_name": "m", "target_kl": "None", "kl_penalty": "mse", "vf_coef": "0.3", "gamma": "0.9"}
    flags.update(learning_rate="2e-5", batch_size="8", mini_batch_size="4", ppo_epochs="2", top_p="0.8")
    argv = [token for name, value in flags.items() for token in (f"--{name}", value)] + ["--no_early_stopping"]
    args = parse_script_args(tox.ToxicityArguments, argv)
    config = loop_ppo_config(args.ppo_config, str(tmp_path), min_new_tokens=2, max_new_tokens=4)
    expected = {"model_name": "m", "target_kl": None, "kl_penalty": "mse", "vf_coef": 0.3, "gamma": 0.9}
    expected.update(learning_rate=2e-5, batch_size=8, mini_batch_size=4, ppo_epochs=2, top_p=0.8, early_stopping=False)
    assert {name: getattr(config, name) for name in expected} == expected
    assert (config.min_new_tokens, config.max_new_tokens, config.report_to) == (2, 4, [])
    assert config.output_dir == str(tmp_path)


def test_trainer_settings_the_loop_would_override_are_honoured_or_refused(load_script, tmp_path):
    """A step loop saves its own checkpoints and draws its own bar: --ppo_config.output_dir is where it saves,
    --ppo_config.disable_tqdm hides its bar, a trainer save schedule and a critic task of another script are refused
    by name instead of being overridden."""
    from critic_rewards import build_intrinsic_reward
    from ppo_args import default_save_path, loop_ppo_config
    from run_log import StepLog
    from script_args import parse_script_args

    from trl_stable.testing import build_causal_lm, build_tokenizer

    sentiment = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")

    def parse(*argv):
        return parse_script_args(sentiment.ScriptArguments, list(argv))

    out = str(tmp_path / "run")
    assert default_save_path("sentiment", True, None, parse().ppo_config) == "outputs/sentiment/ppo_intrinsic"
    assert default_save_path("sentiment", True, None, parse("--ppo_config.output_dir", out).ppo_config) == out
    assert default_save_path("sentiment", True, out, parse("--ppo_config.output_dir", out).ppo_config) == out
    with pytest.raises(ValueError, match="--model_save_path elsewhere and --ppo_config.output_dir"):
        default_save_path("sentiment", True, "elsewhere", parse("--ppo_config.output_dir", out).ppo_config)
    for flags in (("--ppo_config.save_strategy", "epoch"), ("--ppo_config.save_steps", "10")):
        with pytest.raises(ValueError, match=f"{flags[0]} .*use --save_freq N instead"):
            loop_ppo_config(parse(*flags).ppo_config, out)
    args = parse("--ppo_config.disable_tqdm", "True", "--ppo_config.output_dir", out)
    tokenizer = build_tokenizer()
    model = build_causal_lm("gpt2", tokenizer)
    trainer = sentiment.PPOTrainer(model, args=loop_ppo_config(args.ppo_config, out), processing_class=tokenizer)
    assert StepLog(trainer, "sentiment", 3, show_progress=not args.ppo_config.disable_tqdm).bar.disable
    assert not StepLog(trainer, "sentiment", 3).bar.disable
    with pytest.raises(ValueError, match="--critic_task toxicity: this script's task is sentiment"):
        build_intrinsic_reward(
            parse("--use_intrinsic_reward", "--critic_task", "toxicity", "--critic_lexicon", "vader").critic,
            "sentiment",
            None,
        )


def test_secrets_are_redacted_from_run_args_and_argv(tmp_path):
    from run_saving import save_run_args

    from trl_stable.rewards import CriticRewardConfig
    from trl_stable.settings.secrets import redact_argv

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
    save_run_args(CriticRewardConfig(critic_base_url="https://user:KEY-3@host.example/v1"), str(tmp_path))
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
    args = tox.ToxicityArguments(prompt_toxicity_level=0.6)
    assert tox.load_prompts(args, embedded=False) == ["toxic one"]
    summ = load_script("summarization/ppo_rouge.py", "summarization_ppo_rouge")
    prompts, refs = summ.load_pairs(summ.SummarizationArguments(), embedded=False)
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
    from prompt_batches import PromptBatches

    class Accelerator:
        num_processes = 2

        def __init__(self, rank):
            self.process_index = rank

    queries = [{"query": "q", "input_ids": [5]} for _ in range(63)]
    batches = [PromptBatches(queries, Accelerator(rank), 16, epochs=2, max_steps=None, seed=0) for rank in (0, 1)]
    assert [len(list(b.from_step(0))) for b in batches] == [len(b) for b in batches] == [2, 2]
    # a resumed run replays the shuffles it skips: its batches are the uninterrupted run's
    assert list(batches[0].from_step(1)) == list(batches[0].from_step(0))[1:]
