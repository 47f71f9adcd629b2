"""Checkpoints: the completeness marker, resume's choice of checkpoint and its errors, and PPO's atomic save, its
kill-while-saving fallback and its bit-identical continuation with the health monitor and critic counters restored.
"""

import json
import logging
import os

import pytest
import torch
from datasets import Dataset
from kill_points import fail_torch_save_on
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import SHORT_PROMPTS
from transformers import TrainerCallback

from trl_stable import PPOTrainer
from trl_stable.rewards import CriticIntrinsicReward, CriticRewardConfig
from trl_stable.testing import build_causal_lm
from trl_stable.trainers.checkpoints import (
    MARKER_FILE,
    begin_marker,
    checkpoint_problem,
    newest_complete_checkpoint,
    resolve_checkpoint,
    write_marker,
)

LOGGER = "trl_stable.trainers.checkpoints"


def _checkpoint(root, step, complete=True, files=("trainer_state.json", "rng_state_0.pth")):
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"{name} of step {step}")
    if complete:
        write_marker(str(folder), step, num_processes=1)
    return folder


# ---------------------------------------------------------------------------------------------------- the marker
def test_marker_lists_every_file_and_resume_checks_their_sizes(tmp_path):
    folder = _checkpoint(tmp_path, 4, files=("trainer_state.json", "sub/model.safetensors"))
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["complete"] and marker["num_processes"] == 1 and marker["global_step"] == 4
    assert marker["files"] == {
        "trainer_state.json": len("trainer_state.json of step 4"),
        "sub/model.safetensors": len("sub/model.safetensors of step 4"),
    }
    assert checkpoint_problem(str(folder)) is None
    (folder / "sub" / "model.safetensors").write_text("cut")
    assert checkpoint_problem(str(folder)) == "sub/model.safetensors has 3 bytes, 31 were written"
    (folder / "sub" / "model.safetensors").unlink()
    assert checkpoint_problem(str(folder)) == "sub/model.safetensors is missing"


def test_begin_marker_makes_a_resaved_checkpoint_incomplete(tmp_path):
    folder = _checkpoint(tmp_path, 2)
    begin_marker(str(folder), 2)
    assert checkpoint_problem(str(folder)) == "saving it was interrupted (its marker says incomplete)"


def test_newest_complete_checkpoint_skips_and_logs_the_incomplete_ones(tmp_path, caplog):
    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 3, complete=False)  # no marker: written by another trainer, or cut short
    begin_marker(str(_checkpoint(tmp_path, 10)), 10)  # numeric order, not lexical: 10 is the newest
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"Resuming from {tmp_path / 'checkpoint-2'}, the newest complete checkpoint; skipped:")
    assert "checkpoint-10: saving it was interrupted (its marker says incomplete)" in message
    assert f"checkpoint-3: it has no {MARKER_FILE}" in message


def test_no_complete_checkpoint_is_an_error_listing_what_was_skipped(tmp_path):
    _checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(ValueError, match=r"holds no complete checkpoint\. Skipped: checkpoint-3: it has no"):
        newest_complete_checkpoint(str(tmp_path))


def test_explicit_checkpoint_without_trainer_state_names_the_folder_and_the_fix(tmp_path):
    _checkpoint(tmp_path, 1)
    broken = _checkpoint(tmp_path, 2, complete=False, files=("rng_state_0.pth",))
    with pytest.raises(ValueError) as err:
        resolve_checkpoint(str(broken), str(tmp_path), num_processes=1)
    message = str(err.value)
    assert message.startswith(f"{broken} has no trainer_state.json, so it is not a complete checkpoint")
    assert f"Fix: resume from {tmp_path / 'checkpoint-1'}, the newest complete checkpoint there" in message


def test_explicit_checkpoint_must_be_complete_and_hold_this_process_rng(tmp_path, caplog):
    folder = _checkpoint(tmp_path, 2)
    info = resolve_checkpoint(str(folder), str(tmp_path), 1, per_process=("rng_state_0.pth",))
    assert info.verified and info.same_processes
    begin_marker(str(folder), 2)
    with pytest.raises(ValueError, match="saving it was interrupted"):
        resolve_checkpoint(str(folder), str(tmp_path), 1)
    # without a marker (an older trl_stable, another trainer): accepted with a warning, the RNG file still required
    unmarked = _checkpoint(tmp_path, 3, complete=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = resolve_checkpoint(str(unmarked), str(tmp_path), 1, per_process=("rng_state_0.pth",))
    assert not info.verified and "its completeness cannot be checked" in caplog.text
    (unmarked / "rng_state_0.pth").unlink()
    with pytest.raises(ValueError, match=r"checkpoint-3 is not a complete checkpoint: it lacks rng_state_0\.pth"):
        resolve_checkpoint(str(unmarked), str(tmp_path), 1, per_process=("rng_state_0.pth",))


def test_another_number_of_processes_skips_the_per_process_state_with_a_warning(tmp_path, caplog):
    folder = _checkpoint(tmp_path, 2)  # written by 1 process
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = resolve_checkpoint(str(folder), str(tmp_path), 2, per_process=("rng_state_1.pth",))
    assert info.verified and not info.same_processes
    assert "written by 1 processes, this run has 2" in caplog.text


def test_no_resume_requested(tmp_path):
    assert resolve_checkpoint(None, str(tmp_path), 1) is None
    assert resolve_checkpoint(False, str(tmp_path), 1) is None


# ---------------------------------------------------------------------------------------------------- PPO


def length_score(completion_ids, **kwargs):
    return [len(c) / 5 for c in completion_ids]


class KillAt(TrainerCallback):
    """Raises after step `step` was logged (the health monitor, first in line, has written it): a kill."""

    def __init__(self, step):
        self.step = step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"killed after step {self.step}")


