"""Every channel a secret could leak through, enumerated: `repr`, `str`, tracker dicts, JSON, pickles and
`torch.save` of the trainer configs and the critic config, and keys of several providers' shapes typed into
``*_env`` fields (accepted, or refused with the key in the message). `leaks()` lists what shows a secret; none may."""

import io
import pickle

import torch

from trl_stable import GRPOConfig, PPOConfig
from trl_stable.rewards import CriticIntrinsicReward, CriticRewardConfig, OpenAICritic

HUB_TOKEN = "hf_HUBxSECRETx0001"
INIT_TOKEN = "hf_INITxSECRETx0002"
URL_KEY = "URLxSECRETx0003"
# Keys as providers shape them (made up): OpenAI, Hugging Face, Groq, Fireworks, Replicate, Stripe-like lower case with
# underscores, a random lower-case key, AWS.
KEY_SHAPES = {
    "openai": "sk-proj-Zx81kQ7vLm20PqRt55WsYy",
    "huggingface": "hf_aB3cD4eF5gH6iJ7kL8mN9oP0",
    "groq": "gsk_8f3kd92Lmq7ZxT1v0PwQ4nR6sY2bC5hJ",
    "fireworks": "fw_3ZkXyQ8pL2mN7vB4cR9tW1aE",
    "replicate": "r8_ABcd1234EFgh5678IJkl9012mnop",
    "lower_underscores": "sk_live_4ec39hqlyjwdarjtt1zdp7dc",
    "lower_random": "key_a8f3k2m9x7q1z5b6",
    "aws": "AKIAIOSFODNN7EXAMPLE",
}


def _texts_of_trainer_config(cls, tmp):
    args = cls(
        output_dir=str(tmp),
        hub_token=HUB_TOKEN,
        model_init_kwargs={"token": INIT_TOKEN, "revision": "main"},
        report_to="none",
        bf16=False,
    )
    buffer = io.BytesIO()
    torch.save(args, buffer)
    return {
        "repr": repr(args),
        "str": str(args),
        "to_dict": str(args.to_dict()),
        "to_json_string": args.to_json_string(),
        "pickle": pickle.dumps(args).decode("latin-1"),
        "torch.save": buffer.getvalue().decode("latin-1"),
    }


def _texts_of_critic_config():
    cfg = CriticRewardConfig(critic_backend="openai", critic_base_url=f"https://user:{URL_KEY}@critic.example/v1")
    critic = OpenAICritic(base_url=cfg.critic_base_url)
    reward = CriticIntrinsicReward(cfg, None, backend=critic)
    return {
        "repr": repr(cfg),
        "str": str(cfg),
        "pickle": pickle.dumps(cfg).decode("latin-1"),
        "backend repr": repr(critic),
        "reward repr": repr(reward),
    }


def leaks(tmp="/tmp/trl_stable_leak_check") -> list[str]:
    found = []
    for cls in (PPOConfig, GRPOConfig):
        for channel, text in _texts_of_trainer_config(cls, tmp).items():
            for name, secret in (("hub_token", HUB_TOKEN), ("model_init_kwargs.token", INIT_TOKEN)):
                if secret in text:
                    found.append(f"{cls.__name__} {channel} shows {name}")
    for channel, text in _texts_of_critic_config().items():
        if URL_KEY in text:
            found.append(f"CriticRewardConfig {channel} shows the key in critic_base_url")
    for shape, key in KEY_SHAPES.items():
        for where, build in (
            ("CriticRewardConfig.critic_api_key_env", lambda k: CriticRewardConfig(critic_api_key_env=k)),
            ("OpenAICritic(api_key_env=)", lambda k: OpenAICritic(api_key_env=k, base_url="http://127.0.0.1:9/v1")),
        ):
            try:
                build(key)
            except ValueError as err:
                if key in str(err) or key in repr(err):
                    found.append(f"{where}: the refusal of a {shape} key shows it")
            else:
                found.append(f"{where} accepts a {shape} key (later errors name the variable: they show it)")
    return found


def test_no_secret_leaks(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-DUMMY-leaks-7a7a")
    assert leaks(str(tmp_path)) == []
