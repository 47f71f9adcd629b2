"""The end-of-run side-by-side of the research scripts (`run_summary.run_summary`), the before/after samples
(`sample_preview`), the embedded critic defaults of the sentiment script and the offline sentiment evaluators."""

import random

import pytest
import torch


def _history(rewards, kls, d2s):
    return [
        {"step": i + 1, "env_reward": r, "intrinsic_reward": 0.5, "kl": k, "distinct_2": d}
        for i, (r, k, d) in enumerate(zip(rewards, kls, d2s))
    ]


def test_run_summary_hand_values_and_caution():
    from run_summary import run_summary

    history = _history([0.0, 0.2, 0.8, 1.0], [0.0, 2.0, 20.0, 30.0], [0.9, 0.7, 0.4, 0.2])
    text = run_summary(history, ["The film"], [" was long"], [" great great"], "reward", target_kl=6.0, window=2)
    lines = text.splitlines()
    assert lines[0] == "Summary: means of steps 1-2 -> steps 3-4"
    assert (
        "0.100 -> 0.900" in lines[1] and "KL to the reference (target 6)" in lines[3] and "1.00 -> 25.00" in lines[3]
    )
    assert "0.800 -> 0.300" in lines[4]
    assert lines[5] == "  KL at the end vs its target 6      25.00, +19.00 (+317%)"  # (20 + 30) / 2 - 6
    assert "Caution: the KL ends at 25.0, above twice its target 6 and distinct-2 fell from 0.80 to 0.30" in text
    assert "    before: 'was long'" in text and "    after:  'great great'" in text


def test_run_summary_without_trouble_has_no_caution():
    from run_summary import run_summary

    history = _history([0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 3.0, 4.0], [0.9, 0.9, 0.85, 0.85])
    text = run_summary(history, ["p"], ["a"], ["b"], target_kl=6.0, window=20)  # a short run: its two halves
    assert text.splitlines()[0] == "Summary: means of steps 1-2 -> steps 3-4" and "Caution" not in text
    assert "  KL at the end vs its target 6      3.50, -2.50 (-42%)" in text  # below the target: how far, too
    assert "KL at the end" not in run_summary(history, ["p"], ["a"], ["b"], target_kl=None)


def test_sample_preview_leaves_the_run_rng_alone(tmp_path, tokenizer):
    from run_summary import sample_preview
    from tiny_configs import tiny_ppo_args

    from trl_stable import PPOTrainer
    from trl_stable.testing import build_causal_lm

    args = tiny_ppo_args(tmp_path, batch_size=2, mini_batch_size=1, max_new_tokens=4)
    trainer = PPOTrainer(build_causal_lm("gpt2", tokenizer, seed=0), args=args, processing_class=tokenizer)
    torch.manual_seed(123)
    random.seed(5)
    first = sample_preview(trainer, tokenizer, ["The movie", "A story"], max_new_tokens=4, seed=7)
    after_torch, after_py = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(5)
    assert (torch.rand(3) == after_torch).all() and random.random() == after_py
    assert sample_preview(trainer, tokenizer, ["The movie", "A story"], max_new_tokens=4, seed=7) == first
    assert len(first) == 2 and all(isinstance(t, str) for t in first)


def test_embedded_sentiment_critic_is_afinn_bounded_paper_mode_is_relc(load_script):
    from script_args import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    critic = parse_script_args(mod.ScriptArguments, ["--use_intrinsic_reward"]).critic
    assert (critic.critic_lexicon, critic.intrinsic_reward_max_sum, critic.intrinsic_reward_coef) == (
        "afinn",
        0.5,
        1.0,
    )
    earlier = ["--critic_lexicon", "vader", "--intrinsic_reward_max_sum", "None"]
    critic = parse_script_args(mod.ScriptArguments, earlier).critic
    assert (critic.critic_lexicon, critic.intrinsic_reward_max_sum) == ("vader", None)
    paper = parse_script_args(mod.ScriptArguments, ["--ppo_config.model_name", "gpt2-large"]).critic
    assert (paper.critic_backend, paper.critic_lexicon, paper.intrinsic_reward_max_sum) == ("openai", "vader", None)


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("textblob", "a great film", (0.8 + 1) / 2),  # pattern lexicon: great 0.8
        ("afinn", "a good film", None),  # AFINN: good +3 -> (tanh(3/5) + 1) / 2
        ("afinn", "not good, boring", None),  # -3 (negated good) - 3 (boring)
        ("vader", "plain words", 0.5),  # no sentiment word: compound 0
    ],
)
def test_offline_sentiment_classifiers_hand_values(name, text, expected):
    import math

    from scorers import afinn_score, build_sentiment_classifier

    prob = build_sentiment_classifier(name)([text])[0]
    if name == "afinn":
        score = {"a good film": 3.0, "not good, boring": -6.0}[text]
        assert afinn_score([text]) == [score]
        expected = (math.tanh(score / 5) + 1) / 2
    assert prob == pytest.approx(expected)


def test_embedded_warm_up_does_not_depend_on_the_process_rng(tmp_path):
    """Dropout masks of the warm-up come from its seed: two processes (here: two RNG states) build the same model,
    and the caller's RNG is left as it was."""
    from embedded import embedded_policy

    models = []
    for i, global_seed in enumerate((1, 2)):
        torch.manual_seed(global_seed)
        model, _ = embedded_policy(
            "sentiment", seed=3, warmup_steps=3, cache_dir=tmp_path / str(i), show_progress=False
        )
        models.append(model)
        torch.manual_seed(global_seed)
        expected = torch.rand(2)
        torch.manual_seed(global_seed)
        embedded_policy("sentiment", seed=3, warmup_steps=3, cache_dir=tmp_path / f"fresh{i}", show_progress=False)
        assert (torch.rand(2) == expected).all()
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
        assert torch.equal(a, b)
