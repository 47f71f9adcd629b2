"""Start-up and per-batch prompt checks of both trainers: generation length against the model's context, prompts
too long for a learned position table, and missing or empty prompts, each refused naming the field or the sample
(before these checks: an IndexError inside the embedding, a tokenizer TypeError, or a float-typed empty tensor)."""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from transformers import AutoModelForCausalLM

from trl_stable import GRPOTrainer, PPOTrainer
from trl_stable.testing import build_causal_lm
from trl_stable.trainers.prompt_checks import ModelContext, model_context

LONG = " ".join(["word"] * 300)  # 601 tokens of the tiny tokenizer: past the tiny models' 256 positions


def _length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _ppo(tmp_path, tokenizer, family="gpt2", train_dataset=None, **kw):
    return PPOTrainer(
        build_causal_lm(family, tokenizer, seed=0),
        reward_funcs=_length if train_dataset is not None else None,
        args=tiny_ppo_args(tmp_path, **kw),
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )


def _grpo(tmp_path, tokenizer, prompts, family="gpt2", **kw):
    args = tiny_grpo_args(tmp_path, **{"per_device_train_batch_size": 2, "max_completion_length": 4, **kw})
    return GRPOTrainer(
        build_causal_lm(family, tokenizer, seed=0),
        reward_funcs=_length,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )


def test_model_context_reads_the_config_and_finds_learned_positions(tokenizer):
    assert model_context(build_causal_lm("gpt2", tokenizer)) == ModelContext(
        256, "config.max_position_embeddings", True
    )
    assert model_context(build_causal_lm("qwen2", tokenizer)) == ModelContext(256, "config.max_position_embeddings")
    # OPT's learned table has two extra rows (its position offset)
    opt = AutoModelForCausalLM.from_config(_tiny_opt_config(tokenizer))
    assert model_context(opt).learned and model_context(opt).limit == 64
    assert model_context(torch.nn.Linear(2, 2)) == ModelContext(None)


def _tiny_opt_config(tokenizer):
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        max_position_embeddings=64, word_embed_proj_dim=16,
    )  # fmt: skip


# ---------------------------------------------------------------- PPO
def test_ppo_generation_length_filling_a_learned_context_is_refused_at_init(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"max_new_tokens=256 leaves no room .* Lower max_new_tokens below 256"):
        _ppo(tmp_path, tokenizer, max_new_tokens=256)


def test_ppo_long_train_prompt_is_refused_at_init_naming_the_row_and_the_fix(tmp_path, tokenizer):
    data = Dataset.from_dict({"prompt": ["a short prompt", LONG, "another"]})
    with pytest.raises(ValueError, match=r"train_dataset row 1 \(601 tokens\).* Set max_prompt_length=251"):
        _ppo(tmp_path, tokenizer, train_dataset=data, max_prompt_length=None)
    # the default max_prompt_length (512) lets the long prompt through too; 251 cuts it to a length that fits
    with pytest.raises(ValueError, match="train_dataset row 1"):
        _ppo(tmp_path, tokenizer, train_dataset=data)
    _ppo(tmp_path, tokenizer, train_dataset=data, max_prompt_length=251)


def test_ppo_generate_refuses_a_query_past_the_context_and_keeps_the_train_mode(tmp_path, tokenizer):
    trainer = _ppo(tmp_path, tokenizer)
    policy = trainer.unwrapped().policy
    policy.train()
    queries = [torch.tensor([5, 6]), torch.full((252,), 7)]
    with pytest.raises(ValueError, match=r"query 1 \(252 tokens\): with 5 generated tokens .* at most 251 tokens"):
        trainer.generate(queries)
    assert policy.training
    assert len(trainer.generate([torch.full((251,), 7)], return_prompt=False)[0]) <= 5


