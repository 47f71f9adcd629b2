"""GRPO checkpoints: marked complete after transformers wrote them, resumed from the newest complete one, with the
dynamic-sampling refill RNG, the NaN-reward count and the health monitor restored (the continuation equals the
uninterrupted run), and old checkpoints rotated only once the new one is complete."""

import json
import logging
import os

import pytest
import torch
from datasets import Dataset
from kill_points import fail_torch_save_on
from tiny_configs import tiny_grpo_args
from tiny_data import PROMPTS

from trl_stable import GRPOTrainer
from trl_stable.testing import build_causal_lm
from trl_stable.trainers.checkpoints import MARKER_FILE, checkpoint_problem


def reward(prompts, completions, **kwargs):
    """Groups of the second prompt have no variance (dynamic sampling drops and refills them); the first prompt's
    odd-length completions have no reward (dropped and counted)."""
    out = []
    for prompt, completion in zip(prompts, completions):
        if prompt == PROMPTS[0] and len(completion) % 2:
            out.append(None)
        elif prompt == PROMPTS[1]:
            out.append(1.0)
        else:
            out.append(float(len(completion)))
    return out


def make(tokenizer, out, max_steps=3, **overrides):
    config = dict(
        max_completion_length=6,
        max_steps=max_steps,
        learning_rate=1e-2,
        seed=0,
        save_strategy="steps",
        save_steps=1,
        dynamic_sampling=True,
        dynamic_sampling_max_refills=2,
        nan_reward_action="drop",  # the NaN-drop count is part of the state resume restores
        # reward_above_max (reward_max 1.0) is raised at step 2: the step-2 checkpoint has it active
        health_monitor_kwargs={"patience": 2},
    )
    config.update(overrides)
    return GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=reward,
        args=tiny_grpo_args(out, **config),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        processing_class=tokenizer,
    )


def steps(trainer):
    """The per-step logs without wall-clock timings."""
    return [
        {k: v for k, v in h.items() if k not in ("step_time", "train_runtime") and "per_second" not in k}
        for h in trainer.state.log_history
        if "loss" in h
    ]


def assert_same_weights(a, b):
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), name


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    from trl_stable.testing import build_tokenizer

    trainer = make(build_tokenizer(), tmp_path_factory.mktemp("straight"))
    trainer.train()
    logs = steps(trainer)
    assert [h["dynamic_sampling/refill_rounds"] for h in logs] == [2.0, 1.0, 1.0]  # refills at every step
    assert logs[1]["health/alarm/reward_above_max"] == 1.0
    return trainer


def test_resume_continues_as_the_uninterrupted_run(straight, tokenizer, tmp_path):
    checkpoint = os.path.join(straight.args.output_dir, "checkpoint-2")
    assert checkpoint_problem(checkpoint) is None
    marker = json.loads(open(os.path.join(checkpoint, MARKER_FILE)).read())
    assert {"trainer_state.json", "rng_state.pth", "trl_stable_state_0.pt"} <= set(marker["files"])
    resumed = make(tokenizer, tmp_path)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_same_weights(straight, resumed)
    # step 3 draws the refill prompts the uninterrupted run drew, counts NaN rewards on from step 2, and still flags
    # the alarm active at step 2 with the reward ceiling reached so far
    assert steps(resumed) == steps(straight)
    assert resumed._nan_dropped_total == straight._nan_dropped_total > 0
    assert torch.equal(resumed._refill_generator.get_state(), straight._refill_generator.get_state())


@pytest.mark.parametrize("killed_file", ["rng_state.pth", "trl_stable_state_0.pt"])
def test_kill_while_saving_falls_back_to_the_previous_complete_checkpoint(
    straight, tokenizer, tmp_path, monkeypatch, caplog, killed_file
):
    """A kill inside transformers' save (the RNG file) or after it (trl_stable's state, once transformers has
    rotated): with save_total_limit=1 the step-1 checkpoint is still there, and resume=True takes it."""
    killed = make(tokenizer, tmp_path, save_total_limit=1)
    real = killed._save_checkpoint

    def save_checkpoint(model, trial):
        if killed.state.global_step == 2:
            fail_torch_save_on(monkeypatch, killed_file)
        return real(model, trial)

    killed._save_checkpoint = save_checkpoint
    with pytest.raises(OSError, match=f"killed while writing {killed_file}"):
        killed.train()
    monkeypatch.undo()
    assert checkpoint_problem(str(tmp_path / "checkpoint-1")) is None
    assert (
        checkpoint_problem(str(tmp_path / "checkpoint-2")) == "saving it was interrupted (its marker says incomplete)"
    )

    resumed = make(tokenizer, tmp_path, save_total_limit=1)
    with caplog.at_level(logging.WARNING, logger="trl_stable.trainers.checkpoints"):
        resumed.train(resume_from_checkpoint=True)
    assert f"Resuming from {tmp_path / 'checkpoint-1'}, the newest complete checkpoint; skipped: checkpoint-2" in (
        caplog.text
    )
    assert_same_weights(straight, resumed)
    assert steps(resumed) == steps(straight)
    health = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert [r["step"] for r in health if r["type"] == "metrics"] == [1, 2, 3]  # the killed run's step 2 is gone
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint-")) == ["checkpoint-3"]
    assert checkpoint_problem(str(tmp_path / "checkpoint-3")) is None


