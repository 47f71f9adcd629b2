"""The training-health dashboard PNG and the `trl-stable-dashboard OUTPUT_DIR` command (docs/health_monitoring.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import textwrap
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_stable.monitoring.health import HealthConfig, HealthTracker, _finite_float, floor_from_reference

__all__ = ["RunHealth", "load_run", "main", "render_dashboard"]

HEALTH_FILE = "health.jsonl"
DASHBOARD_FILE = "health_dashboard.png"


@dataclass
class RunHealth:
    """A run's gauges over steps, its alarm events and the thresholds to shade."""

    steps: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, step: int, gauges: Mapping[str, Any]) -> None:
        for name, value in gauges.items():
            if (value := _finite_float(value)) is not None:  # the tracker's rule for a gauge's value
                self.steps.setdefault(name, []).append((step, value))

    def series(self, name: str) -> tuple[list[int], list[float]]:
        points = self.steps.get(name, [])
        return [p[0] for p in points], [p[1] for p in points]


def _from_log_history(history: Sequence[Mapping[str, Any]], config: HealthConfig, cap: int | None) -> RunHealth:
    tracker = HealthTracker(config, max_completion_length=cap)
    run = RunHealth()
    for index, record in enumerate(history):
        if any(str(k).startswith("eval_") for k in record):
            continue
        step = int(record.get("step", index))
        run.events += [event.to_record() for event in tracker.update(record, step=step)]
        run.add(step, tracker.last_gauges)  # nothing for a record without gauges
    run.meta = tracker.meta()
    return run


def _from_health_file(path: Path) -> RunHealth:
    """The run a health file records. A line that is not a JSON object (the last line of a run killed while writing,
    or read while it writes) is skipped with a warning naming it; a file with no record at all is an error."""
    run, bad, records = RunHealth(), [], 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                bad.append(number)
                continue
            records += 1
            kind = record.get("type")
            if kind == "meta":
                run.meta.update({k: v for k, v in record.items() if k not in ("type", "step")})
            elif kind == "metrics":
                gauges = {k: v for k, v in record.items() if k not in ("type", "step", "active")}
                run.add(int(record.get("step", 0)), gauges)
            elif kind in ("alarm", "remedy", "stop"):
                run.events.append(record)
    if bad and not records:
        raise ValueError(f"{path} is not a health file: no line is a JSON record (written by HealthMonitor).")
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} malformed line(s): {bad[:5]}", stacklevel=2)
    return run


def _log_history(path: Path) -> list[Mapping[str, Any]]:
    """The `log_history` of a `trainer_state.json` (or a bare JSON list of log records)."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{path} is not JSON ({err}): pass a run's output_dir, health.jsonl or trainer_state.json."
        ) from err
    history = state.get("log_history") if isinstance(state, dict) else state
    if not isinstance(history, list) or not all(isinstance(record, dict) for record in history):
        raise ValueError(
            f"{path} has no log history (expected a trainer_state.json with a `log_history` list of records)."
        )
    return history


def load_run(
    source: str | os.PathLike | Sequence[Mapping[str, Any]],
    config: HealthConfig | None = None,
    max_completion_length: int | None = None,
) -> RunHealth:
    """Load a run's health from an output dir, a `health.jsonl`, a `trainer_state.json` or a log-history list.

    A log history is replayed through [`HealthTracker`] with `config`, so its alarms appear as they would have live.
    """
    config = config or HealthConfig()
    if not isinstance(source, (str, os.PathLike)):
        return _from_log_history(list(source), config, max_completion_length)
    path = Path(source)
    if path.is_dir():
        if (path / HEALTH_FILE).is_file():
            path = path / HEALTH_FILE
        else:
            states = [p for p in [path, *path.glob("checkpoint-*")] if (p / "trainer_state.json").is_file()]
            if not states:
                raise FileNotFoundError(
                    f"{source} has neither {HEALTH_FILE} nor a trainer_state.json (in it or a checkpoint-* folder): "
                    "pass a run's output_dir."
                )
            # the run's own state, else its latest checkpoint's
            path = max(states, key=lambda p: (p == path, int(re.sub(r"\D", "", p.name) or 0))) / "trainer_state.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist.")
    if path.suffix == ".jsonl":
        run = _from_health_file(path)
        if max_completion_length:
            run.meta["max_completion_length"] = max_completion_length
        return run
    return _from_log_history(_log_history(path), config, max_completion_length)


_GREEN, _AMBER, _RED = "tab:green", "tab:orange", "tab:red"
_LABEL_FONT = 7


def _shade(ax, low, high, color, label=None):
    ax.axhspan(low, high, color=color, alpha=0.12, lw=0, label=label)


def _plot(ax, run: RunHealth, name: str, label: str | None = None, **kwargs) -> tuple[list[int], list[float]]:
    x, y = run.series(name)
    if x:
        ax.plot(x, y, marker="." if len(x) < 30 else None, label=label or name, **kwargs)
    return x, y


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _floor(values: list[float], absolute: float, relative: float, window: int) -> float:
    """The tracker's floor for a gauge: its reference is the median of the first `window` finite values."""
    early = _finite(values)[:window]
    return floor_from_reference(statistics.median(early) if len(early) == window else None, absolute, relative)


