"""The health monitor inside trl_stable's trainers: on by default, off with one flag, remedies on real runs, and a
tiny GRPO and PPO run that write health.jsonl and the dashboard PNG."""

import json
import re

import pytest
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import PROMPTS

import trl_stable
from trl_stable.monitoring import HealthMonitor
from trl_stable.monitoring.dashboard import main as dashboard_main
from trl_stable.testing import build_causal_lm


def read_health(output_dir):
    return [json.loads(line) for line in (output_dir / "health.jsonl").read_text().splitlines()]


def steps_of(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def grpo(tokenizer, tmp_path, reward, max_steps=3, **extra):
    args = tiny_grpo_args(tmp_path, max_completion_length=6, max_steps=max_steps, learning_rate=1e-2, seed=0, **extra)
    return trl_stable.GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        processing_class=tokenizer,
    )


def length_reward(completions, **kwargs):
    return [min(len(c) / 20.0, 1.0) for c in completions]


def ppo(tokenizer, tmp_path, max_steps, **extra):
    """A tiny gpt2 PPO run of `max_steps` steps (one pass over PROMPTS each) rewarded by `length_reward`."""
    args = tiny_ppo_args(tmp_path, max_new_tokens=6, max_steps=max_steps, **extra)
    return trl_stable.PPOTrainer(
        build_causal_lm("gpt2", tokenizer, seed=0),
        args=args,
        processing_class=tokenizer,
        reward_funcs=[length_reward],
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * max_steps}),
    )


