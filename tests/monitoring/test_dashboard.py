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
