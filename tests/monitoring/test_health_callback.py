"""HealthMonitor as a TrainerCallback: logs, log history, health file, remedies; and on a plain TRL trainer."""

import json
import logging
from types import SimpleNamespace

import pytest
from tiny_configs import tiny_grpo_args
from transformers import TrainerControl, TrainerState

from trl_stable.monitoring import HealthConfig, HealthMonitor, health_config_from_args


def simulate(monitor, args, records):
    """Drive the callback as Trainer.log does: history gets a copy of the logs, then on_log sees the logs."""
    state, control = TrainerState(), TrainerControl()
    monitor.on_train_begin(args, state, control)
    seen = []
    for step, logs in enumerate(records, start=1):
        state.global_step = step
        logs = dict(logs)
        state.log_history.append({**logs, "step": step})
        control = monitor.on_log(args, state, control, logs=logs)
        seen.append(logs)
        if control.should_training_stop:
            break
    monitor.on_train_end(args, state, control)
    return state, control, seen


def records(n, **overrides):
    base = {"loss": 0.0, "grad_norm": 0.4, "reward": 0.5, "frac_reward_zero_std": 0.1, "entropy": 1.5}
    out = []
    for i in range(n):
        record = dict(base)
        for key, fn in overrides.items():
            record[key] = fn(i)
        out.append(record)
    return out


def read_health(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_alarm_goes_to_logs_history_file_and_logger(tmp_path, caplog):
    args = SimpleNamespace(output_dir=str(tmp_path), max_completion_length=16)
    monitor = HealthMonitor(reward_max=None)
    with caplog.at_level(logging.WARNING, logger="trl_stable.monitoring"):
        state, _, seen = simulate(monitor, args, records(8, frac_reward_zero_std=lambda i: 0.9 if i >= 2 else 0.1))
    # raised at the third bad record (step 5)
    assert [(e.kind, e.alarm, e.step) for e in monitor.events] == [("raised", "zero_std", 5)]
    assert seen[3]["health/alarm/zero_std"] == 0.0 and seen[4]["health/alarm/zero_std"] == 1.0
    assert state.log_history[4]["health/active_alarms"] == 1.0
    assert state.log_history[4]["health/alarm/zero_std"] == 1.0
    assert state.log_history[4]["health/reward_ceiling"] == 0.5
    assert sum("zero_std" in r.message and "Remedy: inject virtual samples" in r.message for r in caplog.records) == 1
    assert monitor.summary() == "[health] alarms raised during the run: zero_std; still active: zero_std"

    lines = read_health(tmp_path / "health.jsonl")
    assert lines[0]["type"] == "meta" and lines[0]["max_completion_length"] == 16
    metrics = [r for r in lines if r["type"] == "metrics"]
    assert [r["step"] for r in metrics] == list(range(1, 9))
    assert metrics[4]["frac_reward_zero_std"] == 0.9 and metrics[4]["active"] == ["zero_std"]
    (alarm,) = [r for r in lines if r["type"] == "alarm"]
    assert alarm["alarm"] == "zero_std" and alarm["kind"] == "raised" and alarm["cause"] and alarm["remedy"]


def test_fresh_run_truncates_health_file(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path), max_completion_length=16)
    simulate(HealthMonitor(), args, records(3))
    simulate(HealthMonitor(), args, records(2))
    lines = read_health(tmp_path / "health.jsonl")
    assert [r["type"] for r in lines] == ["meta", "metrics", "metrics"]


