"""`trl_stable.monitoring.reduction`: metrics reduced over processes equal the metric of the concatenated batch.

Two "processes" are two threads whose `gather` / `gather_object` meet at a barrier, so the collectives run for real
(same order on both, or they block) without launching processes; tests/trainers/test_*_multiprocess.py run the
trainers on two real processes.
"""

import math
import threading
from collections import defaultdict
from types import SimpleNamespace

import accelerate.utils
import pytest
import torch

from trl_stable.monitoring.metric_names import CRITIC_STEP_RATIOS, critic_step_ratios
from trl_stable.monitoring.reduction import (
    Stat,
    dense_reward_stats,
    logged_metric_stat,
    reduce_metrics,
    step_mask_stats,
)
from trl_stable.rewards.dense import collect_dense_rewards
from trl_stable.trainers.grpo.trl_logs import flush_reward_metrics


class _Group:
    """The shared state of `n` thread "processes": one slot each, a barrier around every collective."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots = [None] * n
        self.rank = threading.local()

    def exchange(self, value):
        self.slots[self.rank.value] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out


class _Accelerator:
    def __init__(self, group: _Group):
        self.group = group
        self.num_processes = group.n
        self.device = torch.device("cpu")

    def gather(self, tensor):
        return torch.cat(self.group.exchange(tensor))


def run_on_two(fn, *per_process_args, monkeypatch):
    """`fn(accelerator, args)` on two thread processes (args: one per process); their results, or the first error."""
    group = _Group(2)
    accelerator = _Accelerator(group)
    monkeypatch.setattr(
        accelerate.utils, "gather_object", lambda objs: [o for part in group.exchange(list(objs)) for o in part]
    )
    results, errors = [None, None], [None, None]

    def body(rank):
        group.rank.value = rank
        try:
            results[rank] = fn(accelerator, per_process_args[rank])
        except Exception as err:  # noqa: BLE001 - handed to the test (a peer left waiting times out of the barrier)
            errors[rank] = err

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results, errors


def test_mean_is_over_all_items_not_a_mean_of_means(monkeypatch):
    parts = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]
    results, errors = run_on_two(
        lambda acc, x: reduce_metrics({"m": Stat.mean(x)}, acc), *parts, monkeypatch=monkeypatch
    )
    assert errors == [None, None]
    assert results[0] == results[1] == {"m": pytest.approx(16.0 / 4)}  # not (2 + 10) / 2


def test_masked_token_mean_and_empty_process(monkeypatch):
    x = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0]])]
    mask = [torch.tensor([[1, 0], [1, 1]]), torch.tensor([[0, 0]])]  # process 1 has no token
    results, _ = run_on_two(
        lambda acc, a: reduce_metrics({"m": Stat.mean(*a), "none": Stat.mean(a[0], a[1] * 0, empty=-1.0)}, acc),
        *zip(x, mask),
        monkeypatch=monkeypatch,
    )
    assert results[0] == results[1] == {"m": pytest.approx(8.0 / 3), "none": -1.0}


def test_sum_min_max_std_equal_the_concatenated_batch(monkeypatch):
    parts = [torch.tensor([0.5, -2.0, 3.25, 1.0]), torch.tensor([7.0, -1.5])]
    full = torch.cat(parts).double()

    def reduce(acc, x):
        return reduce_metrics(
            {"sum": Stat.total(x.sum()), "max": Stat.max(x), "min": Stat.min(x), "std": Stat.std(x), "cfg": 3.0}, acc
        )

    results, _ = run_on_two(reduce, *parts, monkeypatch=monkeypatch)
    assert results[0] == results[1]
    assert results[0] == {
        "sum": pytest.approx(full.sum().item()),
        "max": 7.0,
        "min": -2.0,
        "std": pytest.approx(full.std().item(), rel=1e-12),  # unbiased, as torch's
        "cfg": 3.0,  # a plain float passes through
    }


def test_extremes_and_std_skip_processes_without_items(monkeypatch):
    parts = [torch.tensor([4.0]), torch.tensor([])]
    results, _ = run_on_two(
        lambda acc, x: reduce_metrics({"max": Stat.max(x), "min": Stat.min(x, empty=9.0), "std": Stat.std(x)}, acc),
        *parts,
        monkeypatch=monkeypatch,
    )
    assert results[0] == results[1] == {"max": 4.0, "min": 4.0, "std": 0.0}  # one item: no spread


def test_names_only_some_processes_log(monkeypatch):
    shares = [
        {"step_mask/steps": Stat.total(2), "step_mask/exec_crash": Stat.total(1)},
        {"step_mask/steps": Stat.total(3)},
    ]
    results, errors = run_on_two(
        lambda acc, s: reduce_metrics(s, acc, names_may_differ=True), *shares, monkeypatch=monkeypatch
    )
    assert errors == [None, None]
    assert results[0] == results[1] == {"step_mask/steps": 5.0, "step_mask/exec_crash": 1.0}


def test_different_names_without_names_may_differ_raise_on_every_process(monkeypatch):
    shares = [{"a": Stat.total(1)}, {"b": Stat.total(1)}]
    _, errors = run_on_two(lambda acc, s: reduce_metrics(s, acc), *shares, monkeypatch=monkeypatch)
    assert all(isinstance(e, ValueError) and "names_may_differ" in str(e) for e in errors)


def test_one_process_needs_no_accelerator():
    x = torch.tensor([1.0, 3.0])
    out = reduce_metrics({"first": 1.0, "m": Stat.mean(x), "s": Stat.total(2), "last": 2.0})
    assert list(out) == ["first", "m", "s", "last"] and out == {"first": 1.0, "m": 2.0, "s": 2.0, "last": 2.0}


def test_dense_reward_metrics_are_token_weighted(monkeypatch):
    # per process: rows of one dense function; the reference is `collect_dense_rewards` on the whole batch
    rows = [[[1.0, float("nan"), 0.5]], [[2.0], [0.0, 0.0, 0.0, 4.0]]]

    def metrics(part):
        lengths = [len(r) for r in part]
        out = collect_dense_rewards([None], ["f"], [1.0], lengths, call=lambda func: part)
        return out.metrics, lengths

    results, _ = run_on_two(
        lambda acc, part: reduce_metrics(dense_reward_stats(*metrics(part)), acc), *rows, monkeypatch=monkeypatch
    )
    reference, _ = metrics(rows[0] + rows[1])
    assert results[0] == results[1] == pytest.approx(reference)
    assert reference["rewards/f/token_mean"] == pytest.approx(7.5 / 8)


def test_step_mask_fraction_from_global_counts(monkeypatch):
    shares = [
        {"step_mask/steps": 3.0, "step_mask/frac_invalid_steps": 2 / 3, "step_mask/exec_crash": 2.0},
        {"step_mask/steps": 1.0, "step_mask/frac_invalid_steps": 0.0},
    ]
    results, _ = run_on_two(
        lambda acc, s: reduce_metrics(step_mask_stats(s), acc, names_may_differ=True), *shares, monkeypatch=monkeypatch
    )
    assert (
        results[0]
        == results[1]
        == {
            "step_mask/steps": 4.0,
            "step_mask/frac_invalid_steps": 0.5,  # 2 of 4 steps, not the mean (2/3 + 0) / 2
            "step_mask/exec_crash": 2.0,
        }
    )


def _critic_last(counts: dict, seconds: float) -> dict:
    """What `CriticIntrinsicReward` logs per call: its counts, its fractions and its stage time."""
    return {
        **{f"critic/step_{k}": float(v) for k, v in counts.items()},
        **critic_step_ratios(counts),
        "critic/stage_seconds": seconds,
    }


def test_critic_metrics_sum_counts_and_recompute_fractions(monkeypatch):
    names = {k for num, den in CRITIC_STEP_RATIOS.values() for k in (*num, *den)}
    counts = [dict.fromkeys(names, 0) for _ in range(2)]
    counts[0].update(samples=4, critiqued=4, answers=3, failed_answers=1, tokens_total=20, tokens_rewarded=5)
    counts[0].update(spans_positive=2, spans_matched=2)
    counts[1].update(samples=4, critiqued=1, answers=1, unparseable=1, tokens_total=6, tokens_rewarded=0)
    shares = [_critic_last(counts[0], 0.5), _critic_last(counts[1], 1.25)]

    results, _ = run_on_two(
        lambda acc, last: reduce_metrics({k: logged_metric_stat(k, [v]) for k, v in last.items()}, acc),
        *shares,
        monkeypatch=monkeypatch,
    )
    total = {k: counts[0][k] + counts[1][k] for k in names}
    assert results[0] == results[1] == pytest.approx(_critic_last(total, 1.25))
    assert results[0]["critic/critiqued_fraction"] == 5 / 8  # not (4/4 + 1/4) / 2
    assert results[0]["critic/rewarded_token_fraction"] == 5 / 26


def test_logged_metric_kinds():
    assert logged_metric_stat("arena/judge_calls", [3.0, 4.0]) == Stat.total(7.0)
    assert logged_metric_stat("critic/step_answers", [2.0]).kind == "sum"
    assert logged_metric_stat("critic/stage_seconds", [1.0, 3.0]).kind == "max"
    assert logged_metric_stat("my/metric", [1.0, 2.0]) == Stat.ratio(3.0, 2)  # TRL's mean over calls


def test_flush_reward_metrics_sums_counts_and_keeps_trls_mean(monkeypatch):
    def trainer(acc, pending):
        t = SimpleNamespace(
            accelerator=acc,
            model=SimpleNamespace(training=True),
            _metrics={"train": defaultdict(list)},
            _pending_metrics=defaultdict(list, pending),
        )
        flush_reward_metrics(t, select=lambda name: name.startswith("arena/"))
        own = dict(t._metrics["train"])
        flush_reward_metrics(t)  # what is left: TRL's rule
        return own, dict(t._metrics["train"])

    shares = [{"arena/judge_calls": [6.0], "user/x": [1.0, 2.0]}, {"arena/judge_calls": [4.0], "user/x": [6.0]}]
    results, errors = run_on_two(trainer, *shares, monkeypatch=monkeypatch)
    assert errors == [None, None] and results[0] == results[1]
    own, everything = results[0]
    assert own == {"arena/judge_calls": [10.0]}
    assert everything == {"arena/judge_calls": [10.0], "user/x": [pytest.approx(3.0)]}  # (1 + 2 + 6) / 3 calls


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="median"):
        Stat("median")
    assert math.isnan(reduce_metrics({"m": Stat.mean(torch.tensor([]), empty=math.nan)})["m"])
