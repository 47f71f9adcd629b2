"""GRPOTrainer on 2 CPU processes with trl_stable's options on: no deadlock, and every process logs the numbers one
process holding the global batch would log.

On rank 1 a step's first group and every refilled group score a constant, so dynamic sampling drops them there and
(but by chance) never on rank 0: only rank 1 is short of informative rows, the situation in which a refill decided on
a process's own keep mask left rank 0 returning while rank 1 waited in the refill round's collectives. The logged
metrics are checked against values recomputed here from what each process's reward functions, step masker and
rounds saw.
"""

import json
import math
import textwrap

import pytest
from two_processes import check_returncode, launch_two_processes

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from two_process_kit import DenseRecorder, RecordingCritic, uneven_lm
    from tiny_configs import tiny_grpo_args
    from trl_stable import GRPOTrainer
    from trl_stable.core import overlong_penalty
    from trl_stable.masking.completion_steps import CompletionStepMasker
    from trl_stable.testing import build_tokenizer

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    G = 2  # num_generations
    seen = {"step_mask": [], "rounds": []}

    first_round, constant = {}, []

    def token_sum(prompts, completion_ids, trainer_state, **kw):
        # On rank 1 the first group of a step's first round and every group of its refill rounds get the same total
        # reward (this one makes up for the length terms of the others): dynamic sampling drops them on rank 1 only,
        # and the refills never fill rank 1's batch.
        first = first_round.setdefault(trainer_state.global_step, True)
        first_round[trainer_state.global_step] = False
        constant[:] = [rank == 1 and (i < G or not first) for i in range(len(completion_ids))]
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        penalty = overlong_penalty(lengths, 8, 4).tolist()
        return [1.0 - p if c else float(sum(ids) % 7) for c, p, ids in zip(constant, penalty, completion_ids)]

    def sometimes_none(completion_ids, **kw):
        return [0.0 if c else None if i % 3 == 0 else len(ids) / 8
                for i, (c, ids) in enumerate(zip(constant, completion_ids))]

    def first_tokens(completion_ids):
        return [[(0.5 if t == 0 else 0.1 * (ids[t] % 3)) if t != 1 else float("nan") for t in range(len(ids))]
                for ids in completion_ids]

    class Masker(CompletionStepMasker):
        def keep_mask(self, *a, **kw):
            keep = super().keep_mask(*a, **kw)
            seen["step_mask"].append({"step": trainer.state.global_step, **self.last_counts})
            return keep

    def reported_steps(text, index):
        # the environment reports one code step per completion: every third crashed, and on rank 0 only every third
        # timed out (a reason one process never logs), the others ran
        if len(text) < 2:
            return []
        status = "crash" if index % 3 == 0 else "timeout" if rank == 0 and index % 3 == 1 else "ok"
        return [{"start": 0, "end": 2, "unit": "char", "type": "code", "metadata": {"exec_status": status}}]

    class Trainer(GRPOTrainer):
        def _generate_and_score_round(self, inputs):
            output, keep = super()._generate_and_score_round(inputs)
            if keep is not None:
                seen["rounds"].append({"step": self.state.global_step, "kept": int(keep.sum()), "rows": len(keep)})
            return output, keep

    tok = build_tokenizer()
    model = uneven_lm("qwen3_moe", tok)
    dense = DenseRecorder(first_tokens)
    critic = RecordingCritic(tok)
    args = tiny_grpo_args(
        out, num_generations=G, max_steps=2, learning_rate=1e-3, seed=0, advantage_estimator="rloo",
        use_decoupled_loss=True, token_filter="icepop", dynamic_sampling=True, dynamic_sampling_max_refills=2,
        overlong_penalty_tokens=4, dense_reward_coef=0.5, nan_reward_action="drop", step_loss_mask=True,
        health_mismatch_monitor=True, routing_replay="R3",
    )
    prompts = ["The movie", "A story", "I think", "We saw", "She said", "It was", "They went", "He is"]
    trainer = Trainer(model=model, reward_funcs=[token_sum, sometimes_none, dense, critic], args=args,
                      processing_class=tok, train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.step_masker = Masker(extra_steps=reported_steps)
    trainer.train()
    record = {"rank": rank, "world": trainer.accelerator.num_processes, "steps": trainer.state.global_step,
              "logs": [h for h in trainer.state.log_history if "loss" in h],
              "seen": {**seen, "dense": dense.seen, "critic": critic.seen}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    trainer.accelerator.wait_for_everyone()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)

# wall-clock and throughput numbers are each process's own
_PER_PROCESS = ("runtime", "_per_second", "step_time")


def _by_step(entries):
    out = {}
    for entry in entries:
        out.setdefault(entry["step"], []).append(entry)
    return out


def _rounds(records, kind):
    """Per logged step, per generation round: the entries of both processes (same rounds on each)."""
    per_rank = [_by_step(r["seen"][kind]) for r in records]
    steps = sorted(per_rank[0])
    assert steps == sorted(per_rank[1])
    return {step: list(zip(per_rank[0][step], per_rank[1][step], strict=True)) for step in steps}


def _critic_ratio(parts, num, den):
    return sum(p[f"critic/step_{k}"] for p in parts for k in num) / max(
        sum(p[f"critic/step_{k}"] for p in parts for k in den), 1
    )


def test_two_process_run_with_every_option(tmp_path):
    # one test per launch: under pytest-xdist a module fixture would launch once per worker
    proc = launch_two_processes(tmp_path, SCRIPT)
    check_returncode(proc)  # no deadlock, no collective mismatch
    run = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    check_refills_ran_on_one_process_only(run)
    check_every_process_logs_the_same_numbers(run)
    check_logged_metrics_are_the_global_batch_values(run)


def check_refills_ran_on_one_process_only(run):
    assert all(r["world"] == 2 and r["steps"] == 2 for r in run)
    first_rounds = [{e["step"]: e for e in reversed(r["seen"]["rounds"])} for r in run]  # first round of each step
    assert any(first_rounds[1][s]["kept"] < first_rounds[1][s]["rows"] for s in first_rounds[1])
    # the deadlock case: rank 0 kept every row of its first round while rank 1 needed a refill
    assert any(
        first_rounds[0][s]["kept"] == first_rounds[0][s]["rows"]
        and first_rounds[1][s]["kept"] < first_rounds[1][s]["rows"]
        for s in first_rounds[0]
    )
    assert all(
        h["dynamic_sampling/refill_rounds"] >= 1 for h in run[0]["logs"] if "dynamic_sampling/refill_rounds" in h
    )


def check_every_process_logs_the_same_numbers(run):
    logs = [r["logs"] for r in run]
    assert len(logs[0]) == len(logs[1]) == 2
    for h0, h1 in zip(*logs):
        keys = {k for k in h0 if not any(p in k for p in _PER_PROCESS)}
        assert keys == {k for k in h1 if not any(p in k for p in _PER_PROCESS)}
        for k in ("rewards/first_tokens/token_mean", "critic/step_samples", "step_mask/steps", "routing/agreement"):
            assert k in keys, k
        different = {k: (h0[k], h1[k]) for k in keys if h0[k] != pytest.approx(h1[k], rel=1e-6, abs=1e-9)}
        assert not different


def check_logged_metrics_are_the_global_batch_values(run):
    logs = {h["step"]: h for h in run[0]["logs"]}
    n = run[0]["seen"]["rounds"][0]["rows"]
    for step, rounds in _rounds(run, "dense").items():
        h = logs[step + 1]  # generated at the start of the step, logged at its end
        token_mean = [sum(p["sum"] for p in parts) / sum(p["tokens"] for p in parts) for parts in rounds]
        assert h["rewards/first_tokens/token_mean"] == pytest.approx(sum(token_mean) / len(token_mean), rel=1e-5)
        sum_mean = [sum(p["sum"] for p in parts) / sum(p["rows"] for p in parts) for parts in rounds]
        assert h["rewards/first_tokens/sum_mean"] == pytest.approx(sum(sum_mean) / len(sum_mean), rel=1e-5)
        nan_tokens = [sum(p["nan"] for p in parts) for parts in rounds]
        assert h["rewards/first_tokens/nan_tokens"] == pytest.approx(sum(nan_tokens) / len(nan_tokens))
    for step, rounds in _rounds(run, "critic").items():
        h = logs[step + 1]
        for name in ("samples", "critiqued", "answers", "tokens_total", "tokens_rewarded", "spans_positive"):
            counts = [sum(p[f"critic/step_{name}"] for p in parts) for parts in rounds]
            assert h[f"critic/step_{name}"] == pytest.approx(sum(counts) / len(counts)), name
        for name, num, den in (
            ("critic/rewarded_token_fraction", ("tokens_rewarded",), ("tokens_total",)),
            ("critic/critiqued_fraction", ("critiqued",), ("samples",)),
            ("critic/spans_per_critique", ("spans_positive", "spans_negative"), ("answers",)),
        ):
            ratios = [_critic_ratio(parts, num, den) for parts in rounds]
            assert h[name] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5), name
        seconds = [max(p["critic/stage_seconds"] for p in parts) for parts in rounds]
        assert h["critic/stage_seconds"] == pytest.approx(sum(seconds) / len(seconds), rel=1e-5)
    for step, rounds in _rounds(run, "step_mask").items():
        h = logs[step + 1]
        steps = [sum(sum(p.values()) - p["step"] for p in parts) for parts in rounds]
        invalid = [sum(sum(v for k, v in p.items() if k not in ("step", "ok")) for p in parts) for parts in rounds]
        assert h["step_mask/steps"] == pytest.approx(sum(steps) / len(steps))
        fracs = [i / s if s else 0.0 for i, s in zip(invalid, steps)]
        assert h["step_mask/frac_invalid_steps"] == pytest.approx(sum(fracs) / len(fracs), rel=1e-5)
        assert 0 < h["step_mask/frac_invalid_steps"] < 1
        timeouts = [sum(p.get("exec_timeout", 0) for p in parts) for parts in rounds]
        assert h["step_mask/exec_timeout"] == pytest.approx(sum(timeouts) / len(timeouts))
    for step, rounds in _rounds(run, "rounds").items():
        h = logs[step + 1]
        kept = [sum(entry["kept"] for entry in entries) for entries in zip(*rounds)]  # per process, all rounds
        if "dynamic_sampling/frac_batch_filled" in h:
            filled = sum(min(k, n) for k in kept) / (2 * n)
            assert h["dynamic_sampling/frac_batch_filled"] == pytest.approx(filled)
            assert not math.isclose(filled, min(kept[0], n) / n)  # rank 0's own share would differ