def test_eval_and_summary_logs_are_ignored(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    monitor = HealthMonitor()
    state, control = TrainerState(), TrainerControl()
    monitor.on_train_begin(args, state, control)
    logs = {"eval_reward": 0.1, "eval_loss": 1.0}
    monitor.on_log(args, state, control, logs=logs)
    summary = {"train_runtime": 1.0, "train_loss": 0.3}
    monitor.on_log(args, state, control, logs=summary)
    assert "health/active_alarms" not in logs and "health/active_alarms" not in summary
    assert [r["type"] for r in read_health(tmp_path / "health.jsonl")] == ["meta"]


def test_only_the_main_process_writes_and_logs(tmp_path, caplog):
    # Every process sees the same (gathered) logs and switches the remedy; only process zero writes and logs.
    args = SimpleNamespace(output_dir=str(tmp_path), advantage_estimator="grpo")
    monitor = HealthMonitor(remedy_virtual_samples=True)
    state, control = TrainerState(), TrainerControl()
    state.is_world_process_zero = False
    with caplog.at_level(logging.INFO, logger="trl_stable.monitoring"):
        monitor.on_train_begin(args, state, control)
        for step, logs in enumerate(records(6, frac_reward_zero_std=lambda i: 0.9), start=1):
            state.global_step = step
            state.log_history.append({**logs, "step": step})
            monitor.on_log(args, state, control, logs=logs)
        assert monitor.remedy_active and logs["health/alarm/zero_std"] == 1.0
        monitor.on_train_end(args, state, control)
    assert list(tmp_path.iterdir()) == [] and caplog.records == []
    assert args.advantage_estimator == "grpo"  # the monitor never writes to the arguments


def test_resumed_run_appends_valid_json_lines(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    simulate(HealthMonitor(), args, records(2, grad_norm=lambda i: float("nan")))
    monitor = HealthMonitor()
    state, control = TrainerState(), TrainerControl()
    state.global_step = 2  # Trainer loads the checkpoint's state before on_train_begin
    monitor.on_train_begin(args, state, control)
    state.global_step = 3
    monitor.on_log(args, state, control, logs=records(1)[0])
    text = (tmp_path / "health.jsonl").read_text()
    assert text.endswith("\n")

    def strict(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    for line in text.splitlines():  # strict JSON, one record per line
        json.loads(line, parse_constant=strict)
    lines = read_health(tmp_path / "health.jsonl")
    assert [(r["type"], r["step"]) for r in lines if r["type"] != "alarm"] == [
        ("meta", 0),
        ("metrics", 1),
        ("metrics", 2),
        ("meta", 2),
        ("metrics", 3),
    ]
    assert [r for r in lines if r["type"] == "metrics"][0]["grad_norm"] == "nan"


def test_unwritable_health_file_warns_once_and_training_goes_on(tmp_path, caplog):
    args = SimpleNamespace(output_dir=str(tmp_path))
    monitor = HealthMonitor()
    state, control = TrainerState(), TrainerControl()
    monitor.on_train_begin(args, state, control)
    (tmp_path / "health.jsonl").unlink()
    (tmp_path / "health.jsonl").mkdir()  # open() now fails with IsADirectoryError
    with caplog.at_level(logging.WARNING, logger="trl_stable.monitoring"):
        for step, logs in enumerate(records(3), start=1):
            state.global_step = step
            monitor.on_log(args, state, control, logs=logs)
    assert sum("cannot write" in r.message for r in caplog.records) == 1
    assert monitor.health_path is None and logs["health/active_alarms"] == 0.0


def test_virtual_samples_remedy_switches_on_and_off_as_a_logged_config_change(tmp_path, caplog):
    """The remedy follows the alarm; each switch is recorded as a configuration change with the before and after
    values, and the trainer arguments stay as the user set them (the trainer reads `remedy_active`)."""
    args = SimpleNamespace(output_dir=str(tmp_path), advantage_estimator="grpo")
    monitor = HealthMonitor(remedy_virtual_samples=True, reward_max=None)
    seen_values = []

    zero_std = lambda i: 0.9 if 2 <= i < 8 else 0.1  # noqa: E731
    state, control = TrainerState(), TrainerControl()
    monitor.on_train_begin(args, state, control)
    with caplog.at_level(logging.WARNING, logger="trl_stable.monitoring"):
        for step, logs in enumerate(records(14, frac_reward_zero_std=zero_std), start=1):
            state.global_step = step
            state.log_history.append({**logs, "step": step})
            monitor.on_log(args, state, control, logs=logs)
            seen_values.append((monitor.remedy_active, logs["health/remedy/virtual_samples"]))
    # raised at step 5 (third bad record), cleared at step 11 (third good record after step 8)
    assert [v for v, _ in seen_values] == [False] * 4 + [True] * 6 + [False] * 4
    assert [f for _, f in seen_values] == [0.0] * 4 + [1.0] * 6 + [0.0] * 4
    assert args.advantage_estimator == "grpo"
    remedies = [r for r in read_health(tmp_path / "health.jsonl") if r["type"] == "remedy"]
    assert [(r["kind"], r["step"], r["config_change"]) for r in remedies] == [
        ("remedy_on", 5, {"advantage_estimator": {"before": "grpo", "after": "ngrpo"}}),
        ("remedy_off", 11, {"advantage_estimator": {"before": "ngrpo", "after": "grpo"}}),
    ]
    switches = [r.message for r in caplog.records if "virtual samples switched" in r.message]
    assert switches == [
        "[health] step 5: virtual samples switched ON: configuration change advantage_estimator 'grpo' -> 'ngrpo'",
        "[health] step 11: virtual samples switched OFF: configuration change advantage_estimator 'ngrpo' -> 'grpo'",
    ]


def test_remedy_leaves_the_arguments_alone_and_missing_attr_warns(tmp_path, caplog):
    args = SimpleNamespace(output_dir=str(tmp_path), advantage_estimator="dr_grpo")
    monitor = HealthMonitor(remedy_virtual_samples=True)
    simulate(monitor, args, records(6, frac_reward_zero_std=lambda i: 0.9))
    assert monitor.remedy_active and args.advantage_estimator == "dr_grpo"

    plain = SimpleNamespace(output_dir=str(tmp_path))
    monitor = HealthMonitor(remedy_virtual_samples=True)
    with caplog.at_level(logging.WARNING, logger="trl_stable.monitoring"):
        simulate(monitor, plain, records(6, frac_reward_zero_std=lambda i: 0.9))
    assert not hasattr(plain, "advantage_estimator") and not monitor.remedy_active
    assert any("cannot switch on virtual samples" in r.message for r in caplog.records)


def test_stop_after_critical_steps_saves_and_stops(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    monitor = HealthMonitor(stop_after_critical_steps=4)
    state, control, _ = simulate(monitor, args, records(30, grad_norm=lambda i: 0.4 if i < 5 else 0.0))
    # grad norm 0 from step 6, raised at step 8 (patience 3), held 4 steps at step 11
    assert state.global_step == 11
    assert control.should_save and control.should_training_stop
    stops = [r for r in read_health(tmp_path / "health.jsonl") if r["type"] == "stop"]
    assert stops == [{"type": "stop", "step": 11, "alarms": ["grad_norm_vanishing"], "since": 8}]


def test_warning_alarm_never_stops(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    _, control, seen = simulate(
        HealthMonitor(stop_after_critical_steps=2), args, records(12, frac_reward_zero_std=lambda i: 0.9)
    )
    assert len(seen) == 12 and not control.should_training_stop


def test_kl_target_comes_from_ppo_arguments(tmp_path):
    ppo_args = SimpleNamespace(output_dir=str(tmp_path), adap_kl_ctrl=True, target=6.0)
    monitor = HealthMonitor(reward_max=None)
    simulate(monitor, ppo_args, [{"objective/kl": 30.0, "objective/kl_coef": 0.1}] * 6)
    assert [(e.kind, e.alarm, e.step) for e in monitor.events] == [("raised", "kl_above_target", 5)]
    lines = read_health(tmp_path / "health.jsonl")
    assert lines[0]["kl_target"] == 6.0 and lines[1]["kl"] == 30.0 and lines[1]["kl_coef"] == 0.1
    # GRPO's arguments have no KL controller: its `kl` gauge is recorded, and raises nothing
    monitor = HealthMonitor(reward_max=None)
    simulate(monitor, SimpleNamespace(output_dir=str(tmp_path / "grpo"), beta=0.04), [{"kl": 30.0}] * 6)
    assert monitor.events == [] and monitor.tracker.kl_target is None
    # a target in the config wins over the trainer's
    monitor = HealthMonitor(reward_max=None, kl_target=20.0)
    simulate(monitor, ppo_args, [{"objective/kl": 30.0}] * 6)
    assert monitor.events == [] and monitor.tracker.kl_target == 20.0


def test_config_from_trainer_args():
    assert health_config_from_args(SimpleNamespace(health_monitor=False)) is None
    cfg = health_config_from_args(
        SimpleNamespace(
            health_monitor=True,
            health_reward_max=2.0,
            health_stop_after_critical_steps=7,
            health_monitor_kwargs={"patience": 5},
        )
    )
    assert (cfg.reward_max, cfg.stop_after_critical_steps, cfg.patience) == (2.0, 7, 5)
    assert health_config_from_args(SimpleNamespace()) == HealthConfig()
    with pytest.raises(ValueError, match="unknown fields"):
        health_config_from_args(SimpleNamespace(health_monitor_kwargs={"nope": 1}))
    with pytest.raises(ValueError, match="both"):
        HealthMonitor(HealthConfig(), patience=2)


def test_plain_trl_grpo_trainer(tokenizer, tmp_path):
    """Usable with TRL's own trainer: attach() puts it ahead of the reporters; the run writes health.jsonl."""
    import trl
    from datasets import Dataset

    from trl_stable.testing import build_causal_lm

    def constant_reward(completions, **kwargs):
        return [1.0 for _ in completions]  # every group has zero std: the zero-std alarm must fire

    args = tiny_grpo_args(tmp_path, config_class=trl.GRPOConfig, max_completion_length=6, max_steps=4)
    trainer = trl.GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=constant_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["The movie was", "I think the"] * 4}),
        processing_class=tokenizer,
    )
    monitor = HealthMonitor(patience=2).attach(trainer)
    assert trainer.callback_handler.callbacks[0] is monitor
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 4 and all("health/alarm/zero_std" in h for h in steps)
    assert steps[-1]["health/alarm/zero_std"] == 1.0
    assert steps[-1]["health/alarm/grad_norm_vanishing"] == 1.0  # zero advantages, zero gradient
    lines = read_health(tmp_path / "health.jsonl")
    assert lines[0]["max_completion_length"] == 6
    assert {r["alarm"] for r in lines if r["type"] == "alarm"} >= {"zero_std", "grad_norm_vanishing"}


def test_dashboard_on_train_end(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path), max_completion_length=16)
    simulate(HealthMonitor(dashboard_on_train_end=True), args, records(6))
    assert (tmp_path / "health_dashboard.png").stat().st_size > 10_000


def _feed(monitor, args, state, control, logs_list, first_step):
    flags = []
    for step, logs in enumerate(logs_list, start=first_step):
        state.global_step = step
        logs = dict(logs)
        state.log_history.append({**logs, "step": step})
        monitor.on_log(args, state, control, logs=logs)
        flags.append({k: v for k, v in logs.items() if k.startswith("health/")})
    return flags


def test_checkpoint_state_resumes_alarms_ceiling_remedy_and_events(tmp_path):
    """A monitor restored from a step-4 checkpoint (through torch's safe loader) behaves from step 5 on exactly as
    the one that ran on: the zero-std alarm and its remedy stay on, the reward ceiling is kept."""
    import torch

    logs = records(8, frac_reward_zero_std=lambda i: 0.9, reward=lambda i: [0.2, 0.9, 0.3, 0.4, 0.5, 0.1, 0.2, 0.3][i])
    config = dict(remedy_virtual_samples=True, reward_max=None, health_file=None)
    args = SimpleNamespace(output_dir=str(tmp_path), advantage_estimator="grpo")
    straight = HealthMonitor(**config)
    state, control = TrainerState(), TrainerControl()
    straight.on_train_begin(args, state, control)
    before = _feed(straight, args, state, control, logs[:4], 1)
    assert before[-1]["health/alarm/zero_std"] == 1.0 and straight.remedy_active
    torch.save(straight.checkpoint_state(), tmp_path / "state.pt")
    after_straight = _feed(straight, args, state, control, logs[4:], 5)

    resumed_args = SimpleNamespace(output_dir=str(tmp_path), advantage_estimator="grpo")  # a fresh process's args
    resumed = HealthMonitor(**config)
    resumed.load_checkpoint_state(torch.load(tmp_path / "state.pt", weights_only=True), args=resumed_args)
    assert resumed.remedy_active and resumed_args.advantage_estimator == "grpo"  # the remedy is on again
    state = TrainerState()
    state.global_step = 4
    resumed.on_train_begin(resumed_args, state, TrainerControl())
    assert _feed(resumed, resumed_args, state, TrainerControl(), logs[4:], 5) == after_straight
    assert after_straight[0]["health/alarm/zero_std"] == 1.0 and after_straight[0]["health/reward_ceiling"] == 0.9
    assert resumed.checkpoint_state() == straight.checkpoint_state()
    assert resumed.summary() == straight.summary()
    resumed.on_train_end(resumed_args, state, TrainerControl())
    assert resumed_args.advantage_estimator == "grpo"  # the user's value, never changed


def test_resume_drops_the_records_a_killed_run_wrote_after_the_checkpoint(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    simulate(HealthMonitor(), args, records(5))
    with open(tmp_path / "health.jsonl", "a", encoding="utf-8") as f:
        f.write('{"type": "metrics", "st')  # the kill cut the last line short
    monitor = HealthMonitor()
    state, control = TrainerState(), TrainerControl()
    state.global_step = 3  # resumed from the checkpoint of step 3
    monitor.on_train_begin(args, state, control)
    _feed(monitor, args, state, control, records(2), 4)
    lines = read_health(tmp_path / "health.jsonl")
    assert [(r["type"], r["step"]) for r in lines if r["type"] != "alarm"] == [
        ("meta", 0),
        ("metrics", 1),
        ("metrics", 2),
        ("metrics", 3),
        ("meta", 3),
        ("metrics", 4),
        ("metrics", 5),
    ]