def _draw_reward(ax, run: RunHealth, cfg: HealthConfig):
    _, y = _plot(ax, run, "reward", "reward/mean", color="tab:blue")
    reward_max = cfg.reward_max
    if reward_max is not None:
        _shade(ax, reward_max - cfg.ceiling_margin, reward_max, _GREEN, "at the maximum")
        ax.axhline(reward_max, color=_GREEN, ls="--", lw=1, label=f"declared max {reward_max:g}")
    finite = _finite(y)
    if finite:
        ax.axhline(max(finite), color="grey", ls=":", lw=1, label=f"ceiling reached {max(finite):.3f}")
    ax.set_title("reward/mean (healthy: rising)")


def _draw_zero_std(ax, run: RunHealth, cfg: HealthConfig):
    healthy, alarm = cfg.zero_std_healthy, cfg.zero_std_alarm
    _shade(ax, 0, healthy, _GREEN, f"healthy < {healthy:.0%}")
    _shade(ax, healthy, alarm, _AMBER)
    _shade(ax, alarm, 1, _RED, f"alarm > {alarm:.0%}")
    _plot(ax, run, "frac_reward_zero_std", color="tab:blue")
    ax.set_ylim(0, 1)
    ax.set_title(f"frac_reward_zero_std (healthy < {healthy:.0%})")


def _draw_grad_norm(ax, run: RunHealth, cfg: HealthConfig):
    # log scale: exact zeros are drawn at the bottom of the "near zero" band
    x, y = run.series("grad_norm")  # not empty: the panel is drawn for a gauge with data
    floor = _floor(y, cfg.grad_norm_floor, cfg.grad_norm_relative_floor, cfg.reference_window)
    lowest = min([v for v in y if math.isfinite(v) and v > 0] + [floor]) / 10
    shown = [max(v, lowest) if math.isfinite(v) else float("nan") for v in y]
    ax.plot(x, shown, marker="." if len(x) < 30 else None, color="tab:blue", label="grad_norm")
    ax.set_yscale("log")
    _shade(ax, lowest, floor, _RED, f"near zero < {floor:.3g}")
    ax.set_title("grad_norm (healthy: steady, non-zero)")


def _draw_length(ax, run: RunHealth, cfg: HealthConfig):
    _plot(ax, run, "completion_length", "mean length", color="tab:blue")
    cap = run.meta.get("max_completion_length")
    if cap:
        ratio = cfg.length_cap_ratio
        _shade(ax, 0, ratio * cap, _GREEN, "healthy")
        _shade(ax, ratio * cap, cap, _RED, f"> {ratio:.0%} of cap")
        ax.axhline(cap, color=_RED, ls="--", lw=1, label=f"cap {cap}")
        ax.set_ylim(0, cap * 1.05)
    ax.set_title("completion length vs cap (healthy: steady)")
    return _draw_twin(ax, run, "clipped_ratio", "truncated share (right)", ":", top=1.0)


def _draw_twin(ax, run: RunHealth, name: str, label: str, ls: str, top: float | None = None):
    """Gauge `name` on a right-hand axis of `ax` from 0 to `top` (1 for a share; None: half again its maximum);
    returns that axis (None without data)."""
    x, y = run.series(name)
    if not x:
        return None
    twin = ax.twinx()
    twin.plot(x, y, color="tab:purple", ls=ls, lw=1, label=label)
    if top is None:
        highest = max(_finite(y) or [0.0])
        top = highest * 1.5 if highest > 0 else 1.0
    twin.set_ylim(0, top)
    twin.set_ylabel(label.replace(" (right)", ""), fontsize=8)
    return twin


