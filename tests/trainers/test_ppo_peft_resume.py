"""PPOTrainer: LoRA (adapter + value head only), save/load, resume, gradient checkpointing, bitsandbytes guard."""

import importlib.util
import os

import pytest
import torch
from datasets import Dataset
from tiny_configs import step_logs, tiny_ppo_args
from tiny_data import SHORT_PROMPTS

from trl_stable import PPOTrainer
from trl_stable.rewards import dense_reward
from trl_stable.testing import build_causal_lm, save_tiny
from trl_stable.trainers.ppo.value_head import ValueHead


@dense_reward
def low_ids(prompts, completions, completion_ids, **kw):
    return [[1.0 if t < 300 else 0.0 for t in ids] for ids in completion_ids]


def _args(tmp_path, **kw):
    return tiny_ppo_args(tmp_path, **{"ppo_epochs": 2, "learning_rate": 1e-3, **kw})


def _dataset():
    return Dataset.from_dict({"prompt": SHORT_PROMPTS * 4})


def test_lora_trains_only_adapter_and_value_head(tmp_path, tokenizer):
    from peft import LoraConfig

    model = build_causal_lm("llama", tokenizer, seed=0)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = PPOTrainer(
        model,
        reward_funcs=low_ids,
        args=_args(tmp_path, max_steps=1),
        processing_class=tokenizer,
        train_dataset=_dataset(),
        peft_config=peft_config,
    )
    assert trainer.ref_model is None  # the reference is the adapter-free policy
    before = {n: p.detach().clone() for n, p in trainer.unwrapped().named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.unwrapped().named_parameters() if not torch.equal(p, before[n])}
    assert changed, "nothing trained"
    assert all("lora_" in n or n.startswith("value_head.") for n in changed), changed
    assert any("lora_" in n for n in changed) and "value_head.summary.weight" in changed
    trainer.save_model(str(tmp_path / "saved"))
    assert os.path.isfile(tmp_path / "saved" / "adapter_config.json")
    assert ValueHead.from_pretrained(tmp_path / "saved").hidden_size == 32


def test_save_model_roundtrip(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = build_causal_lm("gpt2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path), processing_class=tokenizer)
    trainer.step([torch.tensor([5, 6])] * 4, [torch.tensor([7, 8, 9])] * 4, scores=[1.0, 0.0, 0.5, 0.2])
    trainer.save_model(str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for (n, p), (_, q) in zip(trainer.policy.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p.detach(), q), n
    head = ValueHead.from_pretrained(tmp_path / "out")
    assert torch.equal(head.summary.weight, trainer.unwrapped().value_head.summary.weight.detach())


def test_resume_reproduces_state(tmp_path, tokenizer):
    """3 steps straight == 2 steps, checkpoint, fresh trainer resumed, 1 more step: same weights, KL coef, scores."""

    def make(out):
        model = build_causal_lm("qwen2", tokenizer, seed=0)
        args = _args(out, max_steps=3, save_strategy="steps", save_steps=2, use_score_scaling=True)
        return PPOTrainer(
            model,
            reward_funcs=[lambda completion_ids, **kw: [len(c) / 5 for c in completion_ids], low_ids],
            args=args,
            processing_class=tokenizer,
            train_dataset=_dataset(),
        )

    straight = make(tmp_path / "a")
    straight.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "trainer_state.json").is_file()
    resumed = make(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 3
    for (n, p), (_, q) in zip(straight.unwrapped().named_parameters(), resumed.unwrapped().named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
    assert resumed.kl_ctl.value == pytest.approx(straight.kl_ctl.value)
    assert resumed.running.state_dict() == pytest.approx(straight.running.state_dict())
    assert step_logs(resumed)[-1]["objective/rlhf_reward"] == pytest.approx(
        step_logs(straight)[-1]["objective/rlhf_reward"]
    )


def test_gradient_checkpointing_and_model_by_name(tmp_path, tokenizer):
    path = save_tiny(tmp_path / "policy", build_causal_lm("qwen2", tokenizer, seed=0), tokenizer)
    args = _args(tmp_path, gradient_checkpointing=True, model_name=path)
    trainer = PPOTrainer(args=args)  # model and tokenizer from args.model_name
    before = {n: p.detach().clone() for n, p in trainer.unwrapped().named_parameters()}
    trainer.step([torch.tensor([5, 6])] * 4, [torch.tensor([7, 8, 9])] * 4, scores=[1.0, 0.0, 0.5, 0.2])
    assert any(not torch.equal(p, before[n]) for n, p in trainer.unwrapped().named_parameters())


def test_bitsandbytes_guard(tmp_path, tokenizer):
    from peft import LoraConfig

    if importlib.util.find_spec("bitsandbytes") is not None and torch.cuda.is_available():
        pytest.skip("bitsandbytes and CUDA present: the guard does not fire")
    path = save_tiny(tmp_path / "policy", build_causal_lm("qwen2", tokenizer, seed=0), tokenizer)
    with pytest.raises(ValueError, match="bitsandbytes"):
        PPOTrainer(path, args=_args(tmp_path, load_in_4bit=True), peft_config=LoraConfig(r=4))
