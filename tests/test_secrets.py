"""trl_stable.settings.secrets: which fields are secrets, their redaction in written configs, pickles and command
lines, and the refusal of a key typed where an environment variable's name belongs."""

import copy
import io
import pickle
from dataclasses import dataclass, field

import pytest
import torch

from trl_stable import GRPOConfig, PPOConfig
from trl_stable.rewards import CriticRewardConfig
from trl_stable.settings.secrets import (
    REDACTED,
    SecretsNotPickled,
    check_env_var_name,
    is_secret_name,
    looks_like_secret,
    redact,
    redact_argv,
    redact_text,
)

KEY = "sk-proj-Zx81kQ7vLm20PqRt55Ws"


@pytest.mark.parametrize(
    "name",
    ["hub_token", "HUB_TOKEN", "--grpo.hub_token", "--hub-token", "token", "api_key", "openai_api_key", "apikey",
     "client_secret", "db_password", "password", "authorization", "perspective_api", "perspective_api_key",
     "aws_secret_access_key", "push_to_hub_token", "credentials"],
)  # fmt: skip
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["pad_token", "eos_token", "max_new_tokens", "token_filter", "critic_api_key_env", "api_key_file",
     "hub_model_id", "include_num_input_tokens_seen", "metric_keys", "learning_rate", "secret_dir"],
)  # fmt: skip
def test_names_that_are_not_secrets(name):
    assert not is_secret_name(name)


@dataclass
class Inner:
    hub_token: str | None = None
    url: str = "https://user:PW-1@host.example/v1?api_key=QK-2&model=x"


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    kwargs: dict = field(default_factory=dict)
    perspective_api: str | None = None
    critic_api_key_env: str = "OPENAI_API_KEY"
    names: list = field(default_factory=list)


def test_redact_nested_dataclasses_mappings_and_urls():
    value = Outer(
        Inner(hub_token="hf_T-3"), {"token": "T-4", "revision": "main"}, "P-5", names=["http://a:T-6@h", "plain"]
    )
    assert redact(value) == {
        "inner": {"hub_token": REDACTED, "url": "https://host.example/v1?api_key=<redacted>&model=x"},
        "kwargs": {"token": REDACTED, "revision": "main"},
        "perspective_api": REDACTED,
        "critic_api_key_env": "OPENAI_API_KEY",  # a variable's name is no secret
        "names": ["http://h", "plain"],
    }
    # an unset secret shows as unset; a key typed into a *_env field is redacted all the same
    assert redact(Outer(critic_api_key_env=KEY.replace("-", "_")))["perspective_api"] is None
    assert redact({"critic_api_key_env": "hf_aB3cD4eF5gH6iJ7kL8mN9"}) == {"critic_api_key_env": REDACTED}


def test_redact_text_by_hand():
    assert (
        redact_text("see http://bob:hunter2@10.0.0.1:8000/v1 and ftp://x@y")
        == "see http://10.0.0.1:8000/v1 and ftp://y"
    )
    assert redact_text("https://h/p?token=abc&x=1#f") == "https://h/p?token=<redacted>&x=1#f"


def test_redact_argv_in_place():
    argv = ["s.py", "--grpo.hub_token", "hf_A", "--perspective_api=P", "--hub-token", "hf_B", "--use_key", "--lr",
            "1", "--critic_base_url", "http://u:K@h/v1", "--critic_api_key_env", "MY_KEY"]  # fmt: skip
    assert redact_argv(argv) is argv
    expected = ["s.py", "--grpo.hub_token", REDACTED, "--perspective_api=<redacted>", "--hub-token", REDACTED]
    expected += ["--use_key", "--lr", "1", "--critic_base_url", "http://h/v1", "--critic_api_key_env", "MY_KEY"]
    assert argv == expected


REAL_NAMES = [
    "OPENAI_API_KEY", "HF_TOKEN", "MY_CRITIC_KEY_2", "my_critic_key_2", "_K", "CriticKey", "ASIA_PACIFIC_KEY_2024",
    "AZURE_OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS",
    "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACEHUB_API_TOKEN", "ANTHROPIC_API_KEY", "GROQ_API_KEY", "FIREWORKS_API_KEY",
    "REPLICATE_API_TOKEN", "XAI_API_KEY", "NVIDIA_API_KEY", "GITHUB_TOKEN", "WANDB_API_KEY", "OPENROUTER_API_KEY",
    "VLLM_API_KEY", "OPENAI_API_KEY_V2", "GPT4_O1_KEY", "S3_BUCKET_V2", "X509_CERT", "PERSPECTIVE_API_KEY",
    "MY_VLLM_SERVER_KEY_20240601", "OPENAI_KEY_PROD_EU_WEST_1", "hf_token", "hf_token_file_2", "ghp_token",
    "MyCriticServerApiKey",
]  # fmt: skip


@pytest.mark.parametrize("value", REAL_NAMES)
def test_variable_names_are_accepted(value):
    check_env_var_name("critic_api_key_env", value)
    assert not looks_like_secret(value)


