"""PPOTrainer.push_to_hub (transformers.Trainer's) without network: the folder prepared for upload, the mocked Hub
calls, no secret on disk."""

import os

import pytest
import torch
import transformers.trainer
from huggingface_hub.utils import filter_repo_objects
from tiny_configs import tiny_ppo_args

from trl_stable import PPOTrainer
from trl_stable.testing import build_causal_lm, save_tiny
from trl_stable.trainers.ppo.value_head import ValueHead

SECRET = "hf_SECRETtoken0123456789"
QUERIES = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9, 10]), torch.tensor([11])]
RESPONSES = [torch.tensor([20, 21, 22, 23]), torch.tensor([24, 25]), torch.tensor([26, 27, 28]), torch.tensor([29])]


class FakeHub:
    """Stands in for `huggingface_hub.HfApi` (what transformers' `hf_api()` returns): records the calls and what
    `upload_folder` would send."""

    calls: list = []

    def create_repo(self, repo_id, **kwargs):
        FakeHub.calls.append(("create_repo", repo_id, kwargs))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, **kwargs):
        root = kwargs["folder_path"]
        files = [
            os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for d, _, fs in os.walk(root) for f in fs
        ]
        # the Hub client's own filtering of the ignore patterns: what would leave the machine
        sent = sorted(filter_repo_objects(files, ignore_patterns=kwargs["ignore_patterns"]))
        FakeHub.calls.append(("upload_folder", sent, kwargs))
        return "commit-info"


@pytest.fixture
def hub(monkeypatch):
    FakeHub.calls = []
    monkeypatch.setattr(transformers.trainer, "hf_api", FakeHub)
    return FakeHub


def _no_secret_on_disk(root):
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                assert SECRET.encode() not in fh.read(), f"hub_token written into {os.path.join(d, f)}"


def test_push_full_model_with_value_head_and_card(tmp_path, tokenizer, hub):
    path = save_tiny(tmp_path / "base", build_causal_lm("qwen2", tokenizer, seed=0), tokenizer)
    out = tmp_path / "run"
    args = tiny_ppo_args(out, hub_model_id="someone/ppo-tiny", hub_token=SECRET, hub_private_repo=True)
    trainer = PPOTrainer(path, args=args, processing_class=tokenizer)
    trainer.step(QUERIES, RESPONSES, scores=[1.0, 0.0, 1.0, 0.0])
    trainer.save_checkpoint()  # checkpoints stay local
    assert trainer.push_to_hub(commit_message="ppo done") == "commit-info"

    (create, repo_id, create_kwargs), (upload, sent, upload_kwargs) = hub.calls
    assert (create, repo_id) == ("create_repo", "someone/ppo-tiny")
    assert create_kwargs["token"] == SECRET and create_kwargs["private"] is True and create_kwargs["exist_ok"]
    assert upload_kwargs["repo_id"] == "someone/ppo-tiny" and upload_kwargs["token"] == SECRET
    assert upload_kwargs["commit_message"] == "ppo done" and upload_kwargs["run_as_future"] is False
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "value_head.safetensors"} <= set(sent)
    assert not any(f.startswith(("checkpoint-", ".tmp-")) for f in sent)
    card = (out / "README.md").read_text()
    assert "PPO" in card and "value_head.safetensors" in card and "AutoModelForCausalLM" in card
    assert "someone/ppo-tiny" in card and "1707.06347" in card
    assert "base_model" not in card  # a local path names no Hub model
    _no_secret_on_disk(tmp_path)
    # what was pushed loads back: the value head equals the trained one
    head = ValueHead.from_pretrained(out)
    torch.testing.assert_close(head.state_dict()["summary.weight"], trainer.unwrapped().value_head.summary.weight)


def test_push_lora_adapter(tmp_path, tokenizer, hub):
    from peft import LoraConfig

    args = tiny_ppo_args(tmp_path, hub_model_id="someone/ppo-lora", push_to_hub=False)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = PPOTrainer(
        build_causal_lm("llama", tokenizer, seed=0), args=args, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.push_to_hub(token=SECRET, blocking=False, tags="mine")
    (_, _, create_kwargs), (_, sent, upload_kwargs) = hub.calls
    assert create_kwargs["token"] == SECRET and upload_kwargs["run_as_future"] is True
    assert {"adapter_config.json", "adapter_model.safetensors", "value_head.safetensors", "README.md"} <= set(sent)
    assert "model.safetensors" not in sent  # the adapter only, not the frozen base
    card = (tmp_path / "README.md").read_text()
    assert "LoRA adapter" in card and "AutoPeftModelForCausalLM" in card
    assert "- mine" in card and "- peft" in card
    _no_secret_on_disk(tmp_path)
