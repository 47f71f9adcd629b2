"""PPOTrainer under accelerate with 2 CPU processes: both finish with identical weights and shared statistics.

`accelerate launch --cpu --num_processes 2` starts a single process (accelerate's simple launcher); two CPU processes
need `--multi_gpu --num_processes 2` with `ACCELERATE_USE_CPU=true` (torchrun underneath, gloo backend).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from trl_stable import PPOConfig, PPOTrainer
    from trl_stable.rewards import dense_reward
    from trl_stable.testing import build_causal_lm, build_tokenizer

    @dense_reward
    def low_ids(prompts, completions, completion_ids, **kw):
        return [[1.0 if t < 300 else 0.0 for t in ids] for ids in completion_ids]

    out = sys.argv[1]
    tok = build_tokenizer()
    args = PPOConfig(output_dir=out, batch_size=4, mini_batch_size=1, gradient_accumulation_steps=2, ppo_epochs=2,
                     max_new_tokens=5, min_new_tokens=2, learning_rate=1e-3, max_steps=2, report_to="none",
                     disable_tqdm=True, save_strategy="no", use_score_scaling=True,
                     use_decoupled_loss=True, token_filter="icepop")
    ds = Dataset.from_dict({"prompt": ["The movie", "A story", "I think", "We saw"] * 4})
    trainer = PPOTrainer(build_causal_lm("qwen2", tok, seed=0), reward_funcs=[lambda completion_ids, **kw: [
        len(c) / 5 for c in completion_ids], low_ids], args=args, processing_class=tok, train_dataset=ds)
    trainer.train()
    rank = trainer.accelerator.process_index
    weights = trainer.unwrapped().state_dict()
    checksum = float(sum(v.double().sum() for v in weights.values()))
    record = {"rank": rank, "world": trainer.accelerator.num_processes, "checksum": checksum,
              "steps": trainer.state.global_step, "kl_coef": trainer.kl_ctl.value, "count": trainer.running.count,
              "logs": {k: v for k, v in trainer.state.log_history[-1].items()
                       if k.startswith(("objective/", "behaviour_weight/", "mismatch/", "loss/"))}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    # both ranks are done; skip the interpreter's teardown, where gloo's destructors race with the peer's exit and can
    # abort ("terminate called ...", SIGABRT) depending on timing
    trainer.accelerator.wait_for_everyone()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)


def _free_port() -> int:
    # not accelerate's default 29500: another multi-process test running at the same time would collide on it
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp_path, script_text: str, *script_args: str) -> subprocess.CompletedProcess:
    if shutil.which("accelerate") is None:
        pytest.skip("accelerate CLI not installed")
    script = tmp_path / "run_ppo.py"
    script.write_text(script_text)
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(script),
        str(tmp_path),
        *script_args,
    ]
    try:
        # ~20 s on a loaded 2-core machine; the limit only turns a hung rendezvous into a failure with its output
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        pytest.fail(f"the 2-process run did not finish within 300 s; stderr tail:\n{tail!r}")


def test_two_process_accelerate_run(tmp_path):
    proc = _launch(tmp_path, SCRIPT)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "terminate" in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + "\n...\n" + proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["steps"] == 2 for r in records)
    # DDP keeps the replicas in sync; the KL controller and running score stats use all processes' samples
    assert records[0]["checksum"] == pytest.approx(records[1]["checksum"], rel=1e-6)
    assert records[0]["kl_coef"] == pytest.approx(records[1]["kl_coef"])
    assert records[0]["count"] == pytest.approx(16.0)  # 2 steps x 2 processes x 4 samples
    # logged statistics are reduced over processes: every rank reports the same numbers
    logs = [r["logs"] for r in records]
    assert "behaviour_weight/max" in logs[0] and "objective/kl" in logs[0] and "loss/policy" in logs[0]
    assert logs[0] == pytest.approx(logs[1])


BROKEN_ON_ONE_RANK = textwrap.dedent(
    """
    import os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from trl_stable import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
    from trl_stable.rewards.dense import RewardContractError
    from trl_stable.testing import build_causal_lm, build_tokenizer

    out, kind = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])

    def reward(completion_ids, **kw):  # only rank 1 sees a broken answer; its inf is no error (it does not apply)
        return ["0.5" if rank == 1 and i == 1 else float("inf") if i == 0 else 0.5 for i in range(len(completion_ids))]

    tok = build_tokenizer()
    ds = Dataset.from_dict({"prompt": ["The movie", "A story", "I think", "We saw"]})
    common = dict(output_dir=out, max_steps=1, report_to="none", save_strategy="no")
    if kind == "ppo":
        args = PPOConfig(batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=3, disable_tqdm=True, **common)
        trainer = PPOTrainer(build_causal_lm("qwen2", tok, seed=0), reward_funcs=reward, args=args,
                             processing_class=tok, train_dataset=ds)
    else:
        args = GRPOConfig(per_device_train_batch_size=2, num_generations=2, max_completion_length=3, use_cpu=True,
                          **common)
        trainer = GRPOTrainer(build_causal_lm("qwen2", tok, seed=0), reward_funcs=reward, args=args,
                              processing_class=tok, train_dataset=ds)
    try:
        trainer.train()
        message = "no error"
    except RewardContractError as err:
        message = f"{type(err).__name__}: {err}"
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    trainer.accelerator.wait_for_everyone()  # both ranks got here: nobody is stuck in a collective
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's destructors race with the peer's exit
    """
)


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_a_broken_reward_on_one_process_stops_both(tmp_path, kind):
    proc = _launch(tmp_path, BROKEN_ON_ONE_RANK, kind)
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert "RewardTypeError: Reward function 'reward' returned '0.5' (str) for completion 1" in messages[1]
    assert "on another process" in messages[0]
