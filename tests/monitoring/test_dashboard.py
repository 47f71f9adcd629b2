"""The dashboard PNG: from a log history, a health file, an output dir; and the console command."""

import json
import runpy
import sys
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from trl_stable.monitoring import HealthMonitor, render_dashboard
from trl_stable.monitoring.dashboard import load_run, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def history(n=40):
    out = []
    for i in range(n):
        out.append(
            {
                "step": i + 1,
                "loss": 0.01,
                "grad_norm": 0.5 if i < 25 else 0.0,
                "reward": 0.2 + 0.01 * i,
                "frac_reward_zero_std": 0.1 if i < 20 else 0.8,
                "completions/mean_length": 20 + i,
                "completions/clipped_ratio": i / n,
                "entropy": 2.0 - 0.04 * i,
                "mismatch/logp_abs_diff/mean": 0.001 * (1 + i),
                "mismatch/logp_abs_diff/max": 0.01 * (1 + i),
            }
        )
    out.append({"step": n, "train_runtime": 1.0, "train_loss": 0.01})  # the summary record carries no gauge
    return out


def assert_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_render_from_log_history(tmp_path):
    out = render_dashboard(history(), tmp_path / "d.png", max_completion_length=64)
    assert_png(out)
    run = load_run(history(), max_completion_length=64)
    raised = {e["alarm"] for e in run.events if e["kind"] == "raised"}
    assert raised == {"zero_std", "grad_norm_vanishing", "length_near_cap", "mismatch"}
    assert len(run.series("reward")[0]) == 40


def test_render_from_health_file_and_cli(tmp_path, capsys):
    args = SimpleNamespace(output_dir=str(tmp_path), max_completion_length=64)
    monitor = HealthMonitor()
    state, control = TrainerState(), TrainerControl()
    monitor.on_train_begin(args, state, control)
    for record in history():
        state.global_step = record["step"]
        logs = {k: v for k, v in record.items() if k != "step"}
        monitor.on_log(args, state, control, logs=logs)
    run = load_run(tmp_path)
    assert run.meta["max_completion_length"] == 64
    assert {e["alarm"] for e in run.events if e.get("kind") == "raised"} == {
        "zero_std",
        "grad_norm_vanishing",
        "length_near_cap",
        "mismatch",
    }
    assert main([str(tmp_path)]) == 0
    assert_png(tmp_path / "health_dashboard.png")
    printed = capsys.readouterr().out
    assert "raised   zero_std" in printed and "dashboard written to" in printed


def test_render_from_trainer_state_in_checkpoint(tmp_path):
    for step in (2, 10):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "trainer_state.json").write_text(json.dumps({"log_history": history(step * 2)}))
    run = load_run(tmp_path)
    assert len(run.series("reward")[0]) == 20  # the latest checkpoint
    assert main([str(tmp_path), "-o", str(tmp_path / "x.png"), "--max-completion-length", "64"]) == 0
    assert_png(tmp_path / "x.png")


def test_missing_source(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "neither health.jsonl nor a trainer_state.json" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        load_run(tmp_path / "nope.jsonl")


@pytest.mark.filterwarnings("ignore:'trl_stable.monitoring.dashboard' found in sys.modules")
def test_python_dash_m(tmp_path, monkeypatch):
    """`python -m trl_stable.monitoring.dashboard OUTPUT_DIR` (run in-process: a subprocess re-imports TRL)."""
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history(12)}))
    monkeypatch.setattr(sys, "argv", ["trl-stable-dashboard", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("trl_stable.monitoring.dashboard", run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0
    assert_png(tmp_path / "health_dashboard.png")


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "nope", "does not exist"),
        (lambda d: _write(d / "run" / "notes.txt", "hello"), "is not JSON"),
        (lambda d: _write(d / "run" / "trainer_state.json", '{"log_history": 5}'), "has no log history"),
        (lambda d: _write(d / "run" / "health.jsonl", "[1, 2]\nnot json\n"), "is not a health file"),
    ],
)
def test_cli_bad_source_is_a_one_line_error(tmp_path, capsys, make, message):
    source = make(tmp_path)
    assert main([str(source)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_cli_unwritable_output_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history(5)}))
    blocker = _write(tmp_path / "file", "x")
    assert main([str(tmp_path), "-o", str(blocker / "sub" / "x.png")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_truncated_last_health_line_is_skipped_with_a_warning(tmp_path):
    # A run killed mid-write (or read while it writes) leaves half a line at the end.
    lines = [{"type": "meta", "max_completion_length": 64}] + [
        {"type": "metrics", "step": i, "reward": i / 4} for i in range(1, 4)
    ]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"type": "metr'
    _write(tmp_path / "health.jsonl", text)
    with pytest.warns(UserWarning, match=r"skipped 1 malformed line\(s\): \[5\]"):
        run = load_run(tmp_path)
    assert run.series("reward") == ([1, 2, 3], [0.25, 0.5, 0.75])


def test_missing_metrics_and_eval_logs_render(tmp_path):
    # Only the reward is logged (a custom trainer), with evaluation records mixed in: other panels say "no data".
    records = [{"step": i, "reward": 0.1 * i} for i in range(1, 6)]
    records.insert(2, {"step": 2, "eval_loss": 1.0, "eval_reward": 0.0})
    run = load_run(records)
    assert set(run.steps) == {"reward"}
    assert_png(render_dashboard(run, tmp_path / "sparse.png"))
    assert_png(render_dashboard([], tmp_path / "empty.png"))


def test_console_entry_point_targets_main():
    import configparser
    import importlib
    from pathlib import Path

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    scripts = dict(
        line.split("=", 1) for line in setup["options.entry_points"]["console_scripts"].strip().splitlines()
    )
    module, function = scripts["trl-stable-dashboard "].strip().split(":")
    assert getattr(importlib.import_module(module), function) is main


def test_bands_follow_the_thresholds_the_run_recorded(tmp_path):
    from trl_stable.monitoring import HealthConfig
    from trl_stable.monitoring.dashboard import _config_of

    args = SimpleNamespace(output_dir=str(tmp_path), max_completion_length=32)
    monitor = HealthMonitor(zero_std_alarm=0.6, entropy_relative_floor=0.2, mismatch_band=(0.8, 1.25))
    state, control = TrainerState(), TrainerControl()
    monitor.on_train_begin(args, state, control)
    run = load_run(tmp_path)
    cfg = _config_of(run, HealthConfig())
    assert (cfg.zero_std_alarm, cfg.entropy_relative_floor, cfg.mismatch_band) == (0.6, 0.2, (0.8, 1.25))
    assert run.meta["max_completion_length"] == 32
    run.meta["plateau_window"] = 1  # a corrupt or foreign meta line: the given thresholds are used
    assert _config_of(run, HealthConfig()) == HealthConfig()