def _draw_entropy(ax, run: RunHealth, cfg: HealthConfig):
    _, y = _plot(ax, run, "entropy", color="tab:blue")
    floor = _floor(y, cfg.entropy_floor, cfg.entropy_relative_floor, cfg.reference_window)
    _shade(ax, 0, floor, _RED, f"collapsed < {floor:.3g}")
    ax.set_ylim(bottom=0)
    ax.set_title("entropy (healthy: slow decline)")


def _draw_mismatch(ax, run: RunHealth, cfg: HealthConfig):
    _, means = _plot(ax, run, "mismatch", "mean |logp diff|", color="tab:blue")
    _, maxima = _plot(ax, run, "mismatch_max", "max |logp diff|", color="tab:blue", ls=":", lw=1)
    threshold = cfg.mismatch_threshold
    positive = [v for v in means + maxima if math.isfinite(v) and v > 0]
    if positive:
        ax.set_yscale("log")
        low, high = min(min(positive), threshold) / 10, max(max(positive), threshold) * 10
        _shade(ax, low, threshold, _GREEN, f"healthy < {threshold:g}")
        _shade(ax, threshold, high, _RED)
        ax.set_ylim(low, high)
    ax.set_title(f"sampler vs trainer mismatch (alarm > {threshold:g})")
    return _draw_twin(ax, run, "masked_fraction", "IcePop/KPop masked (right)", "--", top=1.0)


def _draw_kl(ax, run: RunHealth, cfg: HealthConfig):
    _, y = _plot(ax, run, "kl", "KL to reference", color="tab:blue")
    target = run.meta.get("kl_target") or cfg.kl_target
    finite = _finite(y)
    if target and finite:
        alarm = cfg.kl_alarm_ratio * target
        low, high = min(0.0, min(finite)), max(max(finite), alarm) * 1.08
        _shade(ax, low, target, _GREEN, f"at most the target {target:g}")
        _shade(ax, target, alarm, _AMBER)
        _shade(ax, alarm, high, _RED, f"alarm > {cfg.kl_alarm_ratio:g}x target")
        ax.axhline(target, color=_GREEN, ls="--", lw=1)
        ax.set_ylim(low, high)
        ax.set_title(f"KL to reference (healthy: near the target {target:g})")
    else:
        ax.set_title("KL to reference (no target declared)")
    return _draw_twin(ax, run, "kl_coef", "kl_coef (right)", "--")


def _draw_value_loss(ax, run: RunHealth, cfg: HealthConfig):
    _, y = _plot(ax, run, "value_loss", "value loss", color="tab:blue")
    positive = [v for v in _finite(y) if v > 0]
    if positive and max(positive) / min(positive) > 30:  # a loss that falls by decades reads on a log scale
        ax.set_yscale("log")
    ax.set_title("value loss (healthy: falling, then steady)")


# panel -> (the gauges it draws: without any the panel is left out; how; the alarms marked on it; why it can be
# missing, for the footnote)
_PANELS = {
    "reward": (("reward",), _draw_reward, ("reward_plateau", "reward_above_max"), None),
    "frac_reward_zero_std": (("frac_reward_zero_std",), _draw_zero_std, ("zero_std",), "no groups (PPO)"),
    "grad_norm": (("grad_norm",), _draw_grad_norm, ("grad_norm_vanishing", "nonfinite"), None),
    "completion_length": (("completion_length", "clipped_ratio"), _draw_length, ("length_near_cap",), None),
    "entropy": (("entropy",), _draw_entropy, ("entropy_collapse",), None),
    "mismatch": (
        ("mismatch", "mismatch_max", "masked_fraction"),
        _draw_mismatch,
        ("mismatch", "token_filter_masked", "retokenization"),
        "no sampler log-probs recorded: vLLM, the decoupled loss or health_mismatch_monitor record them",
    ),
    "kl": (("kl",), _draw_kl, ("kl_above_target",), "no KL logged (GRPO with beta=0)"),
    "value_loss": (("value_loss",), _draw_value_loss, (), "no value model (GRPO)"),
}