def test_grpo_default_run_writes_health_file_and_dashboard(tokenizer, tmp_path):
    trainer = grpo(tokenizer, tmp_path, length_reward)
    assert isinstance(trainer.callback_handler.callbacks[0], HealthMonitor)  # ahead of the reporters
    trainer.train()
    steps = steps_of(trainer)
    assert len(steps) == 3 and all("health/active_alarms" in h and "health/alarm/zero_std" in h for h in steps)
    records = read_health(tmp_path)
    assert records[0]["type"] == "meta" and records[0]["max_completion_length"] == 6
    metrics = [r for r in records if r["type"] == "metrics"]
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert {"reward", "frac_reward_zero_std", "grad_norm", "completion_length", "entropy"} <= set(metrics[0])
    assert metrics[0]["reward"] == pytest.approx(steps[0]["reward"])
    assert dashboard_main([str(tmp_path)]) == 0
    png = (tmp_path / "health_dashboard.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 10_000


def test_grpo_monitor_off_with_one_flag(tokenizer, tmp_path):
    trainer = grpo(tokenizer, tmp_path, length_reward, max_steps=1, health_monitor=False)
    assert trainer.health_monitor is None
    assert not any(isinstance(cb, HealthMonitor) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert not (tmp_path / "health.jsonl").exists()
    assert not any(k.startswith("health/") for h in trainer.state.log_history for k in h)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"health_monitor": False, "health_remedy_virtual_samples": True}, "health_remedy_virtual_samples"),
        ({"health_monitor_kwargs": {"nope": 1}}, "unknown fields"),
        ({"health_monitor_kwargs": "{not json"}, "JSON"),
        ({"health_stop_after_critical_steps": 0}, "stop_after_critical_steps"),
        # the remedy's configuration is validated as a config when it is built, not first mid-run
        (
            {"health_remedy_virtual_samples": True, "advantage_std_unbiased": False},
            "health_remedy_virtual_samples=True trains with advantage_estimator='ngrpo' while the zero-std alarm "
            "holds, and this configuration refuses advantage_estimator='ngrpo': advantage_std_unbiased does not apply",
        ),
        ({"health_remedy_virtual_samples": True, "advantage_estimator": "ngrpo"}, "already has, so it changes"),
    ],
)
def test_grpo_config_errors(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        tiny_grpo_args(tmp_path, **kwargs)


def test_grpo_virtual_samples_remedy_switches_on_and_off(tokenizer, tmp_path):
    """Equal rewards in every group for two steps: the zero-std alarm switches NGRPO on, which restores a gradient;
    once the groups carry signal again the alarm clears and the estimator goes back to 'grpo'."""

    def reward(completions, trainer_state, **kwargs):
        if trainer_state.global_step < 2:
            return [0.5] * len(completions)  # every group has zero variance
        return [float(i % 2) for i in range(len(completions))]  # each pair (a group) holds a 0 and a 1

    trainer = grpo(
        tokenizer,
        tmp_path,
        reward,
        max_steps=4,
        health_remedy_virtual_samples=True,
        health_monitor_kwargs={"patience": 1, "clear_patience": 1},
    )
    seen = []

    class Spy:  # records the estimator in force for each step's update, before the monitor's on_log
        def __getattr__(self, name):
            return lambda *a, **k: None

        def on_step_begin(self, args, state, control, **kwargs):
            seen.append(trainer.advantage_args().advantage_estimator)

    trainer.callback_handler.callbacks.append(Spy())
    trainer.train()
    steps = steps_of(trainer)
    assert [h["frac_reward_zero_std"] for h in steps] == [1.0, 1.0, 0.0, 0.0]
    assert [h["health/remedy/virtual_samples"] for h in steps] == [1.0, 1.0, 0.0, 0.0]
    assert seen == ["grpo", "ngrpo", "ngrpo", "grpo"]
    assert steps[0]["grad_norm"] == 0.0  # GRPO: zero-variance groups, no gradient
    assert steps[1]["grad_norm"] > 0.0  # NGRPO's virtual 1.0 gives the 0.5s a negative advantage
    assert trainer.args.advantage_estimator == "grpo"  # never changed: the remedy's configuration is its own
    remedies = [(r["kind"], r["step"], r["config_change"]) for r in read_health(tmp_path) if r["type"] == "remedy"]
    assert remedies == [
        ("remedy_on", 1, {"advantage_estimator": {"before": "grpo", "after": "ngrpo"}}),
        ("remedy_off", 3, {"advantage_estimator": {"before": "ngrpo", "after": "grpo"}}),
    ]


def test_grpo_stops_with_checkpoint_after_critical_alarm(tokenizer, tmp_path):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = grpo(
        tokenizer,
        tmp_path,
        constant,
        max_steps=8,
        health_stop_after_critical_steps=2,
        health_monitor_kwargs={"patience": 1},
    )
    trainer.train()
    assert trainer.state.global_step == 2  # grad_norm 0 at step 1 (raised), held 2 steps at step 2
    assert (tmp_path / "checkpoint-2").is_dir()
    stop = [r for r in read_health(tmp_path) if r["type"] == "stop"]
    assert stop == [{"type": "stop", "step": 2, "alarms": ["grad_norm_vanishing"], "since": 1}]


def test_grpo_mismatch_monitor_hf_generation(tokenizer, tmp_path):
    trainer = grpo(
        tokenizer, tmp_path, length_reward, max_steps=2, capture_sampler_logps=True, health_mismatch_monitor=True
    )
    trainer.train()
    steps = steps_of(trainer)
    for h in steps:
        for key in ("mismatch/logp_abs_diff/mean", "mismatch/ratio/outside_band", "mismatch/ppl_ratio/mean"):
            assert key in h and h[key] == h[key], key
        # the same fp32 model samples and scores: HF generation and the trainer's forward agree closely
        assert h["mismatch/logp_abs_diff/mean"] < 1e-3
        assert h["health/alarm/mismatch"] == 0.0
    assert "mismatch" in [r for r in read_health(tmp_path) if r["type"] == "metrics"][0]


def test_grpo_mismatch_alarm_on_injected_sampler_offset(tokenizer, tmp_path):
    """A sampler whose log-probs are off by exactly 0.05 per token: the monitor measures 0.05 and alarms."""

    class OffsetSampler(trl_stable.GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            return completion_ids, [[lp - 0.05 for lp in row] for row in logprobs]

    args = tiny_grpo_args(
        tmp_path,
        max_completion_length=6,
        max_steps=2,
        capture_sampler_logps=True,
        health_mismatch_monitor=True,
        health_monitor_kwargs={"patience": 1},
    )
    trainer = OffsetSampler(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        processing_class=tokenizer,
    )
    trainer.train()
    for h in steps_of(trainer):
        assert h["mismatch/logp_abs_diff/mean"] == pytest.approx(0.05, abs=1e-5)
        assert h["mismatch/ratio/mean"] == pytest.approx(2.718281828**0.05, abs=1e-5)
        assert h["health/alarm/mismatch"] == 1.0
    (alarm,) = [r for r in read_health(tmp_path) if r["type"] == "alarm" and r["alarm"] == "mismatch"]
    assert alarm["kind"] == "raised" and alarm["step"] == 1 and "0.0500 > 0.0100" in alarm["symptom"]


def test_ppo_run_writes_health_file_and_dashboard(tokenizer, tmp_path):
    trainer = ppo(tokenizer, tmp_path, max_steps=2)
    assert trainer.args.health_monitor and trainer.args.health_reward_max is None
    assert isinstance(trainer.callback_handler.callbacks[0], HealthMonitor)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "health/active_alarms" in h]
    assert len(logged) == 2
    records = read_health(tmp_path)
    assert records[0]["max_completion_length"] == 6 and records[0]["kl_target"] == 6.0  # PPOConfig's `target`
    metrics = [r for r in records if r["type"] == "metrics"]
    assert len(metrics) == 2 and {"reward", "entropy", "completion_length"} <= set(metrics[0])
    assert {"kl", "kl_coef", "value_loss"} <= set(metrics[0])  # the PPO dashboard's KL and value-loss panels
    assert dashboard_main([str(tmp_path)]) == 0
    assert (tmp_path / "health_dashboard.png").stat().st_size > 10_000


def test_ppo_decoupled_loss_logs_full_mismatch_stats(tokenizer, tmp_path):
    trainer = ppo(tokenizer, tmp_path, max_steps=1, use_decoupled_loss=True)
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "health/active_alarms" in h]
    for key in ("mismatch/logp_abs_diff/mean", "mismatch/ratio/outside_band", "mismatch/ppl_ratio/mean"):
        assert key in logged, key
    # the sampler is the same fp32 policy: agreement far below the 0.01 alarm level
    assert logged["mismatch/logp_abs_diff/mean"] < 1e-3 and logged["health/alarm/mismatch"] == 0.0
    metrics = [r for r in read_health(tmp_path) if r["type"] == "metrics"]
    assert metrics[0]["mismatch"] == pytest.approx(logged["mismatch/logp_abs_diff/mean"])


def test_ppo_config_rejects_grpo_remedy(tmp_path):
    with pytest.raises(ValueError, match="GRPO remedy"):
        tiny_ppo_args(tmp_path, health_remedy_virtual_samples=True)
