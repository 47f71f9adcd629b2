"""What a PPO step loop logs per step: one history row (`reward_history.jsonl`'s), the progress bar, the critic's
counters to the trackers. It only logs: the loop, its checkpoints and its saving are the script's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from text_metrics import distinct_n
from tqdm.auto import tqdm
from transformers import PrinterCallback


class StepLog:
    """The per-step history of a run and its progress bar.

    Args:
        trainer: The `PPOTrainer` (its accelerator reduces the means over processes; its `log` reaches the trackers).
        task: The progress bar's name.
        total: The run's number of steps.
        start: The steps already taken (a resumed run's).
        history: Their rows, continued from there.
        show_progress: Show the bar (`not --ppo_config.disable_tqdm`).
    """

    def __init__(
        self, trainer, task: str, total: int, start: int = 0, history: Sequence[dict] = (), show_progress: bool = True
    ):
        self.trainer = trainer
        self.history = list(history)
        # the bar below shows the run; Trainer's printer (its display under disable_tqdm) would print every log dict
        trainer.remove_callback(PrinterCallback)
        # the loop's config sets disable_tqdm for the trainer's own bar; the user's choice is in `show_progress`
        disable = not (show_progress and trainer.accelerator.is_local_main_process)
        self.bar = tqdm(total=total, initial=start, desc=f"PPO {task}", disable=disable)

    def record(
        self,
        step: int,
        env_scores: Sequence[float],
        token_rewards: Sequence[Sequence[float]],
        stats: dict,
        responses: Sequence[str] | None = None,
        critic=None,
    ) -> dict:
        """Log step `step`: the environment and intrinsic reward (means over every process), the step's KL, KL
        coefficient and response length; `responses` (the decoded rollouts) add their distinct-2 (this process's
        batch), which `run_summary` compares at the start and the end of the run; a `critic` with counters adds its
        rewarded token share and sends its counters to the trackers (request and failure counts)."""
        acc = self.trainer.accelerator
        intrinsic_mean = sum(sum(r) for r in token_rewards) / len(token_rewards)
        row = {
            "step": step,
            "env_reward": global_mean(acc, env_scores),
            "intrinsic_reward": global_mean(acc, [intrinsic_mean]),
            "kl": stats.get("objective/kl", float("nan")),
            "kl_coef": stats.get("objective/kl_coef", float("nan")),
            "response_len": stats.get("tokens/response_len_mean", float("nan")),
        }
        if responses is not None:
            row["distinct_2"] = global_mean(acc, [distinct_n(responses, 2)])
        if critic is not None:
            metrics = critic.metrics()
            row["critic_rewarded_token_fraction"] = metrics.get("critic/last_rewarded_token_fraction", float("nan"))
            self.trainer.log(metrics)
        self.history.append(row)
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{row['env_reward']:.3f}", kl=f"{row['kl']:.2f}")
        return row

    def close(self) -> list[dict]:
        self.bar.close()
        return self.history


def global_mean(acc, values: Sequence[float]) -> float:
    """Mean over all processes, skipping NaN (a sample whose reward could not be computed)."""
    finite = [float(v) for v in values if not math.isnan(float(v))]
    t = torch.tensor([sum(finite), float(len(finite))], device=acc.device)
    if acc.num_processes > 1:
        t = acc.reduce(t, reduction="sum")
    return (t[0] / t[1].clamp(min=1)).item()