def ppo(tokenizer, out, callbacks=(), **overrides):
    critic = CriticIntrinsicReward(
        CriticRewardConfig(use_intrinsic_reward=True, intrinsic_reward_threshold=10.0), tokenizer
    )
    args = tiny_ppo_args(
        out,
        **{
            "max_steps": 4,
            "save_strategy": "steps",
            "save_steps": 2,
            "learning_rate": 1e-3,
            "logging_steps": 1,
            # reward_above_max holds from step 1 and is raised at step 2 (patience 2): the save at step 2 has it
            "health_reward_max": -100.0,
            "health_monitor_kwargs": {"patience": 2},
            **overrides,
        },
    )
    trainer = PPOTrainer(
        build_causal_lm("gpt2", tokenizer, seed=0),
        reward_funcs=[length_score, critic],
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": SHORT_PROMPTS * 4}),
        callbacks=list(callbacks),
    )
    return trainer, critic


def _comparable(history):
    """The log history without wall-clock timings and Trainer's end-of-training summary (its runtime, and its
    train_loss over the steps of that train() call only)."""
    return [
        {k: v for k, v in h.items() if not k.startswith("time/") and "seconds" not in k}
        for h in history
        if "train_runtime" not in h
    ]


def _health(out):
    return [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]


def _critic_counts(critic):
    return {k: v for k, v in critic.metrics().items() if "seconds" not in k}


def test_ppo_resume_after_a_kill_continues_bit_identically_with_health_and_critic_state(tmp_path, tokenizer):
    straight, straight_critic = ppo(tokenizer, tmp_path / "a")
    straight.train()
    assert straight.state.log_history[1]["health/alarm/reward_above_max"] == 1.0  # active when step 2 is saved

    killed, _ = ppo(tokenizer, tmp_path / "b", callbacks=[KillAt(3)])
    with pytest.raises(KeyboardInterrupt):
        killed.train()
    assert [r["step"] for r in _health(tmp_path / "b") if r["type"] == "metrics"] == [1, 2, 3]
    resumed, resumed_critic = ppo(tokenizer, tmp_path / "b")
    resumed.train(resume_from_checkpoint=True)  # checkpoint-2, the newest

    for (n, p), (_, q) in zip(straight.unwrapped().named_parameters(), resumed.unwrapped().named_parameters()):
        assert torch.equal(p, q), n
    # every logged number, the health flags and the reward ceiling included: the alarm does not vanish at step 3
    assert _comparable(resumed.state.log_history) == _comparable(straight.state.log_history)
    assert resumed.health_monitor.tracker.checkpoint_state() == straight.health_monitor.tracker.checkpoint_state()
    # health.jsonl: step 3 once (the killed run's record was dropped), the same records as the uninterrupted run
    metrics = [r for r in _health(tmp_path / "b") if r["type"] == "metrics"]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert metrics == [r for r in _health(tmp_path / "a") if r["type"] == "metrics"]
    # the critic's counters go on from the checkpoint's
    assert _critic_counts(resumed_critic) == _critic_counts(straight_critic)
    assert resumed_critic.metrics()["critic/steps"] == 4


