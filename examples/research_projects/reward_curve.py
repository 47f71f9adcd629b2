"""The reward curve of a run (`reward_curve.png`): the reward per step, raw and smoothed, for one or more runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (window clipped at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_reward_curve(histories: dict[str, list[dict]], path: str, key: str = "env_reward", window: int = 5) -> str:
    """PNG of the environment reward per step (raw, faint; moving average, bold) for one or more runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, history) in enumerate(histories.items()):
        steps = [h["step"] for h in history]
        values = [h[key] for h in history]
        ax.plot(steps, values, color=f"C{i}", alpha=0.3, linewidth=1)
        ax.plot(steps, smooth(values, window), color=f"C{i}", linewidth=2, label=name)
    ax.set_xlabel("PPO step")
    ax.set_ylabel(key.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
