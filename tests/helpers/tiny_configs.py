"""The tiny trainer configs the tests share, one per trainer: small batches, no saving, reporting or tqdm.

Imported by module name from any test folder (`tests/conftest.py` puts this folder on `sys.path`) and from the
multi-process scripts (`two_processes.launch_two_processes` puts it on their ``PYTHONPATH``).

The defaults are what nearly every test sets; a test that needs another size passes it, and a test that relies on a
TRL/transformers default for a field set here passes that default explicitly.
"""

from __future__ import annotations

import trl

import trl_stable


def tiny_grpo_args(tmp_path, config_class: type = trl_stable.GRPOConfig, **overrides) -> trl.GRPOConfig:
    """A `GRPOConfig` writing to `tmp_path`: 4 completions a device step in groups of 2, at most 8 tokens each, one
    step, every step logged; `overrides` replace or add fields.

    `config_class` builds another class from the same fields (``trl.GRPOConfig`` for a side-by-side with TRL).
    Learning rate and seed stay TRL's defaults unless a test sets them.
    """
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    base.update(overrides)
    return config_class(**base)


def tiny_ppo_args(tmp_path, **overrides) -> trl_stable.PPOConfig:
    """A `PPOConfig` writing to `tmp_path`: 4 prompts a step, mini-batches of 2, one epoch, 5 new tokens; `overrides`
    replace or add fields."""
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
    return trl_stable.PPOConfig(**base)


def step_logs(trainer) -> list[dict]:
    """The PPO steps' entries of `trainer.state.log_history` (without Trainer's end-of-training summary and any
    evaluation entries)."""
    return [entry for entry in trainer.state.log_history if "loss/total" in entry]