def test_ppo_kill_while_saving_leaves_an_incomplete_checkpoint_and_resume_falls_back(
    tmp_path, tokenizer, monkeypatch, caplog
):
    straight, _ = ppo(tokenizer, tmp_path / "a")
    straight.train()

    killed, _ = ppo(tokenizer, tmp_path / "b", save_steps=1)
    steps = []
    real_save = killed._save_checkpoint

    def save_checkpoint(*args, **kwargs):
        steps.append(killed.state.global_step)
        if killed.state.global_step == 3:
            fail_torch_save_on(monkeypatch, "rng_state.pth")  # Trainer writes it after the model and optimizer
        return real_save(*args, **kwargs)

    killed._save_checkpoint = save_checkpoint
    with pytest.raises(OSError, match="killed while writing rng_state.pth"):
        killed.train()
    monkeypatch.undo()
    assert steps == [1, 2, 3]
    # Trainer writes checkpoint-3 in place: it is there, with its model, but marked incomplete
    assert (tmp_path / "b" / "checkpoint-3" / "model.safetensors").is_file()
    assert "interrupted" in checkpoint_problem(str(tmp_path / "b" / "checkpoint-3"))

    resumed, _ = ppo(tokenizer, tmp_path / "b", save_steps=1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        resumed.train(resume_from_checkpoint=True)
    assert f"Resuming from {tmp_path / 'b' / 'checkpoint-2'}" in caplog.text
    assert "checkpoint-3: saving it was interrupted" in caplog.text
    for (n, p), (_, q) in zip(straight.unwrapped().named_parameters(), resumed.unwrapped().named_parameters()):
        assert torch.equal(p, q), n
    assert checkpoint_problem(str(tmp_path / "b" / "checkpoint-3")) is None  # saved again, completely


def test_ppo_checkpoint_without_trainer_state_or_rng_is_refused_with_the_fix(tmp_path, tokenizer):
    trainer, _ = ppo(tokenizer, tmp_path, max_steps=2, save_steps=1)
    trainer.train()
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()
    fresh, _ = ppo(tokenizer, tmp_path, max_steps=2, save_steps=1)
    with pytest.raises(ValueError) as err:
        fresh.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert f"{tmp_path / 'checkpoint-2'} has no trainer_state.json" in str(err.value)
    assert f"Fix: resume from {tmp_path / 'checkpoint-1'}" in str(err.value)
    (tmp_path / "checkpoint-1" / "rng_state.pth").unlink()
    with pytest.raises(ValueError, match=r"checkpoint-1 is not a complete checkpoint: rng_state\.pth is missing"):
        fresh.load_checkpoint(str(tmp_path / "checkpoint-1"))


def test_ppo_save_checkpoint_replaces_an_older_checkpoint_of_the_same_name(tmp_path, tokenizer):
    trainer, _ = ppo(tokenizer, tmp_path)
    trainer.step([torch.tensor([5, 6])] * 4, [torch.tensor([7, 8, 9])] * 4, scores=[1.0, 0.0, 0.5, 0.2])
    path = trainer.save_checkpoint()
    assert path == str(tmp_path / "checkpoint-1") and trainer.save_checkpoint(path) == path  # its own folder: fine
    (tmp_path / "checkpoint-1" / "stale.txt").write_text("from an older save")
    assert trainer.save_checkpoint() == path
    assert not (tmp_path / "checkpoint-1" / "stale.txt").exists() and checkpoint_problem(path) is None
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "health.jsonl"]
    with pytest.raises(ValueError, match=r"set PPOConfig.output_dir"):
        trainer.save_checkpoint(str(tmp_path / "elsewhere"))  # checkpoints live in output_dir, as in Trainer


# ---------------------------------------------------------------------------------------------------- name collisions
def test_a_file_or_foreign_folder_named_like_a_checkpoint_is_refused_at_start_up(tmp_path, tokenizer):
    (tmp_path / "checkpoint-2").write_text("my notes")
    with pytest.raises(ValueError, match=r"checkpoint-2 \(a file\).*Move or rename it"):
        ppo(tokenizer, tmp_path)
    (tmp_path / "checkpoint-2").unlink()
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "data.csv").write_text("1,2")
    with pytest.raises(ValueError, match=r"checkpoint-3 \(a folder no trainer wrote\)"):
        ppo(tokenizer, tmp_path)
    assert (tmp_path / "checkpoint-3" / "data.csv").read_text() == "1,2"  # never renamed or deleted
    from trl_stable import GRPOTrainer

    args = tiny_grpo_args(tmp_path, per_device_train_batch_size=2, save_strategy="steps")
    with pytest.raises(ValueError, match=r"checkpoint-3 \(a folder no trainer wrote\)"):
        GRPOTrainer(
            build_causal_lm("qwen2", tokenizer, seed=0),
            reward_funcs=length_score,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": SHORT_PROMPTS}),
            processing_class=tokenizer,
        )


def test_a_collision_that_appears_during_the_run_stops_the_save_with_its_name(tmp_path, tokenizer):
    (tmp_path / ".tmp-checkpoint-2").write_text("unrelated")  # no save writes a temporary folder any more
    trainer, _ = ppo(tokenizer, tmp_path, save_steps=1, max_steps=2)
    original_save = trainer._save_checkpoint

    def save(model, trial):
        if trainer.state.global_step == 2:
            (tmp_path / "checkpoint-2").write_text("written by someone else meanwhile")
        return original_save(model, trial)

    trainer._save_checkpoint = save
    with pytest.raises(ValueError, match=r"checkpoint-2 \(a file\)"):
        trainer.train()
    assert (tmp_path / "checkpoint-2").read_text() == "written by someone else meanwhile"
    assert checkpoint_problem(str(tmp_path / "checkpoint-1")) is None
    assert (tmp_path / ".tmp-checkpoint-2").read_text() == "unrelated"
