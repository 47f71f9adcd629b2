"""Benchmark of group arena rewards (GAR, issue 8): judge cost, ranking quality and concurrency, side by side.

A simulated judge with known response qualities q (Bradley-Terry: P(a beats b) = q_a / (q_a + q_b)), a slot-one
bias (+`--bias` to the first response's win probability), Bernoulli noise and a per-call latency. For each group size
G it prints, over `--trials` groups:

1. judge calls of Swiss over round robin (ratio),
2. ranking quality: Kendall tau between the rewards and the true qualities, for round robin / Swiss, with and
   without `both_orders` (which cancels the slot bias),
3. wall time of the GRPO reward function on a batch of `--groups` groups: concurrent (thread pool) over sequential.

Run: ``python benchmarks/bench_arena.py`` (about 10 s); ``--latency 0.02 --trials 50`` for more.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from tqdm import tqdm

from trl_stable.rewards import ArenaReward, run_arena


def kendall_tau(x: list[float], y: list[float]) -> float:
    concordant = discordant = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        s = (x[i] - x[j]) * (y[i] - y[j])
        concordant += s > 0
        discordant += s < 0
    total = len(x) * (len(x) - 1) / 2
    return (concordant - discordant) / total


def make_judge(quality: dict[str, float], bias: float, latency: float, seed: int):
    rng = random.Random(seed)

    def judge(prompt: str, a: str, b: str) -> float:
        if latency:
            time.sleep(latency)
        p = min(1.0, quality[a] / (quality[a] + quality[b]) + bias)
        return float(rng.random() < p)  # a hard verdict, like an LLM's [[A]] / [[B]]

    return judge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--bias", type=float, default=0.25)
    parser.add_argument("--latency", type=float, default=0.005)
    parser.add_argument("--groups", type=int, default=4)
    args = parser.parse_args()

    print(f"{'G':>3} {'swiss/rr calls':>15} {'tau rr':>7} {'tau swiss':>9} {'tau rr 1-order':>15} "
          f"{'concurrent/sequential time':>27}")  # fmt: skip
    for g in args.sizes:
        taus = {key: [] for key in ("rr", "swiss", "rr1")}
        calls = {"rr": 0, "swiss": 0}
        for trial in tqdm(range(args.trials), desc=f"G={g}", leave=False):
            rng = random.Random(trial)
            names = [f"resp{k}" for k in range(g)]
            quality = {n: rng.uniform(0.05, 1.0) for n in names}
            truth = [quality[n] for n in names]
            judge = make_judge(quality, args.bias, 0.0, seed=trial)
            rr = run_arena(names, "p", judge)
            sw = run_arena(names, "p", judge, pairing="swiss", seed=trial)
            rr1 = run_arena(names, "p", judge, both_orders=False)
            calls["rr"] += rr.judge_calls
            calls["swiss"] += sw.judge_calls
            taus["rr"].append(kendall_tau(rr.rewards, truth))
            taus["swiss"].append(kendall_tau(sw.rewards, truth))
            taus["rr1"].append(kendall_tau(rr1.rewards, truth))

        quality = {f"resp{k}": 0.1 + k for k in range(g)}
        prompts = [f"prompt{k}" for k in range(args.groups) for _ in range(g)]
        completions = [f"resp{k}" for _ in range(args.groups) for k in range(g)]
        judge = make_judge(quality, 0.0, args.latency, seed=0)
        times = {}
        for workers in (1, 8):
            reward = ArenaReward(judge, pairing="swiss", max_workers=workers)
            start = time.perf_counter()
            reward(prompts=prompts, completions=completions)
            times[workers] = time.perf_counter() - start
        mean = {k: sum(v) / len(v) for k, v in taus.items()}
        print(f"{g:>3} {calls['swiss'] / calls['rr']:>15.3f} {mean['rr']:>7.3f} {mean['swiss']:>9.3f} "
              f"{mean['rr1']:>15.3f} {times[8] / times[1]:>27.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