def test_checkpoint_without_trainer_state_is_refused_with_the_fix(straight, tokenizer, tmp_path):
    import shutil

    for step in (1, 2):
        shutil.copytree(os.path.join(straight.args.output_dir, f"checkpoint-{step}"), tmp_path / f"checkpoint-{step}")
    os.remove(tmp_path / "checkpoint-2" / "trainer_state.json")
    trainer = make(tokenizer, tmp_path)
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert f"{tmp_path / 'checkpoint-2'} has no trainer_state.json" in str(err.value)
    assert f"Fix: resume from {tmp_path / 'checkpoint-1'}" in str(err.value)


def test_checkpoints_hold_what_trl_writes_and_the_arguments_stay_put(tokenizer, tmp_path):
    """trl_stable writes TRL's checkpoint itself (to rotate only after the marker): the same files as
    `trl.GRPOTrainer`, plus the marker and trl_stable's state, the same trainer state and weights, the same rotation
    (save_total_limit=1 keeps the last), and `args.save_total_limit` is what the user set whenever anyone looks."""
    import trl
    from transformers import TrainerCallback

    def run(trainer_cls, args, out):
        limits = []

        class Watch(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                limits.append(args.save_total_limit)

        trainer = trainer_cls(
            model=build_causal_lm("qwen2", tokenizer, seed=0), reward_funcs=reward, args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}), processing_class=tokenizer,
            callbacks=[Watch()],
        )  # fmt: skip
        trainer.train()
        folders = sorted(p for p in os.listdir(out) if p.startswith("checkpoint-"))
        files = {f: sorted(os.listdir(out / f)) for f in folders}
        return files, json.loads((out / folders[-1] / "trainer_state.json").read_text()), limits, trainer

    config = dict(
        max_completion_length=6, max_steps=2, learning_rate=1e-2, seed=0, save_strategy="steps", save_steps=1,
        save_total_limit=1,
    )  # fmt: skip
    ref_args = tiny_grpo_args(tmp_path / "ref", config_class=trl.GRPOConfig, **config)
    ref_files, ref_state, ref_limits, _ = run(trl.GRPOTrainer, ref_args, tmp_path / "ref")
    ours_args = tiny_grpo_args(tmp_path / "ours", health_monitor=False, **config)
    ours_files, ours_state, ours_limits, ours = run(GRPOTrainer, ours_args, tmp_path / "ours")
    assert list(ours_files) == list(ref_files) == ["checkpoint-2"]
    extra = {MARKER_FILE, "trl_stable_state_0.pt"}
    assert set(ours_files["checkpoint-2"]) == set(ref_files["checkpoint-2"]) | extra
    assert not extra & set(ref_files["checkpoint-2"])
    timing = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
    ref_logs, ours_logs = (
        [{k: v for k, v in h.items() if k not in timing} for h in s["log_history"]] for s in (ref_state, ours_state)
    )
    assert ours_logs == ref_logs and ours_state["global_step"] == ref_state["global_step"] == 2
    rest = [{k: v for k, v in s.items() if k != "log_history"} for s in (ref_state, ours_state)]
    assert rest[0] == rest[1]  # total flos, the callbacks' state, the best checkpoint
    assert ours_limits == ref_limits == [1, 1] and ours.args.save_total_limit == 1
    weights = [(tmp_path / run / "checkpoint-2" / "model.safetensors").read_bytes() for run in ("ref", "ours")]
    assert weights[0] == weights[1]
    assert (tmp_path / "ours" / "README.md").exists() and (tmp_path / "ref" / "README.md").exists()