@pytest.mark.parametrize(
    "value",
    [KEY, "sk-1", "hf_aB3cD4eF5gH6iJ7kL8mN9oP0", "gsk_8f3kd92Lmq7ZxT1v0PwQ4nR6sY2bC5hJ",
     "fw_3ZkXyQ8pL2mN7vB4cR9tW1aE", "r8_ABcd1234EFgh5678IJkl9012mnop", "sk_live_4ec39hqlyjwdarjtt1zdp7dc",
     "key_a8f3k2m9x7q1z5b6", "a1b2c3d4_e5f6g7h8", "xai_Abc123Def456Ghi789", "aBcDeFgHiJkLmNoPqRsT",
     "abcdefghijklmnopqrstuvwxyzabcd", "ghp_16C7e42F292c6912E7710c838347Ae178B4a", "AKIAIOSFODNN7EXAMPLE",
     "3f2a9c0b7d1e4f5a8b6c2d9e0f1a3b4c", "Zx81kQ7vLm20PqRt55WsYy", "OPENAI API KEY", "1ABC", "x=1", " "],
)  # fmt: skip
def test_keys_and_invalid_names_are_refused_without_echo(value):
    with pytest.raises(ValueError) as err:
        check_env_var_name("critic_api_key_env", value)
    message = str(err.value)
    assert value.strip() not in message if value.strip() else True
    assert "critic_api_key_env" in message and "NAME of the environment variable" in message
    assert "critic_api_key_env='OPENAI_API_KEY'" in message  # says what to pass instead


def test_critic_config_and_openai_critic_refuse_a_key(monkeypatch):
    from trl_stable.rewards import OpenAICritic

    with pytest.raises(ValueError, match="critic_api_key_env takes the NAME") as err:
        CriticRewardConfig(critic_api_key_env=KEY)
    assert KEY not in str(err.value) and KEY not in repr(err.value)
    with pytest.raises(ValueError, match="api_key_env takes the NAME") as err:
        OpenAICritic(api_key_env=KEY, base_url="http://localhost:1/v1")
    assert KEY not in str(err.value)
    monkeypatch.setenv("MY_CRITIC_KEY", KEY)
    assert CriticRewardConfig(critic_api_key_env="MY_CRITIC_KEY").critic_api_key_env == "MY_CRITIC_KEY"


@pytest.mark.parametrize("config_class", [PPOConfig, GRPOConfig])
def test_pickled_config_drops_secrets_copies_keep_them(config_class, tmp_path):
    args = config_class(
        output_dir=str(tmp_path),
        hub_token="hf_SECRET_1",
        model_init_kwargs={"token": "hf_SECRET_2", "revision": "main"},
        report_to="none",
        bf16=False,  # GRPOConfig's default needs a GPU
    )
    # what transformers' Trainer writes: torch.save(self.args) as training_args.bin (and pushes it to the Hub)
    buffer = io.BytesIO()
    torch.save(args, buffer)
    assert b"SECRET" not in buffer.getvalue()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert loaded.hub_token is None and loaded.model_init_kwargs == {"token": None, "revision": "main"}
    assert loaded.learning_rate == args.learning_rate and type(loaded) is config_class
    assert args.hub_token == "hf_SECRET_1"  # pickling changed nothing on the live config
    for clone in (copy.copy(args), copy.deepcopy(args)):
        assert clone.hub_token == "hf_SECRET_1" and clone.model_init_kwargs["token"] == "hf_SECRET_2"
    assert b"SECRET" not in pickle.dumps(args)
    # logs (str, f-strings, print) and tracker configs (to_dict, to_json_string, to_sanitized_dict)
    for text in (str(args), f"{args}", args.to_json_string(), str(args.to_dict()), str(args.to_sanitized_dict())):
        assert "SECRET" not in text
    assert args.to_dict()["model_init_kwargs"] == {"token": REDACTED, "revision": "main"}


@dataclass
class JudgeConfig(SecretsNotPickled):
    """A config of ours with a `*_env` field the critic knows nothing about."""

    judge_key_env: str = "JUDGE_KEY"
    judge_url: str = "http://judge:8000/v1"


def test_every_env_field_of_a_config_is_checked_and_shown_redacted():
    assert JudgeConfig().judge_key_env == "JUDGE_KEY"
    with pytest.raises(ValueError, match="judge_key_env takes the NAME") as err:
        JudgeConfig(judge_key_env="fw_3ZkXyQ8pL2mN7vB4cR9tW1aE")
    assert "fw_3Zk" not in str(err.value)
    late = JudgeConfig(judge_url="https://u:URLKEY9@judge/v1")
    late.judge_key_env = "r8_ABcd1234EFgh5678IJkl9012mnop"  # set after the check: still never shown
    for text in (repr(late), str(late), str(late.to_dict()), pickle.dumps(late).decode("latin-1")):
        assert "r8_ABcd" not in text and "URLKEY9" not in text
    assert repr(late) == "JudgeConfig(judge_key_env='<redacted>', judge_url='https://judge/v1')"
