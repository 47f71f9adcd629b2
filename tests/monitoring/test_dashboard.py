"""The dashboard PNG: from a log history, a health file, an output dir; and the console command."""

import json
import random
import runpy
import sys
from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
from transformers import TrainerControl, TrainerState

from trl_stable.monitoring import ALARMS, HealthConfig, HealthMonitor, render_dashboard
from trl_stable.monitoring.dashboard import _config_of, _figure, load_run, main

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
    # Only the reward is logged (a custom trainer), with evaluation records mixed in: only its panel is drawn.
    records = [{"step": i, "reward": 0.1 * i} for i in range(1, 6)]
    records.insert(2, {"step": 2, "eval_loss": 1.0, "eval_reward": 0.0})
    run = load_run(records)
    assert set(run.steps) == {"reward"}
    assert_png(render_dashboard(run, tmp_path / "sparse.png"))
    fig = _figure(run, HealthConfig(), None)
    assert panel_titles(fig) == ["reward/mean"]
    plt.close(fig)
    # nothing at all: one message, not a grid of empty panels
    assert open(render_dashboard([], tmp_path / "empty.png"), "rb").read()[:8] == PNG_MAGIC
    fig = _figure(load_run([]), HealthConfig(), None)
    assert [text.get_text() for ax in fig.axes for text in ax.texts] == ["no health gauges recorded yet"]
    plt.close(fig)


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


def ppo_history(n=80):
    """Log records under trl_stable PPOTrainer's names, shaped like the README's main command: the reward rises to
    its ceiling while the KL to the reference climbs to 5-7x the target 6 with kl_coef stuck near 0.1."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        out.append(
            {
                "step": i + 1,
                "env/reward_mean": min(0.99, 0.15 + 0.02 * i) + rng.uniform(-0.05, 0.05),
                "policy/grad_norm": 1.5 + rng.uniform(-0.5, 0.5),
                "loss/total": 0.1,
                "tokens/response_len_mean": 14 + rng.uniform(-2, 2),
                "tokens/truncated_frac": 0.1,
                "policy/entropy": 1.0 - 0.008 * i + rng.uniform(-0.05, 0.05),
                "objective/kl": min(40.0, 0.6 * i) + rng.uniform(-3, 3),
                "objective/kl_coef": 0.1 + 2e-5 * i,
                "loss/value": 1.7 / (1 + 0.2 * i) + 0.2,
            }
        )
    return out


def panel_titles(fig):
    return [ax.get_title().split(" (")[0] for ax in fig.axes if ax.get_title()]


def test_ppo_dashboard_has_kl_and_value_loss_panels_and_no_empty_panel(tmp_path):
    config = HealthConfig(reward_max=None, kl_target=6.0)
    run = load_run(ppo_history(), config, max_completion_length=20)
    assert any(e["alarm"] == "kl_above_target" and e["kind"] == "raised" for e in run.events)
    fig = _figure(run, _config_of(run, config), "ppo")
    try:
        # PPO has no groups and, here, no sampler log-probs: those panels are left out, not drawn empty
        assert panel_titles(fig) == [
            "reward/mean", "grad_norm", "completion length vs cap", "entropy", "KL to reference", "value loss",
        ]  # fmt: skip
        texts = [text.get_text() for ax in fig.axes for text in ax.texts]
        assert "no data" not in texts and not any("no sampler log-probs" in t for t in texts)
        assert "kl_above_target" in texts  # named on the KL panel
        footnote = fig.get_supxlabel()
        assert "frac_reward_zero_std" in footnote and "mismatch" in footnote and "value_loss" not in footnote
        kl_panel = next(ax for ax in fig.axes if ax.get_title().startswith("KL to reference"))
        assert "target 6" in kl_panel.get_title()
    finally:
        plt.close(fig)
    assert_png(render_dashboard(run, tmp_path / "ppo.png"))


def many_alarms_history(n=60):
    """Alarms raised at nearly the same step on the same panel (mismatch, masked tokens, re-tokenization) and on
    neighbouring panels, some near the right edge."""
    out = []
    for i in range(n):
        out.append(
            {
                "step": i + 1,
                "reward": 0.3 + 0.005 * i if i < 40 else 1.3,
                "grad_norm": 0.5 if i < 50 else 0.0,
                "frac_reward_zero_std": 0.1 if i < 20 else 0.9,
                "completions/mean_length": 60.0 if i > 55 else 20.0,
                "entropy": 1.5 if i < 52 else 0.01,
                "mismatch/logp_abs_diff/mean": 0.002 if i < 20 else 0.05,
                "token_filter/icepop/masked_token_frac": 0.01 if i < 21 else 0.4,
                "retokenization/mismatched": 0.0 if i < 22 else 3.0,
            }
        )
    return out


def test_alarm_labels_do_not_overlap_and_stay_in_their_panel():
    fig = _figure(load_run(many_alarms_history(), max_completion_length=64), HealthConfig(), None)
    try:
        renderer = fig.canvas.get_renderer()
        labels = [(ax, text) for ax in fig.axes for text in ax.texts if text.get_text() in ALARMS]
        assert {"mismatch", "token_filter_masked", "retokenization", "zero_std"} <= {t.get_text() for _, t in labels}
        boxes = [text.get_window_extent(renderer) for _, text in labels]
        for i, box in enumerate(boxes):
            for other in boxes[i + 1 :]:
                assert not box.overlaps(other), (labels[i][1].get_text(), "overlaps another label")
        for (ax, text), box in zip(labels, boxes):
            panel = ax.get_window_extent(renderer)
            inside = panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1
            assert inside, f"{text.get_text()} leaves its panel"
    finally:
        plt.close(fig)