def _config_of(run: RunHealth, config: HealthConfig) -> HealthConfig:
    """`config` with the thresholds the run recorded (its health file's meta line), so the bands match its alarms."""
    recorded = {k: v for k, v in run.meta.items() if k in HealthConfig.__dataclass_fields__}
    try:
        return HealthConfig(**{**config.to_dict(), **recorded})
    except (TypeError, ValueError):  # a file from another version: fall back to the given thresholds
        return config


def render_dashboard(
    source: str | os.PathLike | Sequence[Mapping[str, Any]] | RunHealth,
    path: str | os.PathLike | None = None,
    *,
    config: HealthConfig | None = None,
    max_completion_length: int | None = None,
    title: str | None = None,
) -> Path:
    """Render a run's health dashboard into one PNG: a panel per recorded gauge, healthy bands shaded, alarms marked.

    Args:
        source: an output dir, a `health.jsonl`, a `trainer_state.json`, a log-history list, or a [`RunHealth`].
        path: where to write the PNG; defaults to `<output dir>/health_dashboard.png` for a directory source, else
            `health_dashboard.png` in the current directory.
        config ([`HealthConfig`], *optional*): thresholds used when replaying a log history, and for the bands the
            source does not record.
        max_completion_length (`int`, *optional*): the completion cap, when the source does not record it.
        title (`str`, *optional*): figure title.

    Returns:
        `Path` of the written PNG.
    """
    run = source if isinstance(source, RunHealth) else load_run(source, config, max_completion_length)
    if path is None:
        is_dir = isinstance(source, (str, os.PathLike)) and Path(source).is_dir()
        path = Path(source) / DASHBOARD_FILE if is_dir else Path(DASHBOARD_FILE)
    path = Path(path)
    fig = _figure(run, _config_of(run, config or HealthConfig()), title)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=90)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path


