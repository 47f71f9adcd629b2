"""End-to-end smoke tests of the RELC reproduction scripts on their embedded offline defaults (a few PPO steps each),
plus the pieces they share: flag parsing, mode defaults, secret redaction, the offline summarization critic."""

import json
import math
import shlex
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "research_projects"
# Warm-up steps of the embedded policies here: enough to run every code path, not to learn language.
SMALL = ["--embedded_warmup_steps", "20"]
SMALL_PPO_NESTED = ["--ppo_config.batch_size", "4", "--ppo_config.mini_batch_size", "2"]
SMALL_PPO_NESTED += ["--ppo_config.ppo_epochs", "1"]
SMALL_PPO_FLAT = ["--batch_size", "4", "--mini_batch_size", "2", "--ppo_epochs", "1"]

# RELC's README command for the intrinsic sentiment run (paths shortened), parsed verbatim.
RELC_SENTIMENT = """--use_instric_reward --positive_reward_value 0.5 --negative_reward_value -0.5
--intrinsic_reward_threshold 10 --prompt_file prompts/critic_sentiment.txt --epochs 2 --query_dataset imdb
--min_new_tokens 15 --max_new_tokens 20 --num_shared_layers 20 --save_freq 50 --model_save_path ckpts/x
--ppo_config.model_name gpt2-large --ppo_config.learning_rate 1.41e-5 --ppo_config.batch_size 16
--ppo_config.mini_batch_size 16 --ppo_config.gradient_accumulation_steps 1 --ppo_config.target_kl 6.0
--ppo_config.kl_penalty kl --ppo_config.ppo_epochs 4"""
RELC_TOXICITY = """--use_intrinsic_reward --prompt_file prompts/critic_toxicity.txt --positive_reward_value 0.0
--negative_reward_value -0.5 --intrinsic_reward_threshold 1.0 --perspective_api SECRET-KEY-123 --model_name gpt2-large
--model_save_path ckpts/t --epochs 5 --prompt_toxicity_level 0.6 --output_min_length 10 --output_max_length 14
--learning_rate 1.41e-5 --batch_size 32 --mini_batch_size 32 --gradient_accumulation_steps 1 --ppo_epochs 4"""
RELC_SUMMARIZATION = """--use_instric_reward --positive_reward_value 0.5 --negative_reward_value -0.5
--intrinsic_reward_threshold 100 --use_score_scaling --num_shared_layers 12 --model_name ckpts/sft
--model_save_path ckpts/s --epochs 5 --output_min_length 30 --output_max_length 50 --learning_rate 1.41e-5
--batch_size 8 --mini_batch_size 8 --gradient_accumulation_steps 1 --ppo_epochs 4
--prompt_file prompts/critic_summarization.txt"""


def _history(path):
    return [json.loads(line) for line in (path / "reward_history.jsonl").read_text().splitlines()]


def test_relc_sentiment_command_parses(load_script):
    from script_args import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    args = parse_script_args(mod.ScriptArguments, shlex.split(RELC_SENTIMENT))
    critic, ppo = args.critic, args.ppo_config
    assert critic.use_intrinsic_reward is True  # through RELC's misspelled alias
    assert (critic.positive_reward_value, critic.negative_reward_value, critic.intrinsic_reward_threshold) == (
        0.5,
        -0.5,
        10,
    )
    # RELC's --max_new_tokens 20 excluded 20 (its LengthSampler): 15 to 19, both included in PPOConfig
    assert (args.epochs, args.query_dataset, ppo.min_new_tokens, ppo.max_new_tokens) == (2, "imdb", 15, 19)
    assert (ppo.num_shared_layers, args.save_freq) == (20, 50)
    assert ppo.model_name == "gpt2-large" and ppo.learning_rate == 1.41e-5
    assert (ppo.batch_size, ppo.mini_batch_size, ppo.gradient_accumulation_steps, ppo.ppo_epochs) == (16, 16, 1, 4)
    assert (ppo.target_kl, ppo.kl_penalty) == (6.0, "kl")
    assert parse_script_args(mod.ScriptArguments, ["--use_intrinsic_reward"]).critic.use_intrinsic_reward is True
    assert parse_script_args(mod.ScriptArguments, []).critic.use_intrinsic_reward is False


