"""Sentiment control with the stable GRPO family (and PPO), one YAML file per algorithm, as AReaL switches them.

    python examples/research_projects/sentiment/grpo_intrinsic.py --config gdpo.yaml
    python examples/research_projects/sentiment/grpo_intrinsic.py --config .../configs/icepop.yaml --max_steps 40 \
        --grpo.learning_rate 1e-4 --use_intrinsic_reward

Each YAML names its `algorithm` and holds `grpo:` fields (any `trl_stable.GRPOConfig` field), `critic:` fields (any
`CriticRewardConfig` field) and script fields (top level). Command-line flags override them: script and critic
flags as usual (`--max_steps 40`, `--use_intrinsic_reward`), GRPOConfig fields as `--grpo.<field> <value>`
(`--grpo.epsilon_high 0.28`; booleans are flags: `--grpo.use_decoupled_loss`); file and flag values both take the
field's type.
`configs/ppo.yaml` (`algorithm: ppo`) runs `ppo_intrinsic.py --config configs/ppo.yaml` with the other flags instead.

Rewards: sentiment (VADER compound of the completion, or a hub classifier's positive logit), fluency (exp of the mean
token log-prob of the completion under the frozen initial policy, in (0, 1]), and, with `--use_intrinsic_reward`,
the critic's dense per-token rewards (GRPO's dense-advantage path: sequence advantage + reward-to-go). GDPO
normalises sentiment and fluency separately before summing them.

Writes to `--output_dir`: the model, `reward_history.jsonl`, `reward_curve.png`, `run_args.json`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from critic_rewards import build_intrinsic_reward  # noqa: E402
from embedded import embedded_policy, is_embedded  # noqa: E402
from policy_loading import load_policy  # noqa: E402
from prompt_batches import truncate_queries  # noqa: E402
from reward_curve import plot_reward_curve  # noqa: E402
from run_saving import save_run_args, write_history  # noqa: E402
from scorers import continuation_logprobs  # noqa: E402
from script_args import parse_script_args, pop_config_flag, read_config  # noqa: E402
from sentiment_task import load_review_texts, sentiment_model, sentiment_scorer  # noqa: E402

from trl_stable import GRPOConfig  # noqa: E402
from trl_stable.compat.relc_critic import RelcCriticRewardConfig as CriticRewardConfig  # noqa: E402
from trl_stable.settings.secrets import redact_argv  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
PPO_SCRIPT = Path(__file__).resolve().parent / "ppo_intrinsic.py"
ALGORITHMS = ("grpo", "dr_grpo", "liteppo", "rloo", "gspo", "dapo", "sapo", "icepop", "kpop", "gdpo", "ngrpo", "ppo")
# GRPOConfig values of the embedded run (tiny model, CPU); in paper mode these fields keep GRPOConfig's defaults.
EMBEDDED_GRPO = {
    "learning_rate": 3e-4,
    "per_device_train_batch_size": 16,
    "num_generations": 4,
    "max_completion_length": 16,
    "temperature": 1.0,
    "beta": 0.0,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "disable_tqdm": False,
}


def _flat(name: str):
    return tyro.conf.arg(aliases=(f"--{name}",))


@dataclass
class SentimentGRPOConfig(GRPOConfig):
    """`trl_stable.GRPOConfig` (`--grpo.<field>`); the run flags shared with the PPO script also take their flat
    flag."""

    max_steps: Annotated[int, _flat("max_steps")] = 60
    seed: Annotated[int, _flat("seed")] = 0
    output_dir: Annotated[str | None, _flat("output_dir")] = None
    """Default outputs/sentiment/<algorithm>."""

    def __post_init__(self):
        # GRPOConfig derives one of these from the other and then refuses to be given both, which a config built
        # from another's values (tyro's defaults, dataclasses.replace) would do: derive them again from the batch
        # settings here (this script does not set them).
        self.generation_batch_size = self.steps_per_generation = None
        super().__post_init__()


def grpo_mode_defaults(args: GRPOScriptArguments | None) -> dict:
    """Embedded mode: the class defaults. Paper mode: GRPOConfig's own values for `EMBEDDED_GRPO`'s fields, and the
    OpenAI-compatible critic. Both: the output directory of the algorithm."""
    if args is None:
        return {}
    output = {"output_dir": str(Path("outputs") / "sentiment" / args.algorithm)}
    if is_embedded(args.model_name, args.offline):
        return {"grpo": output}
    paper = {f.name: f.default for f in fields(GRPOConfig) if f.name in EMBEDDED_GRPO}
    return {"grpo": {**paper, **output}, "critic": {"critic_backend": "openai"}}


@dataclass
class GRPOScriptArguments:
    algorithm: str = "grpo"
    """Which member of the family the YAML configures (informational for GRPO presets; "ppo" switches trainer)."""
    model_name: str | None = None
    """Policy (hub id or path). None: the embedded tiny policy."""
    offline: bool = False
    query_dataset: str | None = None
    """"imdb" (hub), a JSON Lines file with "text", or None (paper: imdb; embedded: the shipped reviews)."""
    min_query_tokens: int = 4
    max_query_tokens: int = 10
    reward_model: str | None = None
    """"vader" or a sentiment classifier (its positive logit). None: vader embedded, lvwerra/distilbert-imdb paper."""
    fluency_weight: float = 0.5
    """Weight of the fluency reward (0 drops it)."""
    sentiment_weight: float = 1.0
    intrinsic_weight: float = 1.0
    """Weight of the dense critic reward (with --use_intrinsic_reward)."""
    grpo: SentimentGRPOConfig = field(default_factory=lambda: SentimentGRPOConfig(logging_steps=1, **EMBEDDED_GRPO))
    critic: Annotated[CriticRewardConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=CriticRewardConfig)
    mode_defaults = staticmethod(grpo_mode_defaults)


def config_path(name: str) -> str:
    """A config file by path, or by name in `configs/` (`--config gdpo.yaml`)."""
    if not Path(name).is_file() and (CONFIG_DIR / name).is_file():
        return str(CONFIG_DIR / name)
    if not Path(name).is_file():
        raise ValueError(f"--config {name!r} does not exist; choose one of {CONFIG_DIR}/*.yaml.")
    return name


def load_yaml(name: str | None) -> dict[str, Any]:
    data = read_config(config_path(name)) if name else {}
    if data.get("algorithm", "grpo") not in ALGORITHMS:
        raise ValueError(f"{name}: algorithm must be one of {', '.join(ALGORITHMS)}.")
    return data


def fluency_reward(model, tokenizer):
    """exp(mean log p(completion token | prompt, previous tokens)) under a frozen LM, in (0, 1] (0 when empty):
    1 / the conditional perplexity of the evaluation scripts."""
    model = model.eval().requires_grad_(False)

    def fluency(prompts, completions, **kwargs) -> list[float]:
        out = []
        for prompt, completion in zip(prompts, completions):
            logp = continuation_logprobs(model, tokenizer, prompt, completion)
            out.append(float(logp.mean().exp()) if len(logp) else 0.0)
        return out

    return fluency


def sentiment_reward(name: str):
    score = sentiment_scorer(name)

    def sentiment(prompts, completions, **kwargs) -> list[float]:
        return score(list(completions))

    return sentiment


def run_grpo(args: GRPOScriptArguments) -> list[dict]:
    """Train with trl_stable.GRPOTrainer; returns the per-step history (reward, per-function means)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trl_stable import GRPOTrainer

    embedded = is_embedded(args.model_name, args.offline)
    seed = args.grpo.seed
    model, tokenizer = load_policy(args.model_name, seed, None, "sentiment", embedded)
    if args.model_name is None:  # a second copy: frozen, for the fluency reward
        reference, _ = embedded_policy("sentiment", seed=seed)
    else:
        reference = AutoModelForCausalLM.from_pretrained(args.model_name)
    texts = load_review_texts(args.query_dataset, embedded)
    queries = truncate_queries(tokenizer, texts, args.min_query_tokens, args.max_query_tokens, seed)
    prompts = [q["query"] for q in queries]
    funcs = [sentiment_reward(sentiment_model(args.reward_model, embedded))]
    weights = [args.sentiment_weight]
    if args.fluency_weight:
        funcs.append(fluency_reward(reference, tokenizer))
        weights.append(args.fluency_weight)
    intrinsic = build_intrinsic_reward(args.critic, "sentiment", tokenizer)
    if intrinsic is not None:
        funcs.append(intrinsic)
        weights.append(args.intrinsic_weight)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=replace(args.grpo, reward_weights=weights),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    reference.to(trainer.accelerator.device)  # the fluency scorer runs next to the policy (it is loaded on the CPU)
    output_dir = args.grpo.output_dir
    if trainer.accelerator.is_main_process:
        save_run_args(args, output_dir)
    trainer.train()
    trainer.save_model(output_dir)
    history = [
        {"step": h["step"], "env_reward": h["rewards/sentiment/mean"], "reward": h["reward"],
         **{k: v for k, v in h.items() if k.startswith("rewards/")}}
        for h in trainer.state.log_history
        if "reward" in h and "rewards/sentiment/mean" in h
    ]  # fmt: skip
    if trainer.accelerator.is_main_process:
        write_history(history, output_dir)
        plot_reward_curve({args.algorithm: history}, os.path.join(output_dir, "reward_curve.png"))
    return history


def ppo_command(config: str, argv: Sequence[str]) -> list[str]:
    """`ppo_intrinsic.py --config <the PPO config file> <flags>`: one output flag for the whole family, so
    `--output_dir` is the PPO script's `--model_save_path`."""
    flags = [a.replace("--output_dir", "--model_save_path", 1) if a.startswith("--output_dir") else a for a in argv]
    return [sys.executable, str(PPO_SCRIPT), "--config", config_path(config), *flags]


def main(argv: Sequence[str] | None = None) -> list[dict]:
    config, rest = pop_config_flag(list(sys.argv[1:] if argv is None else argv))
    values = load_yaml(config)
    if values.get("algorithm") == "ppo":
        # PPO with a value model is the PPO script's run: this process becomes it, with the same flags
        os.execv(sys.executable, ppo_command(config, rest))
    description = __doc__.split("\n\n")[0]
    args = parse_script_args(GRPOScriptArguments, rest, description, file_values=values)
    if argv is None:  # parsed: trackers (wandb) record sys.argv with the run, so its secrets go now
        redact_argv(sys.argv)
    return run_grpo(args)


if __name__ == "__main__":
    history = main()
    if history:
        print(json.dumps(history[-1]))
