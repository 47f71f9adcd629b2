"""The README's main command against the health monitor: run as written, its KL stays near the target the run
follows and no alarm fires; under the earlier settings its KL runs far past the target and the KL alarm says so."""

import json

import pytest


def _run(load_script, out, *flags):
    from script_args import parse_script_args

    mod = load_script("sentiment/ppo_intrinsic.py", "sentiment_ppo_intrinsic")
    argv = ["--use_intrinsic_reward", *flags, "--model_save_path", str(out)]
    mod.main(parse_script_args(mod.ScriptArguments, argv))
    records = [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]
    assert records[0]["kl_target"] == 6.0  # PPOConfig's `target`, the embedded default's
    return records


@pytest.mark.slow
def test_readme_main_command_stays_near_its_kl_target_and_raises_no_alarm(load_script, tmp_path, capsys):
    records = _run(load_script, tmp_path / "run")
    assert [r for r in records if r["type"] == "alarm"] == []  # the truncation of its drawn lengths included
    kl = [r["kl"] for r in records if r["type"] == "metrics"]
    assert len(kl) == 160 and 0.75 * 6.0 < sum(kl[-20:]) / 20 < 1.5 * 6.0
    assert "KL at the end vs its target 6" in capsys.readouterr().out


@pytest.mark.slow
def test_earlier_settings_overshoot_the_kl_target_and_raise_the_alarm(load_script, tmp_path):
    """The earlier embedded default: a critic reading the reward's own lexicon at RELC's unbounded scale, and the
    controller of the paper runs (init_kl_coef 0.1 then, horizon 10000 samples, 4x this run's)."""
    earlier = ["--critic_lexicon", "vader", "--intrinsic_reward_max_sum", "None"]
    earlier += ["--ppo_config.init_kl_coef", "0.1", "--ppo_config.horizon", "10000", "--max_steps", "100"]
    records = _run(load_script, tmp_path / "run", *earlier)
    kl_events = [(r["kind"], r["step"]) for r in records if r["type"] == "alarm" and r["alarm"] == "kl_above_target"]
    assert [kind for kind, _ in kl_events if kind != "repeated"] == ["raised"], kl_events  # and never cleared
    raised = next(
        r for r in records if r["type"] == "alarm" and r["kind"] == "raised" and r["alarm"] == "kl_above_target"
    )
    assert "raise init_kl_coef" in raised["remedy"] and "shorter horizon" in raised["remedy"]
    kl = [r["kl"] for r in records if r["type"] == "metrics"]
    assert len(kl) == 100 and min(kl[-10:]) > 2 * 6.0