def test_relc_toxicity_and_summarization_commands_parse_and_key_is_redacted(load_script, tmp_path):
    from run_saving import save_run_args
    from script_args import parse_script_args

    tox = load_script("toxicity/ppo_intrinsic.py", "toxicity_ppo_intrinsic")
    args = parse_script_args(tox.ToxicityArguments, shlex.split(RELC_TOXICITY))
    assert args.critic.use_intrinsic_reward and args.critic.positive_reward_value == 0.0
    assert args.prompt_toxicity_level == 0.6 and args.ppo_config.learning_rate == 1.41e-5
    assert (args.output_min_length, args.output_max_length, args.ppo_config.batch_size) == (10, 14, 32)
    save_run_args(args, str(tmp_path))
    saved = (tmp_path / "run_args.json").read_text()
    assert "SECRET-KEY-123" not in saved and json.loads(saved)["perspective_api"] == "<redacted>"

    summ = load_script("summarization/ppo_rouge.py", "summarization_ppo_rouge")
    args = parse_script_args(summ.SummarizationArguments, shlex.split(RELC_SUMMARIZATION))
    assert args.critic.use_intrinsic_reward and args.ppo_config.use_score_scaling
    assert args.critic.intrinsic_reward_threshold == 100
    assert (args.ppo_config.num_shared_layers, args.output_min_length, args.ppo_config.batch_size) == (12, 30, 8)


def test_mode_defaults_and_bf16_from_accelerate(load_script, monkeypatch):
    from ppo_args import EMBEDDED_PPO
    from script_args import parse_script_args

    tox = load_script("toxicity/ppo_intrinsic.py", "toxicity_ppo_intrinsic")

    def ppo(*flags):
        return parse_script_args(tox.ToxicityArguments, list(flags)).ppo_config

    paper = ppo("--model_name", "gpt2-large", "--batch_size", "12")
    assert (paper.learning_rate, paper.init_kl_coef) == (1.41e-5, 0.2)  # RELC's values, PPOConfig's defaults
    assert paper.mini_batch_size == 12  # RELC: mini-batch = batch unless told otherwise
    assert parse_script_args(tox.ToxicityArguments, ["--model_name", "m"]).critic.critic_backend == "openai"
    embedded = ppo("--learning_rate", "1e-3", "--batch_size", "4")
    assert embedded.learning_rate == 1e-3  # an explicit flag wins over the mode default
    assert embedded.init_kl_coef == EMBEDDED_PPO["init_kl_coef"] and embedded.mini_batch_size == 4
    assert ppo().mini_batch_size == EMBEDDED_PPO["mini_batch_size"]
    assert ppo("--offline", "--model_name", "local").learning_rate == EMBEDDED_PPO["learning_rate"]
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr(tox.RelcPPOConfig, "__post_init__", lambda self: None)  # bf16 needs a GPU to validate
    assert ppo().bf16 is True
    assert ppo("--no_bf16").bf16 is False


def test_truncated_queries_and_smoothing():
    from prompt_batches import truncate_queries
    from reward_curve import smooth

    from trl_stable.testing import build_tokenizer

    tok = build_tokenizer()
    texts = ["The movie was a great surprise and the acting felt warm, honest and alive."] * 20
    queries = truncate_queries(tok, texts, 4, 10, seed=0)
    assert all(4 <= len(q["input_ids"]) <= 10 for q in queries)
    assert len({len(q["input_ids"]) for q in queries}) > 1
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_sentiment_ppo_intrinsic_end_to_end_then_eval(load_script, tmp_path, capsys):
    """Embedded sentiment run: trains with the lexicon critic, checkpoints, saves, plots, prints its before/after
    summary; the eval scripts read it."""
    from script_args import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    out = tmp_path / "ppo_intrinsic"
    argv = ["--use_instric_reward", "--max_steps", "2", "--save_freq", "1", "--model_save_path", str(out)]
    history = mod.main(parse_script_args(mod.ScriptArguments, argv + SMALL + SMALL_PPO_NESTED))
    assert len(history) == 2 and all(math.isfinite(h["env_reward"]) for h in history)
    # the critic ran on every step (whether the 20-step policy's 8 samples hold an AFINN word is chance; the AFINN
    # critic's spans and rewards are checked on fixed text in tests/rewards/test_intrinsic_scale.py)
    assert all(0.0 <= h["critic_rewarded_token_fraction"] <= 1.0 for h in history)
    assert all(0.0 <= h["distinct_2"] <= 1.0 for h in history)
    printed = capsys.readouterr().out
    assert "Summary: means of steps 1-1 -> steps 2-2" in printed and "distinct-2 of the rollouts" in printed
    assert printed.count("    before: ") == 2 and printed.count("    after:  ") == 2
    for name in ("config.json", "model.safetensors", "value_head.safetensors", "reward_curve.png", "run_args.json"):
        assert (out / name).is_file(), name
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir()
    assert len(_history(out)) == 2

    import eval_perplexity_dist
    import eval_sentiment

    ev = eval_sentiment.SentimentEvalArgs(
        models=[str(out)], names=["intrinsic"], num_prompts=2, num_return=3, max_new_tokens=6,
        with_fluency=True, scoring_model=str(out), output_dir=str(tmp_path / "eval"),
    )  # fmt: skip
    summary = eval_sentiment.evaluate(ev)
    assert 0.0 <= summary["intrinsic"]["positive_rate"] <= 1.0 and summary["intrinsic"]["num_samples"] == 6
    assert (tmp_path / "eval" / "comparison.png").is_file()
    gens = tmp_path / "eval" / "intrinsic_generations.jsonl"
    fl = eval_perplexity_dist.evaluate(
        eval_perplexity_dist.FluencyEvalArgs(
            generations_files=[str(gens)], scoring_model=str(out), output_dir=str(tmp_path / "fluency")
        )
    )
    assert fl["intrinsic"]["perplexity"] > 1.0 and 0.0 <= fl["intrinsic"]["dist-1"] <= 1.0