def _figure(run: RunHealth, cfg: HealthConfig, title: str | None):
    """The dashboard's matplotlib figure (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    shown = [name for name, (gauges, *_) in _PANELS.items() if any(run.steps.get(g) for g in gauges)]
    ncols = max(1, min(len(shown), 3 if len(shown) <= 6 else 4))
    nrows = max(1, math.ceil(len(shown) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 4.2 * nrows), layout="constrained", squeeze=False)
    fig.get_layout_engine().set(h_pad=6 / 72, w_pad=4 / 72)  # room between the headline and the panel titles
    for ax in axes.flat[max(len(shown), 1) :]:
        ax.remove()
    panels = dict(zip(shown, axes.flat))
    tops = {}  # each panel's topmost axes: its right-hand axis, or itself
    for name, ax in panels.items():
        top = tops[ax] = _PANELS[name][1](ax, run, cfg) or ax
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        ax.grid(alpha=0.3)
        # one legend for the panel and its right-hand axis, under it, covering no data or label
        pairs = [part.get_legend_handles_labels() for part in dict.fromkeys((ax, top))]
        handles, names = (sum(column, []) for column in zip(*pairs))
        if handles:
            ax.legend(
                handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=min(3, len(handles)),
                fontsize=_LABEL_FONT, frameon=False, handlelength=1.8, columnspacing=1.2,
            )  # fmt: skip
    # raised alarms as solid lines on their panel, cleared ones dotted, a stop on every panel; the labels to place:
    # {axes: {alarm: (step, color)}}, one per alarm and panel at its first raise
    labels: dict[Any, dict[str, tuple[int, str]]] = {}
    for event in run.events:
        if event.get("type") == "stop":
            for ax in panels.values():
                ax.axvline(event["step"], color="black", lw=1.5)
        if event.get("type") != "alarm" or event.get("kind") not in ("raised", "cleared"):
            continue
        name = event.get("alarm")
        ax = next((panels.get(panel) for panel, spec in _PANELS.items() if name in spec[2]), None)
        color = _RED if event.get("severity") == "critical" else _AMBER
        cleared = event["kind"] == "cleared"
        if ax is not None:
            ax.axvline(event["step"], color=color, lw=1.0 if cleared else 1.2, ls=":" if cleared else "-", alpha=0.8)
            if not cleared:
                labels.setdefault(ax, {}).setdefault(name, (int(event["step"]), color))
    if not shown:
        axes.flat[0].set_axis_off()
        axes.flat[0].text(0.5, 0.5, "no health gauges recorded yet", ha="center", va="center", color="grey")
    missing = [name for name in _PANELS if name not in shown]
    if shown and missing:
        notes = "; ".join(f"{name} ({_PANELS[name][3]})" if _PANELS[name][3] else name for name in missing)
        # wrapped to the figure's width (about 17 characters of 8-point text per inch)
        fig.supxlabel(textwrap.fill(f"not shown, no data: {notes}", 17 * 5 * ncols), fontsize=8, color="grey")
    raised = {e.get("alarm") for e in run.events if e.get("type") == "alarm" and e.get("kind") == "raised"}
    headline = f"{title or 'training health'} — alarms raised: {', '.join(sorted(raised)) or 'none'}"
    fig.suptitle(textwrap.fill(headline, 10 * 5 * ncols), fontsize=12)  # ~10 characters of 12-point text per inch
    # each alarm's name next to its line, at the top of its panel, in the first row where it overlaps no other label
    # (measured in pixels on the final layout); a label that would leave the panel goes left of its line
    if labels:
        fig.canvas.draw()  # the final layout: from here on, positions in pixels are those of the saved figure
        fig.set_layout_engine("none")
        renderer = fig.canvas.get_renderer()
        to_points = 72.0 / fig.dpi
        for ax, items in labels.items():
            top = tops[ax]  # the right-hand axis, when there is one, is drawn over the panel's own lines
            frame = ax.get_window_extent(renderer)
            rows: list[float] = []  # right edge, in pixels, of the last label of each row
            for step, name, color in sorted((step, name, color) for name, (step, color) in items.items()):
                text = top.annotate(
                    name,
                    (step, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, -3),
                    textcoords="offset points",
                    ha="left",
                    va="top",
                    fontsize=_LABEL_FONT,
                    color=color,
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.7},
                    zorder=6,
                )
                box = text.get_window_extent(renderer)
                if box.x1 > frame.x1 - 3:  # keep clear of the frame
                    text.set_horizontalalignment("right")
                    text.xyann = (-3, -3)
                    box = text.get_window_extent(renderer)
                row = next((i for i, right in enumerate(rows) if box.x0 > right + 2), len(rows))
                rows[row : row + 1] = [box.x1]  # a new row when none has room
                text.xyann = (text.xyann[0], -3 - row * (box.height + 2) * to_points)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: `trl-stable-dashboard OUTPUT_DIR [-o PNG]`."""
    parser = argparse.ArgumentParser(
        prog="trl-stable-dashboard",
        description="Render the training-health dashboard (PNG) of a trl_stable / TRL run.",
    )
    parser.add_argument("source", help="output dir of a run, or its health.jsonl / trainer_state.json")
    parser.add_argument("-o", "--output", help="PNG path (default: OUTPUT_DIR/health_dashboard.png)")
    parser.add_argument("--max-completion-length", type=int, help="completion cap, if not recorded")
    parser.add_argument("--reward-max", type=float, help="declared reward maximum (default 1.0)")
    parser.add_argument("--kl-target", type=float, help="KL target of the run, if not recorded (PPOConfig's `target`)")
    parser.add_argument("--title")
    args = parser.parse_args(argv)

    source = Path(args.source)
    default_output = (source if source.is_dir() else source.parent) / DASHBOARD_FILE
    output = default_output if args.output is None else args.output
    try:
        given = {name: getattr(args, name) for name in ("reward_max", "kl_target") if getattr(args, name) is not None}
        config = HealthConfig(**given)
        run = load_run(args.source, config, args.max_completion_length)
        run.meta.update(given)
        written = render_dashboard(run, output, config=config, title=args.title or str(args.source))
    except (OSError, ValueError) as err:  # a missing, unreadable or foreign file, an unwritable -o: no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    lines = []
    for event in run.events:
        if event.get("type") == "alarm" and event.get("kind") in ("raised", "cleared"):
            symptom = f": {event.get('symptom', '')}" if event["kind"] == "raised" else ""
            lines.append(f"  step {event['step']:>6}  {event['kind']:<8} {event['alarm']}{symptom}")
        elif event.get("type") in ("remedy", "stop"):
            lines.append(f"  step {event['step']:>6}  {event.get('kind', event['type'])}")
    print("alarms:\n" + ("\n".join(lines) if lines else "  no alarms"))
    print(f"dashboard written to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
