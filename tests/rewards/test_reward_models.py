"""One reward-model scoring path for both trainers: PPO's scores equal TRL's GRPO scores for the same reward model,
prompts and completions (plain text and chat), and an independent forward of the expected text gives them too."""

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args

from trl_stable import GRPOTrainer, PPOTrainer
from trl_stable.rewards.reward_models import prepare_reward_model, reward_model_scores
from trl_stable.testing import build_causal_lm, build_reward_model

PLAIN = (["The movie was", "A story", "I think that it"], [" great fun", " about nothing at all", "."])
CHAT = (
    [[{"role": "user", "content": "Review the movie"}], [{"role": "user", "content": "Hi"}]],
    [[{"role": "assistant", "content": "It was great fun"}], [{"role": "assistant", "content": "Hello there"}]],
)


def _grpo_scores(tmp_path, tokenizer, reward_model, prompts, completions):
    """TRL's own `_calculate_rewards` (through trl_stable's GRPOTrainer, which leaves reward models to TRL)."""
    args = tiny_grpo_args(tmp_path / "grpo", per_device_train_batch_size=2, max_completion_length=4)
    trainer = GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=reward_model,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}),
        processing_class=tokenizer,
        reward_processing_classes=tokenizer,
    )
    inputs = [{"prompt": p} for p in prompts]
    ids = [tokenizer(c if isinstance(c, str) else c[0]["content"])["input_ids"] for c in completions]
    return trainer._calculate_rewards(inputs, prompts, completions, ids)[:, 0].cpu()


def _ppo_scores(tmp_path, tokenizer, reward_model, prompts, completions):
    """PPO's reward calling (`PPOTrainer.rewards`), given the completions as token ids, as `train()` gives them."""
    args = tiny_ppo_args(tmp_path / "ppo", batch_size=2)  # mini_batch_size 2: per_device_train_batch_size 2
    trainer = PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=reward_model,
        args=args,
        processing_class=tokenizer,
        reward_processing_classes=tokenizer,
    )
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    responses = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    rows = [{"prompt": p} for p in prompts]
    return trainer.rewards.start(rows, prompts, responses, trainer.state).result().scores.float()


@pytest.mark.parametrize("case", ["plain", "chat"])
def test_ppo_and_grpo_score_a_reward_model_identically(tmp_path, tokenizer, case):
    prompts, completions = PLAIN if case == "plain" else CHAT
    reward_model = build_reward_model("gpt2", tokenizer, seed=3)
    grpo = _grpo_scores(tmp_path, tokenizer, reward_model, prompts, completions)
    ppo = _ppo_scores(tmp_path, tokenizer, reward_model, prompts, completions)
    torch.testing.assert_close(ppo, grpo, rtol=0, atol=0)

    # independently: the model's logit 0 on the whole text, tokenized without special tokens, one row at a time (no
    # padding), read at its last token
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if case == "plain":
            text = p + c
        else:
            text = tokenizer.apply_chat_template(p + c, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            alone = reward_model(input_ids=ids).logits[0, 0]
        assert ppo[i].item() == pytest.approx(alone.item(), abs=1e-5)


def test_the_reward_model_reads_the_last_token_before_padding(tokenizer):
    # the pad token set on the model (TRL's rule): right padding must not change a row's score
    model = build_reward_model("gpt2", tokenizer, seed=1)
    proc = prepare_reward_model(model, None, tokenizer)
    assert model.config.pad_token_id == proc.pad_token_id
    prompts, completions = PLAIN
    batched = reward_model_scores(model, proc, prompts, completions)
    single = torch.cat([reward_model_scores(model, proc, [p], [c]) for p, c in zip(prompts, completions)])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)


def test_a_nameless_reward_model_with_another_vocabulary_needs_its_tokenizer(tokenizer):
    model = build_reward_model("gpt2", tokenizer, seed=0, vocab_size=len(tokenizer) + 7)
    with pytest.raises(ValueError, match="pass its tokenizer in reward_processing_classes"):
        prepare_reward_model(model, None, tokenizer)
