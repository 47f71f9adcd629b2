"""The README's main command runs with its KL far above the target it was given: the health monitor must say so."""

import json

import pytest


@pytest.mark.slow
def test_readme_main_command_raises_the_kl_alarm(load_script, tmp_path):
    from script_args import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    out = tmp_path / "run"
    argv = ["--use_intrinsic_reward", "--max_steps", "100", "--model_save_path", str(out)]
    mod.main(parse_script_args(mod.ScriptArguments, argv))
    records = [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]
    assert records[0]["kl_target"] == 6.0  # PPOConfig's `target`, the embedded default's
    kl_events = [(r["kind"], r["step"]) for r in records if r["type"] == "alarm" and r["alarm"] == "kl_above_target"]
    assert [kind for kind, _ in kl_events if kind != "repeated"] == ["raised"], kl_events  # and never cleared
    raised = next(
        r for r in records if r["type"] == "alarm" and r["kind"] == "raised" and r["alarm"] == "kl_above_target"
    )
    assert "raise init_kl_coef" in raised["remedy"]
    kl = [r["kl"] for r in records if r["type"] == "metrics"]
    assert len(kl) == 100 and min(kl[-10:]) > 2 * 6.0