def test_ppo_rotary_model_past_its_context_warns(tmp_path, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_stable.trainers.prompt_checks"):
        _ppo(tmp_path, tokenizer, family="qwen2", max_new_tokens=300)
    assert "max_new_tokens=300 leaves no room for a prompt in the model's context of 256 positions" in caplog.text


@pytest.mark.parametrize("prompt, problem", [("", "is an empty string"), (None, r"is None")])
def test_ppo_missing_or_empty_prompt_is_refused_naming_the_row(tmp_path, tokenizer, prompt, problem):
    data = Dataset.from_dict({"prompt": ["fine", prompt, "fine", "fine"]})
    with pytest.raises(ValueError, match=f"The prompt of train_dataset row 1 {problem}"):
        _ppo(tmp_path, tokenizer, family="qwen2", train_dataset=data)


def test_ppo_prompt_without_tokens_is_refused_at_its_step(tmp_path, tokenizer):
    trainer = _ppo(tmp_path, tokenizer, family="qwen2")
    with pytest.raises(ValueError, match="The prompt of train_dataset row 7 has no tokens"):
        trainer._prompt_ids([{"input_ids": [5]}, {"input_ids": []}], [3, 7])


# ---------------------------------------------------------------- GRPO
def test_grpo_completion_length_filling_a_learned_context_is_refused_at_init(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="max_completion_length=300 leaves no room"):
        _grpo(tmp_path, tokenizer, ["a b", "c d"], max_completion_length=300)


@pytest.mark.parametrize("prompt, problem", [("", "is an empty string"), (None, "is None")])
def test_grpo_missing_or_empty_prompt_is_refused_at_init(tmp_path, tokenizer, prompt, problem):
    with pytest.raises(ValueError, match=f"The prompt of train_dataset row 1 {problem}"):
        _grpo(tmp_path, tokenizer, ["a b", prompt], family="qwen2")


def test_grpo_long_prompt_is_refused_at_its_batch_naming_it(tmp_path, tokenizer):
    trainer = _grpo(tmp_path, tokenizer, [LONG, LONG])
    with pytest.raises(ValueError, match=r"row 0 of this process's generation batch \(601 tokens\).*at most 252"):
        trainer.train()


def test_grpo_per_batch_check_names_the_prompt(tmp_path, tokenizer):
    trainer = _grpo(tmp_path, tokenizer, ["a b", "c d"], family="qwen2")
    with pytest.raises(ValueError, match="The prompt of row 1 of this process's generation batch is None"):
        trainer._tokenize_prompts(["a b", None])
    with pytest.raises(ValueError, match="row 0 of this process's generation batch is empty"):
        trainer._tokenize_prompts([[], [{"role": "user", "content": "hi"}]])
    prompt_ids, _, _ = trainer._tokenize_prompts(["a b", LONG])  # a rotary model: TRL's behaviour, no refusal
    assert len(prompt_ids[1]) == 601


def test_a_dataset_without_a_prompt_column_is_refused_at_start_up_naming_its_columns(tmp_path, tokenizer):
    """GRPO needs a 'prompt' column (TRL raised KeyError: 'prompt' inside its first step), PPO a 'prompt' or an
    'input_ids' one: both refuse the dataset when the trainer is built, naming the columns it has and the fix."""
    texts = Dataset.from_dict({"text": ["The movie was", "A story"]})
    with pytest.raises(ValueError, match=r"train_dataset has no 'prompt' column \(its columns: text\).*rename_column"):
        GRPOTrainer(
            build_causal_lm("gpt2", tokenizer, seed=0), reward_funcs=_length, processing_class=tokenizer,
            args=tiny_grpo_args(tmp_path, per_device_train_batch_size=2), train_dataset=texts,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"train_dataset has no 'prompt' or 'input_ids' column \(its columns: text\)"):
        _ppo(tmp_path, tokenizer, train_dataset=texts)
    ids = Dataset.from_dict({"input_ids": [[5, 6], [7, 8]]})
    assert _ppo(tmp_path, tokenizer, train_dataset=ids).train_dataset is not None  # PPO's other prompt column