def test_toxicity_ppo_intrinsic_end_to_end(load_script, tmp_path):
    from script_args import parse_script_args

    mod = load_script("toxicity/ppo_intrinsic.py", "toxicity_ppo_intrinsic")
    out = tmp_path / "tox"
    argv = ["--use_intrinsic_reward", "--max_steps", "2", "--model_save_path", str(out), *SMALL, *SMALL_PPO_FLAT]
    history = mod.main(parse_script_args(mod.ToxicityArguments, argv))
    assert len(history) == 2 and all(0.0 <= h["env_reward"] <= 1.0 for h in history)
    assert any(h["intrinsic_reward"] < 0.0 for h in history)  # toxic spans get negative_reward_value
    assert (out / "reward_curve.png").is_file()


def test_toxicity_peft_trains_only_the_adapter(load_script, tmp_path):
    from script_args import parse_script_args

    peft = load_script("toxicity/ppo_intrinsic_peft.py", "toxicity_ppo_intrinsic_peft")
    tox = load_script("toxicity/ppo_intrinsic.py", "toxicity_ppo_intrinsic")
    out = tmp_path / "tox_peft"
    argv = ["--max_steps", "1", "--model_save_path", str(out), *SMALL, *SMALL_PPO_FLAT, "--learning_rate", "1e-2"]
    launched = peft.command(argv)  # what ppo_intrinsic_peft.py runs: the toxicity script, --use_peft, the flags
    assert launched[1:3] == [tox.__file__, "--use_peft"]
    tox.main(parse_script_args(tox.ToxicityArguments, launched[2:]))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()


def test_summarization_sft_then_ppo_rouge_with_offline_critic(load_script, tmp_path):
    from script_args import parse_script_args

    mod = load_script("summarization/ppo_rouge.py", "summarization_ppo_rouge")
    out = tmp_path / "summ"
    argv = ["--use_instric_reward", "--use_score_scaling", "--max_steps", "2", "--sft_steps", "3", *SMALL]
    argv += ["--model_save_path", str(out), *SMALL_PPO_FLAT, "--output_min_length", "4", "--output_max_length", "6"]
    history = mod.main(parse_script_args(mod.SummarizationArguments, argv))
    assert len(history) == 2 and all(0.0 <= h["env_reward"] <= 1.0 for h in history)
    assert (out / "sft_warmstart" / "config.json").is_file() and (out / "config.json").is_file()

    import eval_summarization

    summary = eval_summarization.evaluate(
        eval_summarization.SummarizationEvalArgs(
            models=[str(out)], names=["ppo"], num_samples=2, max_new_tokens=6, output_dir=str(tmp_path / "ev")
        )
    )
    assert set(summary["ppo"]) == {"rouge1", "rouge2", "rougeL"}


def test_article_overlap_critic_labels_supported_and_unsupported_spans(load_script):
    from trl_stable.rewards import parse_critic_answer

    mod = load_script("summarization/ppo_rouge.py", "summarization_ppo_rouge")
    critic = mod.ArticleOverlapCritic()
    prompt = "The council approved a new park near the river.\nTL;DR: council approved a purple dragon park"
    answer = critic([prompt], ["council approved a purple dragon park"])[0]
    assert answer.splitlines() == [
        "Span 1: council approved a (Label: good)",
        "Span 2: purple dragon (Label: unsupported)",
        "Span 3: park (Label: good)",
    ]
    parsed = parse_critic_answer(answer)
    assert parsed.positive == ["council approved a", "park"] and parsed.negative == ["purple dragon"]


