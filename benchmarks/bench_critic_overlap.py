"""What a slow LLM critic adds to a PPO step, with and without the prefetch overlap (issue "the critic stage: hidden
behind the forward passes").

`PPOTrainer.train()` scores the environment reward, prefetches the dense reward functions (the critic sends its
requests) and collects them after the rollout pass (policy + value + reference forwards). Four arms, the same seeded
PPO run each: a critic behind the loopback OpenAI-compatible server (`tests/rewards/fake_openai_server.py`) answering
after `--latency` seconds or at once, and the critic with its `prefetch` hidden (so the trainer calls it only after
the rollout pass, the order before the overlap existed). We report the median wall time of a full `train()` step
(generation, rewards, PPO step), how long the step waits for the critic after the rollout pass, and the ratio
slow / instant per mode (1.0: the critic's latency is fully hidden). Step times swing with machine load; the wait
is the steadier number.

The overlap hides the latency up to the rollout pass's duration; the default model (hidden 256, 6 layers, batch 16,
32 new tokens, mini-batches of 4) makes that pass longer than 100 ms on a 2-core CPU.

    python benchmarks/bench_critic_overlap.py                 # about 3-4 minutes on 2 CPU cores
    python benchmarks/bench_critic_overlap.py --latency 0.3 --steps 8
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OPENAI_API_KEY", "sk-bench-DUMMY-overlap")  # the loopback server checks nothing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "rewards"))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from fake_openai_server import FakeOpenAIServer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_stable import PPOConfig, PPOTrainer  # noqa: E402
from trl_stable.rewards import CriticIntrinsicReward, CriticRewardConfig  # noqa: E402
from trl_stable.testing import build_causal_lm, build_tokenizer  # noqa: E402

PROMPTS = ["The movie", "A story", "I think", "We saw", "It was", "She said", "They made", "In the end"]


def env_reward(completions, **kwargs):
    return [min(len(c), 40) / 41 for c in completions]


def last_word_answer(prompt: str) -> str:
    """Names the last word of the text as a positive span, so every answer is parsed and aligned."""
    words = prompt.split()
    return "Identified Positive Text Span:\n[Span 1]: " + (words[-1] if words else "None identified")


class NoPrefetch:
    """The critic without its `prefetch` (a dense function the trainer simply calls after the rollout pass)."""

    dense = True

    def __init__(self, critic: CriticIntrinsicReward):
        self.critic = critic
        self.__name__ = critic.__name__

    def __call__(self, *args, **kwargs):
        return self.critic(*args, **kwargs)


class StepTimes(TrainerCallback):
    def __init__(self):
        self.stamps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def run_arm(latency: float, overlap: bool, cli: argparse.Namespace, tokenizer) -> tuple[float, float, float]:
    """Median seconds of one seeded PPO run: train step, rollout pass, and the wait for the critic after it."""
    with FakeOpenAIServer(answer=last_word_answer, latency=latency) as server:
        cfg = CriticRewardConfig(
            use_intrinsic_reward=True,
            intrinsic_reward_threshold=math.inf,  # critique every sample
            critic_backend="openai",
            critic_base_url=server.base_url,
            critic_model="tiny",
            critic_timeout=10.0,
        )
        critic = CriticIntrinsicReward(cfg, tokenizer)
        times = StepTimes()
        with tempfile.TemporaryDirectory() as out:
            args = PPOConfig(
                output_dir=out, batch_size=cli.batch_size, mini_batch_size=cli.mini_batch_size, ppo_epochs=1,
                max_new_tokens=cli.new_tokens, min_new_tokens=cli.new_tokens, max_steps=cli.steps + 1, seed=0,
                report_to="none", disable_tqdm=True, save_strategy="no",
            )  # fmt: skip
            model = build_causal_lm(
                "qwen2", tokenizer, seed=0, hidden_size=cli.hidden, intermediate_size=4 * cli.hidden,
                num_hidden_layers=cli.layers,
            )  # fmt: skip
            trainer = PPOTrainer(
                model,
                reward_funcs=[env_reward, critic if overlap else NoPrefetch(critic)],
                args=args,
                processing_class=tokenizer,
                train_dataset=Dataset.from_dict({"prompt": PROMPTS * (cli.batch_size // len(PROMPTS) + 1)}),
                callbacks=[times],
            )
            passes = []
            real_pass = trainer.rollout_pass

            def timed_pass(batch):
                t0 = time.perf_counter()
                out_ = real_pass(batch)
                passes.append(time.perf_counter() - t0)
                return out_

            trainer.rollout_pass = timed_pass
            waits = []
            real_resolve = trainer._resolve_token_rewards

            def timed_resolve(deferred, responses):  # how long the step waits for the critic after the forwards
                t0 = time.perf_counter()
                out_ = real_resolve(deferred, responses)
                waits.append(time.perf_counter() - t0)
                return out_

            trainer._resolve_token_rewards = timed_resolve
            start = time.perf_counter()
            trainer.train()
        critic.close()
    stamps = [start, *times.stamps]
    steps = [b - a for a, b in zip(stamps, stamps[1:])][1:]  # the first step warms up
    return statistics.median(steps), statistics.median(passes[1:]), statistics.median(waits[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds the slow critic takes per request")
    parser.add_argument("--steps", type=int, default=8, help="timed PPO steps per arm (after one warm-up step)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--mini_batch_size", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the four arms (medians over rounds)")
    cli = parser.parse_args()
    logging.getLogger("trl_stable.monitoring").setLevel(logging.ERROR)  # the toy policy trips the length alarm
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    tokenizer = build_tokenizer()
    arms = [(overlap, latency) for overlap in (True, False) for latency in (0.0, cli.latency)]
    run_arm(0.0, True, argparse.Namespace(**{**vars(cli), "steps": 1}), tokenizer)  # warm-up, not reported
    rounds: dict[tuple[bool, float], list[tuple[float, float, float]]] = {arm: [] for arm in arms}
    for _ in range(cli.repeats):
        for arm in arms:  # interleaved, so a slow phase of the machine hits every arm
            rounds[arm].append(run_arm(arm[1], arm[0], cli, tokenizer))
    results = {}
    for (overlap, latency), runs in rounds.items():
        step = statistics.median(r[0] for r in runs)
        rollout = statistics.median(r[1] for r in runs)
        wait = statistics.median(r[2] for r in runs)
        results[overlap, latency] = step, rollout, wait
        print(
            f"overlap={'on ' if overlap else 'off'} critic latency {latency * 1000:5.0f} ms: "
            f"step {step * 1000:7.1f} ms (rollout pass {rollout * 1000:6.1f} ms, then waits for the critic "
            f"{wait * 1000:6.1f} ms)"
        )
    on = results[True, cli.latency][0] / results[True, 0.0][0]
    off = results[False, cli.latency][0] / results[False, 0.0][0]
    print(
        f"step time {cli.latency * 1000:.0f} ms critic / instant critic: with overlap {on:.3f}, without {off:.3f} "
        f"(goal with overlap <= 1.10 while the rollout pass outlasts the critic)"
    )


if __name__ == "__main__":
    main()
