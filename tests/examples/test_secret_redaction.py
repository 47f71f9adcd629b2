"""Secrets in every field of a script run, end to end: none appears in any file the run writes (run_args.json, the
checkpoints' training_args.bin and trainer_state.json, the model card, health.jsonl, ...), in its output or in
sys.argv; a key typed into a field that wants a variable's name is refused without being echoed."""

import json
import logging
import sys
from pathlib import Path

import pytest

# a tiny embedded policy and PPO batch: enough to run every writer
SMALL = ["--embedded_warmup_steps", "20", "--ppo_config.batch_size", "4", "--ppo_config.mini_batch_size", "2"]

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "research_projects" / "sentiment" / "configs"
HUB_TOKEN = "hf_HubTok3nE2eSecret01"
INIT_TOKEN = "hf_InitTok3nE2eSecret02"
URL_PASSWORD = "UrlPassw0rdE2eSecret03"
VLLM_PASSWORD = "VllmPassw0rdE2eSecret04"
CRITIC_KEY = "sk-CriticKeyE2eSecret05"  # in the environment variable the critic field names
SECRETS = (HUB_TOKEN, INIT_TOKEN, URL_PASSWORD, VLLM_PASSWORD, CRITIC_KEY)


def assert_no_secret_written(out: Path, captured: str) -> list[str]:
    """Every file under `out`, read as bytes (pickles and safetensors included), and the run's output: no secret."""
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    for name in written:
        data = (out / name).read_bytes()
        leaked = [secret for secret in SECRETS if secret.encode() in data]
        assert not leaked, f"{name} holds {leaked}"
    assert not [secret for secret in SECRETS if secret in captured]
    assert not [arg for arg in sys.argv if any(secret in arg for secret in SECRETS)]  # trackers record sys.argv
    return written


def test_grpo_script_writes_no_secret(load_script, tmp_path, monkeypatch, capfd, caplog):
    config = tmp_path / "gdpo_with_token.yaml"  # model_init_kwargs has no command-line form: a YAML file
    config.write_text((CONFIGS / "gdpo.yaml").read_text() + f"  model_init_kwargs:\n    token: {INIT_TOKEN}\n")
    out = tmp_path / "run"
    monkeypatch.setenv("MY_CRITIC_KEY", CRITIC_KEY)
    argv = ["--config", str(config), "--max_steps", "2", "--use_intrinsic_reward", "--output_dir", str(out)]
    argv += ["--grpo.per_device_train_batch_size", "8", "--grpo.max_completion_length", "6"]
    argv += ["--grpo.save_strategy", "steps", "--grpo.save_steps", "1", "--grpo.hub_token", HUB_TOKEN]
    argv += [
        "--critic_base_url",
        f"https://user:{URL_PASSWORD}@host.example/v1",
        "--critic_api_key_env",
        "MY_CRITIC_KEY",
    ]
    argv += ["--grpo.vllm_server_base_url", f"http://admin:{VLLM_PASSWORD}@vllm.example:8000"]
    monkeypatch.setattr(sys, "argv", ["grpo_intrinsic.py", *argv])
    mod = load_script("sentiment/grpo_intrinsic.py", "sentiment_grpo_intrinsic")
    with caplog.at_level(logging.INFO):
        history = mod.main()
    assert len(history) == 2
    captured = capfd.readouterr()
    written = assert_no_secret_written(out, captured.out + captured.err + caplog.text)
    for name in ("run_args.json", "training_args.bin", "checkpoint-1/training_args.bin", "README.md", "health.jsonl"):
        assert name in written
    saved = json.loads((out / "run_args.json").read_text())
    assert saved["grpo"]["hub_token"] == "<redacted>" and saved["grpo"]["model_init_kwargs"]["token"] == "<redacted>"
    assert saved["critic"]["critic_base_url"] == "https://host.example/v1"
    assert saved["critic"]["critic_api_key_env"] == "MY_CRITIC_KEY"  # the variable's name, which is no secret
    assert sys.argv[sys.argv.index("--grpo.hub_token") + 1] == "<redacted>"


def test_ppo_script_writes_no_secret(load_script, tmp_path, monkeypatch, capfd, caplog):
    from script_args import parse_script_args

    out = tmp_path / "ppo"
    argv = ["--use_intrinsic_reward", "--max_steps", "2", "--save_freq", "1", "--model_save_path", str(out)]
    argv += [*SMALL, "--ppo_config.ppo_epochs", "1", "--ppo_config.hub_token", HUB_TOKEN]
    argv += ["--critic_base_url", f"https://user:{URL_PASSWORD}@host.example/v1"]
    monkeypatch.setattr(sys, "argv", ["ppo_intrinsic.py", *argv])
    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    with caplog.at_level(logging.INFO):
        history = mod.main(parse_script_args(mod.ScriptArguments))
    assert len(history) == 2
    captured = capfd.readouterr()
    written = assert_no_secret_written(out, captured.out + captured.err + caplog.text)
    assert {"run_args.json", "checkpoint-1/trainer_state.json", "health.jsonl"} <= set(written)
    assert json.loads((out / "run_args.json").read_text())["ppo_config"]["hub_token"] == "<redacted>"


@pytest.mark.parametrize("script, cls", [("sentiment/ppo_intrinsic.py", "ScriptArguments"),
                                         ("sentiment/grpo_intrinsic.py", "GRPOScriptArguments")])  # fmt: skip
def test_key_in_the_variable_name_flag_is_refused_unechoed(load_script, capfd, script, cls):
    from script_args import parse_script_args

    mod = load_script(script, script.replace("/", "_").removesuffix(".py"))
    with pytest.raises(SystemExit):  # tyro prints the config's error and exits
        parse_script_args(getattr(mod, cls), ["--critic_api_key_env", CRITIC_KEY])
    captured = capfd.readouterr()
    shown = captured.out + captured.err
    assert "critic_api_key_env takes the NAME" in shown  # on the first line of tyro's error box
    assert CRITIC_KEY not in shown and "CriticKeyE2e" not in shown
