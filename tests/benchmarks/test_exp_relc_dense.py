"""benchmarks/exp_relc_dense.py: the credit task's reward and critic by hand, and the --quick smoke run of both
experiments (tables, JSON and figure written)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exp():
    spec = importlib.util.spec_from_file_location("exp_relc_dense", REPO / "benchmarks" / "exp_relc_dense.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["exp_relc_dense"] = module
    spec.loader.exec_module(module)
    return module


def test_clean_reward_is_a_minimum_not_a_sum(exp):
    assert exp.clean_reward(["good film", "The film", "films and a plot", "theatre, Andes"]) == [1.0, 0.0, 0.0, 1.0]


def test_credit_critic_marks_the_banned_words_bounded(exp, tokenizer):
    text = " the cat and the dog"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    row = exp.credit_critic(tokenizer)(prompts=[""], completions=[text], completion_ids=[ids], env_rewards=[0.0])[0]
    marked = "".join(tokenizer.decode([t]) for t, v in zip(ids, row) if v < 0).split()
    assert marked == ["the", "and", "the"] and all(v <= 0 for v in row)
    assert sum(row) == pytest.approx(-1.0)  # -0.5 per banned-word token, the sum bounded by 1
    unbounded = exp.credit_critic(tokenizer, max_sum=None)
    row = unbounded(prompts=[""], completions=[text], completion_ids=[ids], env_rewards=[0.0])[0]
    assert sum(row) == pytest.approx(-0.5 * sum(v != 0 for v in row)) and sum(row) < -1.0


def test_mask_eos_holds_in_every_forward_and_in_copies(exp, tokenizer):
    import copy

    import torch

    from trl_stable.testing import build_causal_lm

    model = exp.mask_eos(build_causal_lm("gpt2", tokenizer, seed=0), tokenizer.eos_token_id)
    ids = torch.tensor([tokenizer("The movie was")["input_ids"]])
    for m in (model, copy.deepcopy(model)):  # PPOTrainer's reference model is a deep copy
        logp = torch.log_softmax(m(input_ids=ids).logits, dim=-1)
        assert (logp[..., tokenizer.eos_token_id] < -1e8).all() and torch.isfinite(logp).all()
    out = model.generate(ids, do_sample=True, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 12 and tokenizer.eos_token_id not in out[0, ids.shape[1] :].tolist()


def test_frontier_and_steps_to_level_by_hand(exp):
    history = [{"env_reward": r, "kl": k} for r, k in [(0.0, 0.0), (1.0, 2.0), (1.0, 10.0), (0.0, 20.0)]]
    # 2-step means: rewards 0, .5, 1, .5; KL 0, 1, 6, 15 (full windows from the second step)
    assert exp.frontier(history, 1.0, window=2) == 0.5
    assert exp.frontier(history, 6.0, window=2) == 1.0
    assert math.isnan(exp.frontier(history, 0.5, window=2))
    assert exp.steps_to_level([0.0, 1.0, 1.0, 1.0], 0.9, window=2) == 3
    assert exp.steps_to_level([0.0, 0.0], 0.5, window=2) is None


def test_quick_mode_runs_both_experiments(exp, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_STABLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    results = exp.main(["--quick", "--output_dir", str(out)])
    assert set(results) == {"credit", "sentiment"}
    for task, arms in exp.ARMS.items():
        assert set(results[task]) == set(arms)
        assert all(len(results[task][a]) == 2 and len(results[task][a][0]["history"]) == 3 for a in arms)
        saved = json.loads((out / f"results_{task}.json").read_text())
        assert len(saved["initial"]) == 2 and math.isnan(saved["initial"][0]["final_kl"])
        table = (out / f"results_{task}.md").read_text()
        assert "| metric | initial | " + " | ".join(arms) + " |" in table and "| perplexity |" in table
        assert (out / f"relc_{task}.png").stat().st_size > 10_000
    dense = results["credit"]["dense"][0]["history"]
    summed = results["credit"]["critic_sum"][0]["history"]
    assert all(h["intrinsic_reward"] <= 0 for h in dense + summed)  # the critic only penalizes banned words
    assert 0.0 <= results["sentiment"]["baseline"][0]["positive_textblob"] <= 1.0
    assert results["sentiment"]["baseline"][0]["final_intrinsic"] == 0.0
