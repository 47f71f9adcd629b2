"""Dense critic rewards (RELC / Drlc: Cao et al., EMNLP 2024, arXiv 2401.07382), measured so that a policy exploiting
the reward cannot pass for one that learned.

Two experiments on the embedded tiny policy (the `trl_stable.testing` GPT-2 warmed up on the shipped reviews), PPO
with a value model and the adaptive KL controller (target 6), every arm in one run, the same seeds for every arm:

``--task credit``: credit assignment. The sequence reward is no sum over tokens: 1 if the 16-token continuation
    uses none of the banned words "the", "and", "a", else 0 (about 18% of the untrained policies' held-out
    continuations are clean). The policy cannot stop early to dodge them: its EOS logit is masked in every forward
    pass (policy and reference alike, so the samples stay on-policy and the KL honest). A rule critic names each
    banned word in the answer format of the LLM critics, and `CriticIntrinsicReward` turns its spans into token
    rewards (-0.5 on the banned words' tokens, the per-sample sum bounded by 1). The KL controller is the one the
    task was measured with (initial coefficient 0.1, horizon 10000; `--credit_controller`). Arms: ``sparse`` (the
    reward only), ``dense`` (plus the critic's token rewards) and ``critic_sum`` (the same critic total added to the
    last token: the critic's information without its location, which isolates credit assignment from the extra
    reward).
``--task sentiment``: the README's main command (`examples/research_projects/sentiment/ppo_intrinsic.py`, embedded
    default, VADER as the environment reward). Arms: ``baseline`` (no critic), ``critic_vader`` (the earlier
    default: a lexicon critic reading VADER's own word list, RELC's unbounded +-0.5 per token), ``critic_relc`` (the
    AFINN lexicon critic, RELC's unbounded +-0.5 per token), ``critic_bound1`` and ``critic_bound0.5`` (the AFINN
    critic, per-sample absolute sum bounded by 1 or 0.5: `intrinsic_reward_max_sum`; 0.5 is the embedded default).

Judged by what the training signal cannot hack: held-out prompts (`eval_scripts/neutral_prompts.jsonl`, sampled and
scored with `eval_scripts/eval_utils.py`: top-p 0.9), the positive rate under TextBlob's lexicon (neither the reward
nor the critic), perplexity under a separately trained scoring LM (`embedded-scorer`, not the policy nor its
reference), dist-1/2/3, and the reward at matched KL: the best 10-step mean reward reached while the 10-step mean KL
stayed within a budget (the reward-vs-KL frontier), not the reward per step alone.

    python benchmarks/exp_relc_dense.py --task credit       # 5 seeds x 3 arms x 80 steps, ~4 min of CPU
    python benchmarks/exp_relc_dense.py --task sentiment    # 5 seeds x 5 arms x 100 steps, ~8 min of CPU
    python benchmarks/exp_relc_dense.py --task all --quick  # CI smoke test (tests/benchmarks/test_exp_relc_dense.py)
    python benchmarks/exp_relc_dense.py --task credit --from_json outputs/exp_relc_dense/results_credit.json
                                                            # table and figure again, from a finished run

Prints a table of medians [min, max] over seeds and writes `results_<task>.json`, `results_<task>.md` under
`--output_dir`, and the figure (per-step reward with a min-max band over seeds, the reward-vs-KL frontier, distinct-2
of the rollouts) to `docs/images/relc_<task>.png` (`--figure_dir`; `--quick`: under `--output_dir`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from exp_common import REPO, examples_on_path, load_example

examples_on_path()
from eval_utils import (  # noqa: E402
    EMBEDDED_SCORER_SETTINGS,
    EVAL_DIR,
    fluency_diversity,
    load_prompts,
    sample_continuations,
)
from policy_loading import load_policy  # noqa: E402
from ppo_args import loop_ppo_config  # noqa: E402
from prompt_batches import truncate_queries  # noqa: E402
from reward_curve import smooth  # noqa: E402
from script_args import parse_script_args  # noqa: E402
from sentiment_task import load_review_texts  # noqa: E402
from text_metrics import distinct_n  # noqa: E402

from trl_stable import PPOTrainer  # noqa: E402
from trl_stable.rewards import CriticBackend, CriticIntrinsicReward, CriticRewardConfig  # noqa: E402
from trl_stable.rewards.critic.lexicon import format_sentiment_answer  # noqa: E402

SCRIPT = "sentiment/ppo_intrinsic.py"  # the README's main command, under examples/research_projects/
BANNED = ("the", "and", "a")
_WORD = re.compile(r"[A-Za-z']+")
ARMS = {
    "credit": ("sparse", "dense", "critic_sum"),
    "sentiment": ("baseline", "critic_vader", "critic_relc", "critic_bound1", "critic_bound0.5"),
}
SENTIMENT_FLAGS = {
    "baseline": [],
    "critic_vader": ["--use_intrinsic_reward", "--critic_lexicon", "vader", "--intrinsic_reward_max_sum", "None"],
    "critic_relc": ["--use_intrinsic_reward", "--critic_lexicon", "afinn", "--intrinsic_reward_max_sum", "None"],
    "critic_bound1": ["--use_intrinsic_reward", "--critic_lexicon", "afinn", "--intrinsic_reward_max_sum", "1.0"],
    "critic_bound0.5": ["--use_intrinsic_reward", "--critic_lexicon", "afinn", "--intrinsic_reward_max_sum", "0.5"],
}
STEPS = {"credit": 80, "sentiment": 100}
# The reward level of "steps to reach" and the KL budgets of the frontier, per task.
LEVELS = {"credit": 0.6, "sentiment": 0.5}
KL_BUDGETS = (4.0, 8.0, 12.0, 16.0)  # around the controller's target of 6, and past it where a run overshoots
# The credit task keeps the KL controller it was measured with (docs/results_relc.md), the sentiment script's earlier
# embedded default: under the later one (init 0.3, horizon 512) its 16 forced tokens stay near KL 6 and no arm
# learns much in 80 steps (`--credit_controller default` runs it so).
CREDIT_CONTROLLER = ["--ppo_config.init_kl_coef", "0.1", "--ppo_config.horizon", "10000"]
# The controller docs/results_relc.md's sentiment arms were measured with (the script's embedded default then; it is
# now init 0.4, horizon 256), pinned so that the tables reproduce.
MEASURED_CONTROLLER = ["--ppo_config.init_kl_coef", "0.3", "--ppo_config.horizon", "512"]
WINDOW = 10  # steps of the trailing means behind "final" values and the frontier


# ------------------------------------------------------------------------------------------------ the credit task


def banned_words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text) if w.lower() in BANNED]


def clean_reward(texts: Sequence[str]) -> list[float]:
    """1.0 for a text without a banned word, else 0.0: a minimum over the words, not a sum."""
    return [0.0 if banned_words(t) else 1.0 for t in texts]


class BannedWordCritic(CriticBackend):
    """A critic that knows the rule: it names each banned word of a text as a negative span (sentiment answer
    format), so the span parser and the token alignment of the LLM critics run unchanged."""

    name = "banned_words"

    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        texts = list(texts) if texts is not None else list(prompts)
        self.counters.add("requests", len(texts))
        self.counters.add("attempts")
        answers = [format_sentiment_answer([], sorted({w.lower() for w in banned_words(t)})) for t in texts]
        self.counters.add("successes", len(texts))
        return list(answers)


def credit_critic(tokenizer, max_sum: float | None = 1.0) -> CriticIntrinsicReward:
    config = CriticRewardConfig(
        use_intrinsic_reward=True,
        positive_reward_value=0.0,
        negative_reward_value=-0.5,
        intrinsic_reward_threshold=math.inf,  # critique every sample, clean ones too (they get no span)
        intrinsic_reward_max_sum=max_sum,
        critic_include_prompt=False,
    )
    return CriticIntrinsicReward(config, tokenizer, backend=BannedWordCritic())


def mask_eos(model, eos_token_id: int):
    """Make EOS impossible in every forward pass of `model` (a hook on its output embeddings; the reference model,
    a deep copy, inherits it). Masking only in `generate` (``min_new_tokens``) would sample from a distribution the
    PPO loss and the KL do not see: the KL estimate went negative as the policy moved mass onto the masked EOS."""

    def hook(module, inputs, logits):
        return logits.index_fill(-1, torch.tensor([eos_token_id], device=logits.device), -1e9)

    model.get_output_embeddings().register_forward_hook(hook)
    return model


def run_credit(arm: str, seed: int, cli: argparse.Namespace, out: Path) -> tuple[list[dict], object, object]:
    """One PPO run of the credit task; returns (history, trained policy, tokenizer)."""
    script = load_example(SCRIPT)
    controller = CREDIT_CONTROLLER if cli.credit_controller == "earlier" else MEASURED_CONTROLLER
    argv = [*controller, *cli.ppo_flags, "--ppo_config.seed", str(seed), "--model_save_path", str(out)]
    args = parse_script_args(script.ScriptArguments, argv)
    ppo = replace(args.ppo_config, min_new_tokens=None, max_new_tokens=cli.new_tokens)
    model, tokenizer = load_policy(None, seed, args, "sentiment", True)
    mask_eos(model, tokenizer.eos_token_id)  # every continuation runs its 16 tokens: ending early is no way out
    texts = load_review_texts(None, True)
    prompts = truncate_queries(tokenizer, texts, args.min_query_tokens, args.max_query_tokens, seed)
    trainer = PPOTrainer(model, args=loop_ppo_config(ppo, str(out)), processing_class=tokenizer)
    critic = credit_critic(tokenizer) if arm != "sparse" else None
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(1, cli.steps + 1):
        pick = torch.randperm(len(prompts), generator=generator)[: ppo.batch_size].tolist()
        records = [prompts[i] for i in pick]
        queries = [torch.tensor(r["input_ids"]) for r in records]
        responses = trainer.generate(queries, return_prompt=False)
        response_texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        env = clean_reward(response_texts)
        rows = [[0.0] * len(r) for r in responses]
        if critic is not None:
            critiques = critic(
                prompts=[r["query"] for r in records],
                completions=response_texts,
                completion_ids=[r.tolist() for r in responses],
                env_rewards=env,
            )
            rows = [[float(v) for v in c] if c is not None else z for c, z in zip(critiques, rows)]
        if arm == "critic_sum":  # the critic's total on the last token: what it says, not where
            rows = [[0.0] * (len(r) - 1) + [sum(r)] for r in rows]
        stats = trainer.step(queries, responses, token_rewards=rows, scores=env)
        history.append(
            {
                "step": step,
                "env_reward": statistics.mean(env),
                "intrinsic_reward": statistics.mean(sum(r) for r in rows),
                "kl": float(stats.get("objective/kl", float("nan"))),
                "distinct_2": distinct_n(response_texts, 2),
            }
        )
    return history, trainer.unwrapped().policy, tokenizer


# --------------------------------------------------------------------------------------------- the sentiment task


def run_sentiment(arm: str, seed: int, cli: argparse.Namespace, out: Path) -> tuple[list[dict], object, object]:
    """One run of the README's main command with the arm's critic flags."""
    script = load_example(SCRIPT)
    argv = [*MEASURED_CONTROLLER, *SENTIMENT_FLAGS[arm], *cli.ppo_flags, "--max_steps", str(cli.steps)]
    argv += ["--ppo_config.seed", str(seed)]
    argv += ["--model_save_path", str(out)]
    args = parse_script_args(script.ScriptArguments, argv)
    history = script.main(args)
    from transformers import AutoModelForCausalLM

    from trl_stable.testing import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    return history, AutoModelForCausalLM.from_pretrained(out), tokenizer


# ------------------------------------------------------------------------------------------------------ evaluation


def positive_rate(classify: Callable[[list[str]], list[float]], gens: list[list[str]]) -> float:
    flat = [g for row in gens for g in row]
    return sum(p > 0.5 for p in classify(flat)) / len(flat)


def heldout_eval(task: str, model, tokenizer, scorer, cli: argparse.Namespace, seed: int) -> dict[str, float]:
    """Held-out metrics of a trained policy on the neutral prompts (eval_scripts' sampling and metrics)."""
    from scorers import AFINN, TEXTBLOB, VADER, build_sentiment_classifier

    prompts = load_prompts(EVAL_DIR / "neutral_prompts.jsonl", cli.eval_prompts)
    model.eval()
    gens = sample_continuations(
        model, tokenizer, prompts, num_return=cli.eval_samples, max_new_tokens=cli.new_tokens or 20, seed=seed,
        desc="held-out samples",
    )  # fmt: skip
    metrics: dict[str, float] = {}
    if task == "credit":
        flat = [g for row in gens for g in row]
        metrics["clean_rate"] = statistics.mean(clean_reward(flat))
        metrics["words"] = statistics.mean(len(g.split()) for g in flat)
    else:
        metrics["positive_textblob"] = positive_rate(build_sentiment_classifier(TEXTBLOB), gens)
        metrics["positive_vader"] = positive_rate(build_sentiment_classifier(VADER), gens)
        metrics["positive_afinn"] = positive_rate(build_sentiment_classifier(AFINN), gens)
    fluency, _ = fluency_diversity(*scorer, prompts, gens)
    metrics.update(fluency)
    metrics["sample"] = f"{prompts[0]}|{gens[0][0]}"
    metrics["samples"] = [f"{p}|{g[0]}" for p, g in zip(prompts[:4], gens[:4])]
    return metrics


def initial_policy(task: str, seed: int, cli: argparse.Namespace):
    """The untrained embedded policy of `seed` (every arm of that seed starts from it), for a reference column."""
    script = load_example(SCRIPT)
    args = parse_script_args(script.ScriptArguments, [*cli.ppo_flags, "--ppo_config.seed", str(seed)])
    model, tokenizer = load_policy(None, seed, args, "sentiment", True)
    if task == "credit":
        mask_eos(model, tokenizer.eos_token_id)
    tokenizer.padding_side = "left"
    return model, tokenizer


def load_scorer(cli: argparse.Namespace):
    """The scoring LM of the perplexity: `embedded-scorer` (quick mode: its architecture, a short warm-up)."""
    from embedded import embedded_policy

    settings = dict(EMBEDDED_SCORER_SETTINGS)
    if cli.quick:
        settings["warmup_steps"] = 10
    model, tokenizer = embedded_policy(show_progress=False, **settings)
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


# --------------------------------------------------------------------------------------------------------- summary


def steps_to_level(rewards: list[float], level: float, window: int = 5) -> int | None:
    """First step (1-based) whose trailing `window`-step mean reward is >= `level`; None if never."""
    for i, value in enumerate(smooth(rewards, window)):
        if i + 1 >= window and value >= level:
            return i + 1
    return None


def frontier(history: list[dict], budget: float, window: int = WINDOW) -> float:
    """Best trailing-mean reward over the steps whose trailing-mean KL is <= `budget` (NaN: never within it)."""
    rewards = smooth([h["env_reward"] for h in history], window)
    kls = smooth([h["kl"] for h in history], window)
    first = window - 1 if len(history) >= window else 0  # full windows only: a one-step mean is noise
    within = [r for r, k in zip(rewards[first:], kls[first:]) if k <= budget]
    return max(within) if within else float("nan")


def run_metrics(task: str, history: list[dict], steps: int) -> dict[str, float]:
    if not history:  # the untrained policy: no training metrics
        keys = ["steps_to_level", "final_reward", "final_kl", "final_intrinsic", "rollout_distinct_2"]
        return dict.fromkeys(keys + [f"reward_at_kl<={b:g}" for b in KL_BUDGETS], float("nan"))
    rewards = [h["env_reward"] for h in history]
    reached = steps_to_level(rewards, LEVELS[task])
    tail = history[-WINDOW:]
    out = {
        "steps_to_level": float(reached if reached is not None else steps + 1),
        "final_reward": statistics.mean(h["env_reward"] for h in tail),
        "final_kl": statistics.mean(h["kl"] for h in tail),
        "final_intrinsic": statistics.mean(h["intrinsic_reward"] for h in tail),
        "rollout_distinct_2": statistics.mean(h.get("distinct_2", float("nan")) for h in tail),
    }
    for budget in KL_BUDGETS:
        out[f"reward_at_kl<={budget:g}"] = frontier(history, budget)
    return out


def median_range(values: list[float], censored: float | None = None) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "-"

    def fmt(v: float) -> str:
        if censored is not None and v >= censored:
            return f">{censored - 1:g}"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"

    missing = f" ({len(values) - len(finite)} n/a)" if len(finite) < len(values) else ""
    return f"{fmt(statistics.median(finite))} [{fmt(min(finite))}, {fmt(max(finite))}]{missing}"


def table(task: str, arms: Sequence[str], runs: dict[str, list[dict]], cli: argparse.Namespace) -> str:
    metrics = [k for k in runs[arms[0]][0] if k not in ("seed", "sample", "samples", "history", "seconds")]
    lines = [
        f"{task}: {len(cli.seeds)} seeds x {cli.steps} PPO steps per arm; median [min, max] over seeds; "
        f"steps_to_level: first step whose 5-step mean reward >= {LEVELS[task]} ('>{cli.steps}': not reached); "
        f"final_*: mean of the last {WINDOW} steps; reward_at_kl<=B: best {WINDOW}-step mean reward while the "
        f"{WINDOW}-step mean KL <= B; held-out metrics on {cli.eval_prompts or 40} neutral prompts x "
        f"{cli.eval_samples} samples; initial: the untrained policy of each seed.",
        "",
        "| metric | " + " | ".join(arms) + " |",
        "|---|" + "---|" * len(arms),
    ]
    for m in metrics:
        censored = cli.steps + 1 if m == "steps_to_level" else None
        cells = [median_range([float(r[m]) for r in runs[a]], censored) for a in arms]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    trained = [a for a in arms if a != "initial"]
    reached = [f"{a} {sum(r['steps_to_level'] <= cli.steps for r in runs[a])}/{len(runs[a])}" for a in trained]
    lines += ["", "runs reaching the level: " + ", ".join(reached)]
    return "\n".join(lines)


def _band(curves: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per point: median, min and max over the curves, NaN entries (a budget a run never kept to) left out."""
    columns = [[v for v in column if not math.isnan(v)] or [math.nan] for column in zip(*curves)]
    return [statistics.median(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


def plot(task: str, arms: Sequence[str], runs: dict[str, list[dict]], path: Path, cli: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ylabel = "clean rate (no banned word)" if task == "credit" else "environment reward (VADER compound)"
    for i, arm in enumerate(arms):
        color = f"C{i}"
        histories = [r["history"] for r in runs[arm]]
        n = min(len(h) for h in histories)
        steps = list(range(1, n + 1))
        for ax, key in ((axes[0], "env_reward"), (axes[2], "distinct_2")):
            curves = [smooth([h[t][key] for t in range(n)], 5) for h in histories]
            med, lo, hi = _band(curves)
            ax.fill_between(steps, lo, hi, color=color, alpha=0.18, linewidth=0)
            ax.plot(steps, med, color=color, linewidth=2, label=arm)
        budgets = [float(b) for b in range(1, int(1.5 * max(KL_BUDGETS)) + 1)]
        med, lo, hi = _band([[frontier(h, b) for b in budgets] for h in histories])
        axes[1].fill_between(budgets, lo, hi, color=color, alpha=0.18, linewidth=0)
        axes[1].plot(budgets, med, color=color, linewidth=2, marker="o", markersize=3, label=arm)
    axes[0].axhline(LEVELS[task], color="grey", linestyle="--", linewidth=1)
    axes[0].set(xlabel="PPO step", ylabel=ylabel, title="reward per step (5-step mean)")
    axes[1].axvline(6.0, color="grey", linestyle=":", linewidth=1)
    axes[1].set(xlabel="KL budget (10-step mean KL <= x)", ylabel="best 10-step mean reward",
                title="reward at matched KL")  # fmt: skip
    axes[2].set(xlabel="PPO step", ylabel="distinct-2 of the rollouts", title="diversity (5-step mean)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"RELC dense critic rewards, {task} task: median and min-max band over {len(cli.seeds)} seeds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------ main


def run_task(task: str, cli: argparse.Namespace) -> dict:
    arms = cli.arms or ARMS[task]
    if task == "credit" and not set(arms) <= set(ARMS["credit"]):
        raise SystemExit(f"--arms for the credit task: {', '.join(ARMS['credit'])}")
    if task == "sentiment" and not set(arms) <= set(SENTIMENT_FLAGS):
        raise SystemExit(f"--arms for the sentiment task: {', '.join(SENTIMENT_FLAGS)}")
    out = Path(cli.output_dir) / task
    scorer = load_scorer(cli)
    runner = run_credit if task == "credit" else run_sentiment
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    initial: list[dict] = []
    for seed in cli.seeds:
        row = {"seed": seed, **run_metrics(task, [], cli.steps)}
        initial.append({**row, **heldout_eval(task, *initial_policy(task, seed, cli), scorer, cli, seed)})
        for arm in arms:
            start = time.time()
            history, model, tokenizer = runner(arm, seed, cli, out / f"{arm}_seed{seed}")
            row = {"seed": seed, **run_metrics(task, history, cli.steps)}
            row.update(heldout_eval(task, model, tokenizer, scorer, cli, seed))
            row["seconds"] = time.time() - start
            print(json.dumps({"task": task, "arm": arm, **{k: v for k, v in row.items() if k != "samples"}}))
            runs[arm].append({**row, "history": history})
    out.mkdir(parents=True, exist_ok=True)
    results = {"args": vars(cli), "initial": initial, "runs": runs}
    (out.parent / f"results_{task}.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    return report(task, cli, results)


def report(task: str, cli: argparse.Namespace, results: dict) -> dict[str, list[dict]]:
    """Print and write the table, write the figure; `results` as `results_<task>.json` holds them."""
    runs, initial = results["runs"], results["initial"]
    arms = list(runs)
    cli.seeds = [r["seed"] for r in initial]
    cli.steps = len(runs[arms[0]][0]["history"])
    for name in ("eval_prompts", "eval_samples"):
        setattr(cli, name, results["args"].get(name, getattr(cli, name)))
    text = table(task, ["initial", *arms], {"initial": initial, **runs}, cli)
    print("\n" + text)
    print("\nheld-out samples (first seed; prompt | continuation):")
    for arm in ["initial", *arms]:
        print(f"  {arm}: {({'initial': initial, **runs})[arm][0]['sample']!r}")
    Path(cli.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(cli.output_dir) / f"results_{task}.md").write_text(text + "\n", encoding="utf-8")
    figure_dir = cli.figure_dir or (cli.output_dir if cli.quick else REPO / "docs" / "images")
    figure = Path(figure_dir) / f"relc_{task}.png"
    plot(task, arms, runs, figure, cli)
    print(f"figure: {figure}")
    return runs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("credit", "sentiment", "all"), default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=None, help="PPO steps per run (credit 80, sentiment 100)")
    parser.add_argument("--arms", nargs="+", default=None, help="subset or extension of the task's arms")
    parser.add_argument("--eval_prompts", type=int, default=None, help="held-out prompts (default all 40)")
    parser.add_argument("--eval_samples", type=int, default=5, help="samples per held-out prompt")
    parser.add_argument("--output_dir", default="outputs/exp_relc_dense")
    parser.add_argument("--quick", action="store_true", help="CI smoke test: 2 seeds, 3 steps, tiny batches")
    parser.add_argument("--from_json", default=None, help="rebuild the table and figure of --task from its JSON")
    parser.add_argument("--figure_dir", default=None, help="where relc_<task>.png goes (default docs/images)")
    parser.add_argument(
        "--credit_controller",
        choices=("earlier", "default"),
        default="earlier",
        help="credit task's KL controller: the one it was measured with (init 0.1, horizon 10000) or the "
        "one the sentiment arms were measured with (init 0.3, horizon 512)",
    )
    cli = parser.parse_args(argv)
    cli.ppo_flags = []
    cli.new_tokens = None
    if cli.quick:
        cli.seeds = cli.seeds[:2]
        cli.steps = cli.steps or 3
        cli.eval_prompts, cli.eval_samples = cli.eval_prompts or 2, 2
        cli.ppo_flags = ["--embedded_warmup_steps", "20", "--ppo_config.batch_size", "4"]
        cli.ppo_flags += ["--ppo_config.mini_batch_size", "2", "--ppo_config.ppo_epochs", "1"]
    return cli


def main(argv: Sequence[str] | None = None) -> dict[str, dict]:
    cli = parse_args(argv)
    torch.set_num_threads(1)
    steps_given = cli.steps
    results = {}
    for task in ("credit", "sentiment") if cli.task == "all" else (cli.task,):
        cli.steps = steps_given or STEPS[task]
        cli.new_tokens = 16 if task == "credit" else None
        results[task] = (
            report(task, cli, json.loads(Path(cli.from_json).read_text())) if cli.from_json else run_task(task, cli)
        )
    return results


if __name__ == "__main__":
    main()
