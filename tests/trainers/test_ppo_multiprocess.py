"""PPOTrainer under accelerate with 2 CPU processes: both finish with identical weights, and every process logs the
numbers one process holding the global batch would log.

`train()` runs with a sequence reward that gives rank 1 one unscored sample per step (so the processes keep different
numbers of samples), a dense reward and the lexicon critic: the reward metrics are checked against values recomputed
from what each process's reward functions saw. `step()` on fixed halves of one global batch (responses of different
lengths, a NaN score, sampler log-probs, a step mask) is compared with one process stepping the whole batch: every
logged statistic must agree.
"""

import json
import math
import textwrap

import pytest
import torch
from tiny_configs import tiny_ppo_args
from two_processes import check_returncode, launch_two_processes

from trl_stable import PPOTrainer
from trl_stable.masking.completion_steps import CompletionStepMasker
from trl_stable.testing import build_causal_lm

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from two_process_kit import DenseRecorder, RecordingCritic, uneven_lm
    from tiny_configs import tiny_ppo_args
    from tiny_data import SHORT_PROMPTS
    from trl_stable import PPOTrainer
    from trl_stable.masking.completion_steps import CompletionStepMasker
    from trl_stable.testing import build_causal_lm, build_tokenizer

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    lengths = []

    def length(completion_ids, trainer_state, **kw):  # rank 1's first sample of each step has no score: dropped
        values = [None if rank == 1 and i == 0 else len(c) / 5 for i, c in enumerate(completion_ids)]
        lengths.append({"step": trainer_state.global_step, "values": values})
        return values

    def low_ids(completion_ids):
        return [[1.0 if t < 300 else float("nan") if t > 800 else 0.0 for t in ids] for ids in completion_ids]

    tok = build_tokenizer()
    model = uneven_lm("qwen2", tok)
    dense = DenseRecorder(low_ids)
    critic = RecordingCritic(tok)
    args = tiny_ppo_args(out, mini_batch_size=1, gradient_accumulation_steps=2, ppo_epochs=2, min_new_tokens=2,
                         learning_rate=1e-3, max_steps=2, use_score_scaling=True, use_decoupled_loss=True,
                         token_filter="icepop", step_loss_mask=True)
    ds = Dataset.from_dict({"prompt": SHORT_PROMPTS * 4})
    trainer = PPOTrainer(model, reward_funcs=[length, dense, critic], args=args, processing_class=tok,
                         train_dataset=ds)
    trainer.train()
    weights = trainer.unwrapped().state_dict()
    checksum = float(sum(v.double().sum() for v in weights.values()))
    record = {"rank": rank, "world": trainer.accelerator.num_processes, "checksum": checksum,
              "steps": trainer.state.global_step, "kl_coef": trainer.kl_ctl.value, "count": trainer.running.count,
              "train_logs": trainer.state.log_history,
              "seen": {"length": lengths, "dense": dense.seen, "critic": critic.seen}}

    # step() on this process's half of a fixed global batch
    with open(os.path.join(out, "batch.json")) as f:
        batch = json.load(f)
    half = slice(rank * 4, rank * 4 + 4)
    stepper = PPOTrainer(build_causal_lm("qwen2", tok, seed=0), args=tiny_ppo_args(out, **batch["config"]),
                         processing_class=tok)
    stepper.step_masker = CompletionStepMasker(extra_steps=lambda text, i: [
        {"start": 0, "end": 1, "unit": "char", "type": "code",
         "metadata": {"exec_status": "crash" if len(text) % 3 == 0 else "ok"}}] if text else [])
    stats = stepper.step([torch.tensor(q) for q in batch["queries"][half]],
                         [torch.tensor(r) for r in batch["responses"][half]],
                         token_rewards=batch["token_rewards"][half], scores=batch["scores"][half],
                         sampler_logprobs=[torch.tensor(lp) for lp in batch["sampler_logprobs"][half]])
    record["step_logs"] = stats
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    # both ranks are done; skip the interpreter's teardown (see two_processes)
    trainer.accelerator.wait_for_everyone()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)

