"""PPO checkpoints with 2 CPU processes: the main process publishes a checkpoint holding every process's RNG and
trl_stable state, and a run resumed from it on 2 processes ends with the uninterrupted run's weights."""

import json
import textwrap

from two_processes import launch_two_processes

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from tiny_configs import tiny_ppo_args
    from tiny_data import SHORT_PROMPTS
    from trl_stable import PPOTrainer
    from trl_stable.testing import build_causal_lm, build_tokenizer

    out = sys.argv[1]
    tok = build_tokenizer()
    ds = Dataset.from_dict({"prompt": SHORT_PROMPTS * 4})

    def make(folder):
        args = tiny_ppo_args(os.path.join(out, folder), batch_size=2, mini_batch_size=1, ppo_epochs=2,
                             max_new_tokens=4, learning_rate=1e-3, max_steps=3, save_strategy="steps", save_steps=2,
                             logging_steps=1)
        return PPOTrainer(build_causal_lm("qwen2", tok, seed=0), reward_funcs=lambda completion_ids, **kw: [
            len(c) / 5 for c in completion_ids], args=args, processing_class=tok, train_dataset=ds)

    def checksum(trainer):
        return float(sum(v.double().sum() for v in trainer.unwrapped().state_dict().values()))

    straight = make("a")
    straight.train()
    resumed = make("b")
    resumed.train(resume_from_checkpoint=os.path.join(out, "a", "checkpoint-2"))
    rank = resumed.accelerator.process_index
    params = zip(straight.unwrapped().parameters(), resumed.unwrapped().parameters())

    def history(trainer):
        # the steps, without wall-clock timings (Trainer's end-of-training summary times the call it ends)
        return [
            {k: v for k, v in h.items() if not k.startswith("time/")}
            for h in trainer.state.log_history
            if "train_runtime" not in h
        ]

    record = {"rank": rank, "equal": all(torch.equal(p, q) for p, q in params), "checksum": checksum(resumed),
              "history": history(resumed), "straight_history": history(straight)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    resumed.accelerator.wait_for_everyone()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)


def test_two_process_checkpoint_and_resume(tmp_path):
    proc = launch_two_processes(tmp_path, SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = json.loads((tmp_path / "a" / "checkpoint-2" / "trl_stable_checkpoint.json").read_text())
    assert marker["complete"] and marker["num_processes"] == 2
    for name in ("rng_state_0.pth", "rng_state_1.pth", "trl_stable_state_0.pt", "trl_stable_state_1.pt"):
        assert name in marker["files"]
    assert not [p.name for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temporary folder left
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["equal"] for r in records)  # each process continues its own streams exactly
    assert records[0]["checksum"] == records[1]["checksum"]
    assert records[0]["history"] == records[0]["straight_history"]