def _declared_type_ok(value, hint) -> bool:
    import types
    import typing

    if hint is typing.Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_declared_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return type(value) is float
    return isinstance(value, origin or hint)


@pytest.mark.parametrize("name", sorted(p.name for p in (EXAMPLES / "sentiment" / "configs").glob("*.yaml")))
def test_every_algorithm_yaml_loads_with_its_declared_types(load_script, name):
    """Each YAML's values reach the arguments of the script it runs, each with its field's declared type."""
    import typing

    import yaml
    from script_args import parse_script_args

    mod = load_script("sentiment/grpo_intrinsic.py", "sentiment_grpo_intrinsic")
    path = EXAMPLES / "sentiment" / "configs" / name
    raw = yaml.safe_load(path.read_text())
    assert raw["algorithm"] == path.stem and path.stem in mod.ALGORITHMS
    values = mod.load_yaml(name)  # a bare name is looked up in configs/
    algorithm = values.pop("algorithm")
    if algorithm == "ppo":
        ppo_script = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
        args = parse_script_args(ppo_script.ScriptArguments, [], file_values=values)
    else:
        args = parse_script_args(mod.GRPOScriptArguments, [], file_values={**values, "algorithm": algorithm})
        assert args.algorithm == algorithm and args.grpo.output_dir == f"outputs/sentiment/{algorithm}"
    for key, value in values.items():
        section = getattr(args, key)
        for field, expected in value.items() if isinstance(value, dict) else [(None, value)]:
            got, owner = (getattr(section, field), section) if field else (section, args)
            hint = typing.get_type_hints(type(owner))[field or key]
            assert got == expected and _declared_type_ok(got, hint), (key, field, got, hint)


def test_config_flag_and_missing_files(load_script):
    from script_args import pop_config_flag

    mod = load_script("sentiment/grpo_intrinsic.py", "sentiment_grpo_intrinsic")
    assert pop_config_flag(["--config", "dapo.yaml", "--max_steps", "5"]) == ("dapo.yaml", ["--max_steps", "5"])
    assert pop_config_flag(["--config=x.yaml", "--grpo.beta", "0.1"]) == ("x.yaml", ["--grpo.beta", "0.1"])
    with pytest.raises(ValueError, match="does not exist"):
        mod.load_yaml("no_such_algorithm.yaml")


def test_ppo_yaml_runs_the_ppo_script_with_the_same_flags(load_script):
    """`grpo_intrinsic.py --config ppo.yaml <flags>` becomes `ppo_intrinsic.py --config <ppo.yaml> <flags>`, which
    takes the family's file (its `algorithm: ppo`) and refuses a GRPO one."""
    from script_args import parse_script_args

    grpo = load_script("sentiment/grpo_intrinsic.py", "sentiment_grpo_intrinsic")
    ppo = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    command = grpo.ppo_command("ppo.yaml", ["--epochs", "10", "--output_dir", "out/x"])
    assert command[1] == ppo.__file__ and command[2:4] == ["--config", str(EXAMPLES / "sentiment/configs/ppo.yaml")]
    assert command[4:] == ["--epochs", "10", "--model_save_path", "out/x"]
    args = parse_script_args(ppo.ScriptArguments, command[2:])
    assert (args.epochs, args.model_save_path, args.critic.use_intrinsic_reward) == (10, "out/x", True)
    assert (args.ppo_config.min_new_tokens, args.ppo_config.max_new_tokens) == (15, 20)  # the file's values
    with pytest.raises(ValueError, match="algorithm 'gdpo' is not what this script runs"):
        parse_script_args(ppo.ScriptArguments, ["--config", str(EXAMPLES / "sentiment/configs/gdpo.yaml")])


def test_yaml_and_flags_take_the_declared_type(load_script, tmp_path):
    """`learning_rate: 1e-4` is a string to YAML; the file and the flag both arrive as the field's float."""
    from script_args import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    config = tmp_path / "run.yaml"
    config.write_text(
        "epochs: 3\nppo_config:\n  learning_rate: 1e-4\n  init_kl_coef: 1\ncritic:\n  use_intrinsic_reward: true\n"
    )
    args = parse_script_args(mod.ScriptArguments, ["--config", str(config)])
    assert args.ppo_config.learning_rate == 1e-4 and type(args.ppo_config.learning_rate) is float
    assert type(args.ppo_config.init_kl_coef) is float and args.epochs == 3 and args.critic.use_intrinsic_reward
    assert args.ppo_config.mini_batch_size == 8  # the mode defaults still apply to what the file leaves out
    args = parse_script_args(mod.ScriptArguments, ["--config", str(config), "--ppo_config.learning_rate", "2e-4"])
    assert args.ppo_config.learning_rate == 2e-4  # the command line wins over the file
    config.write_text("ppo_config:\n  no_such_field: 1\n")
    with pytest.raises(ValueError, match="no_such_field"):
        parse_script_args(mod.ScriptArguments, ["--config", str(config)])