# The step() comparison: the global batch and the per-process config; one process steps it with batch_size 8.
STEP_CONFIG = dict(batch_size=4, mini_batch_size=1, gradient_accumulation_steps=4, ppo_epochs=2, learning_rate=1e-3,
                   use_score_scaling=True, use_score_norm=True, whiten_rewards=True, use_decoupled_loss=True,
                   token_filter="icepop", step_loss_mask=True)  # fmt: skip


def _global_batch() -> dict:
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 6, 2, 5, 7, 1, 4, 6]  # different numbers of tokens on the two processes
    queries = [torch.randint(3, 900, (2 + i % 3,), generator=gen).tolist() for i in range(8)]
    responses = [torch.randint(3, 900, (n,), generator=gen).tolist() for n in lengths]
    token_rewards = [[0.1 * ((t + i) % 3) for t in range(n)] for i, n in enumerate(lengths)]
    scores = [0.5, -1.0, 2.0, 0.0, 1.5, float("nan"), -0.5, 1.0]  # the NaN: a sample dropped on process 1
    # near the tiny model's log-probs (about -log 937); one token far off, for IcePop to mask
    logps = [[-6.84 + 0.05 * ((t + i) % 3 - 1) + (3.0 if (i, t) == (4, 2) else 0.0) for t in range(n)]
             for i, n in enumerate(lengths)]  # fmt: skip
    return dict(queries=queries, responses=responses, token_rewards=token_rewards, scores=scores,
                sampler_logprobs=logps, config=STEP_CONFIG)  # fmt: skip


def _mask_steps(text, i):
    return [
        {"start": 0, "end": 1, "unit": "char", "type": "code",
         "metadata": {"exec_status": "crash" if len(text) % 3 == 0 else "ok"}}
    ] if text else []  # fmt: skip


def _one_process_step(tokenizer, tmp_path, batch) -> dict:
    config = {**batch["config"], "batch_size": 8, "gradient_accumulation_steps": 8}
    trainer = PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0), args=tiny_ppo_args(tmp_path, **config),
        processing_class=tokenizer,
    )  # fmt: skip
    trainer.step_masker = CompletionStepMasker(extra_steps=_mask_steps)
    return trainer.step(
        [torch.tensor(q) for q in batch["queries"]],
        [torch.tensor(r) for r in batch["responses"]],
        token_rewards=batch["token_rewards"],
        scores=batch["scores"],
        sampler_logprobs=[torch.tensor(lp) for lp in batch["sampler_logprobs"]],
    )


def test_two_process_accelerate_run(tokenizer, tmp_path):
    # one test per launch: under pytest-xdist a module fixture would launch once per worker
    (tmp_path / "batch.json").write_text(json.dumps(_global_batch()))
    proc = launch_two_processes(tmp_path, SCRIPT)
    check_returncode(proc)
    run = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    check_replicas_and_logs_agree(run)
    check_train_logs_the_global_reward_metrics(run)
    check_step_logs_what_one_process_with_the_global_batch_logs(run, tokenizer, tmp_path / "one_process")


def check_replicas_and_logs_agree(run):
    records = run
    assert all(r["world"] == 2 and r["steps"] == 2 for r in records)
    # DDP keeps the replicas in sync; the KL controller and running score stats use all processes' samples
    assert records[0]["checksum"] == pytest.approx(records[1]["checksum"], rel=1e-6)
    assert records[0]["kl_coef"] == pytest.approx(records[1]["kl_coef"])
    assert records[0]["count"] == pytest.approx(14.0)  # 2 steps x (4 + 3 scored) samples
    # logged statistics are reduced over processes: every rank reports the same numbers
    logs = [
        [{k: v for k, v in h.items() if not k.startswith("time/")} for h in r["train_logs"] if "loss/total" in h]
        for r in records
    ]
    assert "behaviour_weight/max" in logs[0][0] and "critic/step_samples" in logs[0][0]
    assert len(logs[0]) == len(logs[1])
    for rank0, rank1 in zip(logs[0], logs[1]):  # one record per logged step (approx takes no nested structures)
        assert rank0 == pytest.approx(rank1)


def _per_step(records, kind):
    per_rank = [{e["step"]: e for e in r["seen"][kind]} for r in records]
    return {step: (per_rank[0][step], per_rank[1][step]) for step in per_rank[0]}


