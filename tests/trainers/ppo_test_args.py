"""The tiny `PPOConfig` the PPOTrainer test files share: small batches, one epoch, no saving, reporting or tqdm.

Imported by module name: pytest puts this folder on `sys.path` when it collects the test files next to it.
"""

from trl_stable import PPOConfig


def tiny_ppo_args(tmp_path, **overrides) -> PPOConfig:
    """A `PPOConfig` writing to `tmp_path`; `overrides` replace or add fields."""
    base = dict(
        output_dir=str(tmp_path),
        batch_size=4,
        mini_batch_size=2,
        ppo_epochs=1,
        max_new_tokens=5,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
    )
    base.update(overrides)
    return PPOConfig(**base)


def step_logs(trainer) -> list[dict]:
    """The PPO steps' entries of `trainer.state.log_history` (without Trainer's end-of-training summary and any
    evaluation entries)."""
    return [entry for entry in trainer.state.log_history if "loss/total" in entry]