def test_readme_icepop_command_runs_with_float_learning_rate(load_script, tmp_path, monkeypatch):
    """The README's command, read from the README, verbatim but for fewer steps and an output directory."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    readme = [line for line in (root / "README.md").read_text().splitlines() if "grpo_intrinsic.py --config" in line]
    assert readme, "the README lost its YAML + override command"
    readme_args = shlex.split(readme[0])[2:]  # after `python <script>`
    mod = load_script("sentiment/grpo_intrinsic.py", "sentiment_grpo_intrinsic")
    seen, real = {}, mod.run_grpo

    def run_grpo(args):
        seen["args"] = args
        return real(args)

    monkeypatch.setattr(mod, "run_grpo", run_grpo)
    command = "--config examples/research_projects/sentiment/configs/icepop.yaml --max_steps 100"
    command += " --grpo.learning_rate 1e-4"
    assert readme_args == shlex.split(command)
    history = mod.main([*readme_args, "--max_steps", "2", "--output_dir", str(tmp_path / "icepop")])
    grpo = seen["args"].grpo
    assert grpo.learning_rate == 1e-4 and type(grpo.learning_rate) is float
    assert (grpo.use_decoupled_loss, grpo.token_filter, grpo.token_filter_lower, grpo.token_filter_upper) == (
        True,
        "icepop",
        0.5,
        5.0,
    )
    assert seen["args"].algorithm == "icepop" and grpo.max_steps == 2 and len(history) == 2
    saved = json.loads((tmp_path / "icepop" / "run_args.json").read_text())["grpo"]
    assert saved["learning_rate"] == 1e-4 and saved["token_filter"] == "icepop"


def test_grpo_gdpo_yaml_with_dense_critic_trains(load_script, tmp_path):
    mod = load_script("sentiment/grpo_intrinsic.py", "sentiment_grpo_intrinsic")
    out = tmp_path / "gdpo"
    history = mod.main(
        ["--config", "gdpo.yaml", "--max_steps", "2", "--use_intrinsic_reward", "--output_dir", str(out)]
        + ["--grpo.per_device_train_batch_size", "8", "--grpo.max_completion_length", "6"]
    )
    assert len(history) == 2 and "rewards/fluency/mean" in history[0]
    assert json.loads((out / "run_args.json").read_text())["grpo"]["advantage_estimator"] == "gdpo"
    assert (out / "reward_curve.png").is_file()


@pytest.mark.slow
def test_embedded_sentiment_reward_rises(load_script, tmp_path):
    """The README quick start: on the embedded default the reward rises within a few dozen PPO steps."""
    from script_args import parse_script_args

    torch.manual_seed(0)
    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    argv = ["--use_intrinsic_reward", "--max_steps", "60", "--model_save_path", str(tmp_path / "run")]
    history = mod.main(parse_script_args(mod.ScriptArguments, argv))
    rewards = [h["env_reward"] for h in history]
    assert sum(rewards[-15:]) / 15 > sum(rewards[:15]) / 15 + 0.1


def test_resume_from_checkpoint_reproduces_the_run(load_script, tmp_path):
    from script_args import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    base = ["--use_intrinsic_reward", "--max_steps", "3", "--save_freq", "1", *SMALL, *SMALL_PPO_NESTED]
    full = mod.main(parse_script_args(mod.ScriptArguments, [*base, "--model_save_path", str(tmp_path / "a")]))
    resumed_dir = tmp_path / "b"
    mod.main(
        parse_script_args(mod.ScriptArguments, [*base, "--max_steps", "1", "--model_save_path", str(resumed_dir)])
    )
    argv = [
        *base,
        "--model_save_path",
        str(resumed_dir),
        "--resume_from_checkpoint",
        str(resumed_dir / "checkpoint-1"),
    ]
    resumed = mod.main(parse_script_args(mod.ScriptArguments, argv))
    assert [h["step"] for h in resumed] == [1, 2, 3]
    for a, b in zip(full, resumed):
        assert b["env_reward"] == pytest.approx(a["env_reward"], abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-5)