def check_train_logs_the_global_reward_metrics(run):
    logs = {h["step"]: h for h in run[0]["train_logs"] if "loss/total" in h}
    for step, parts in _per_step(run, "length").items():
        h = logs[step + 1]
        scored = [v for p in parts for v in p["values"] if v is not None]
        assert h["rewards/length/mean"] == pytest.approx(sum(scored) / len(scored), rel=1e-6)
        assert h["env/reward_mean"] == pytest.approx(sum(scored) / len(scored), rel=1e-6)
        assert h["env/reward_std"] == pytest.approx(torch.tensor(scored).std().item(), rel=1e-5)
        assert h["ppo/dropped_samples"] == 1.0
        per_process = [
            sum(v for v in p["values"] if v is not None) / sum(v is not None for v in p["values"]) for p in parts
        ]
        assert not math.isclose(h["env/reward_mean"], sum(per_process) / 2)  # not a mean of per-process means
    for step, parts in _per_step(run, "dense").items():
        h = logs[step + 1]
        assert h["rewards/low_ids/token_mean"] == pytest.approx(
            sum(p["sum"] for p in parts) / sum(p["tokens"] for p in parts)
        )
        assert h["rewards/low_ids/sum_mean"] == pytest.approx(
            sum(p["sum"] for p in parts) / sum(p["rows"] for p in parts)
        )
        assert h["rewards/low_ids/nan_tokens"] == sum(p["nan"] for p in parts)
    for step, parts in _per_step(run, "critic").items():
        h = logs[step + 1]
        for name in ("samples", "critiqued", "answers", "tokens_total", "tokens_rewarded"):
            assert h[f"critic/step_{name}"] == sum(p[f"critic/step_{name}"] for p in parts), name
        rewarded = sum(p["critic/step_tokens_rewarded"] for p in parts)
        assert h["critic/rewarded_token_fraction"] == pytest.approx(
            rewarded / sum(p["critic/step_tokens_total"] for p in parts)
        )
        assert h["critic/stage_seconds"] == pytest.approx(max(p["critic/stage_seconds"] for p in parts))


def check_step_logs_what_one_process_with_the_global_batch_logs(run, tokenizer, tmp_path):
    reference = _one_process_step(tokenizer, tmp_path, _global_batch())
    for record in run:
        logs = record["step_logs"]
        keys = {k for k in reference if not k.startswith("time/")}
        assert keys == {k for k in logs if not k.startswith("time/")}
        different = {
            k: (logs[k], reference[k]) for k in keys if logs[k] != pytest.approx(reference[k], rel=1e-4, abs=1e-6)
        }
        assert not different
    assert reference["ppo/dropped_samples"] == 1.0 and 0 < reference["step_mask/frac_invalid_steps"] < 1
    assert 0 < reference["token_filter/icepop/masked_token_frac"] < 1


BROKEN_ON_ONE_RANK = textwrap.dedent(
    """
    import os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from tiny_configs import tiny_grpo_args, tiny_ppo_args
    from tiny_data import SHORT_PROMPTS
    from trl_stable import GRPOTrainer, PPOTrainer
    from trl_stable.rewards.dense import RewardContractError
    from trl_stable.testing import build_causal_lm, build_tokenizer

    out, kind = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])

    def reward(completion_ids, **kw):  # only rank 1 sees a broken answer; its inf is no error (it does not apply)
        return ["0.5" if rank == 1 and i == 1 else float("inf") if i == 0 else 0.5 for i in range(len(completion_ids))]

    tok = build_tokenizer()
    ds = Dataset.from_dict({"prompt": SHORT_PROMPTS})
    if kind == "ppo":
        args = tiny_ppo_args(out, batch_size=2, max_new_tokens=3, max_steps=1)
        trainer = PPOTrainer(build_causal_lm("qwen2", tok, seed=0), reward_funcs=reward, args=args,
                             processing_class=tok, train_dataset=ds)
    else:
        args = tiny_grpo_args(out, per_device_train_batch_size=2, max_completion_length=3)
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
    proc = launch_two_processes(tmp_path, BROKEN_ON_ONE_RANK, kind)
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert "RewardTypeError: Reward function 'reward' returned '0.5' (str) for completion 1" in messages[1]
    assert "on another process" in messages[0]
