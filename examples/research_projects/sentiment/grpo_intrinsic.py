"""Sentiment control with the stable GRPO family (and PPO), one YAML file per algorithm, as AReaL switches them.

    python examples/research_projects/sentiment/grpo_intrinsic.py --config gdpo.yaml
    python examples/research_projects/sentiment/grpo_intrinsic.py --config .../configs/icepop.yaml --max_steps 40 \
        --grpo.learning_rate 1e-4 --use_intrinsic_reward

Each YAML names its `algorithm` and holds `grpo:` fields (any `trl_stable.GRPOConfig` field) and script fields
(top level). Command-line flags override both: script flags as usual (`--max_steps 40`), GRPOConfig fields as
`--grpo.<field> <value>` (the value is read as YAML: `--grpo.epsilon_high 0.28`, `--grpo.use_decoupled_loss true`).
`configs/ppo.yaml` (`algorithm: ppo`) runs `ppo_intrinsic.py` with its fields instead.

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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

import tyro
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from research_common import (  # noqa: E402
    IntrinsicArgs,
    PPOArgs,
    build_intrinsic_reward,
    is_embedded,
    load_script_module,
    parse_script_args,
    plot_reward_curve,
    save_run_args,
    truncate_queries,
    use_one_thread,
    write_history,
)
from scorers import VADER, build_sentiment_logit, continuation_logprobs, vader_compound  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_ppo_script = load_script_module(Path(__file__).resolve().parent / "ppo_intrinsic.py", "sentiment_ppo_intrinsic")
ALGORITHMS = ("grpo", "dr_grpo", "liteppo", "rloo", "gspo", "dapo", "sapo", "icepop", "kpop", "gdpo", "ngrpo", "ppo")
# GRPOConfig values of the embedded run (tiny model, CPU); any YAML or --grpo.* value replaces them.
EMBEDDED_GRPO = {
    "learning_rate": 3e-4,
    "per_device_train_batch_size": 16,
    "num_generations": 4,
    "max_completion_length": 16,
    "temperature": 1.0,
    "beta": 0.0,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "disable_tqdm": False,
}


@dataclass
class GRPOScriptArguments(IntrinsicArgs):
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
    max_steps: int = 60
    output_dir: str | None = None
    """Default outputs/sentiment/<algorithm>."""
    seed: int = 0
    grpo: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
    """GRPOConfig fields (from the YAML's `grpo:` block and --grpo.<field> flags)."""


def split_config_argv(argv: Sequence[str]) -> tuple[str | None, dict[str, Any], list[str]]:
    """Take `--config FILE` and every `--grpo.<field> VALUE` out of argv; returns (file, grpo overrides, rest)."""
    config, grpo, rest = None, {}, []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, inline = arg.partition("=")
        if key == "--config":
            config = inline if eq else args[i + 1]
            i += 1 if eq else 2
        elif key.startswith("--grpo."):
            if not eq and i + 1 >= len(args):
                raise ValueError(f"{key} needs a value.")
            grpo[key[len("--grpo.") :]] = yaml.safe_load(inline if eq else args[i + 1])
            i += 1 if eq else 2
        else:
            rest.append(arg)
            i += 1
    return config, grpo, rest


def load_yaml(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    candidate = Path(path)
    if not candidate.is_file() and (CONFIG_DIR / path).is_file():
        candidate = CONFIG_DIR / path
    if not candidate.is_file():
        raise ValueError(f"--config {path!r} does not exist; choose one of {CONFIG_DIR}/*.yaml.")
    with open(candidate, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if data.get("algorithm", "grpo") not in ALGORITHMS:
        raise ValueError(f"{candidate}: algorithm must be one of {', '.join(ALGORITHMS)}.")
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
    score = vader_compound if name == VADER else build_sentiment_logit(name)

    def sentiment(prompts, completions, **kwargs) -> list[float]:
        return score(list(completions))

    return sentiment


def run_grpo(args: GRPOScriptArguments) -> list[dict]:
    """Train with trl_stable.GRPOTrainer; returns the per-step history (reward, per-function means)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_stable import GRPOConfig, GRPOTrainer

    embedded = is_embedded(args, args)
    output_dir = args.output_dir or str(Path("outputs") / "sentiment" / args.algorithm)
    if embedded:
        use_one_thread()
    if args.model_name is None:
        from embedded import embedded_policy

        model, tokenizer = embedded_policy("sentiment", seed=args.seed)
        reference, _ = embedded_policy("sentiment", seed=args.seed)  # a second copy: frozen, for the fluency reward
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        tokenizer.padding_side = "left"
        model = args.model_name
        reference = AutoModelForCausalLM.from_pretrained(args.model_name)
    texts = _ppo_script.load_review_texts(args.query_dataset, embedded)
    prompts = [
        q["query"] for q in truncate_queries(tokenizer, texts, args.min_query_tokens, args.max_query_tokens, args.seed)
    ]
    funcs, weights = (
        [sentiment_reward(args.reward_model or (VADER if embedded else "lvwerra/distilbert-imdb"))],
        [args.sentiment_weight],
    )
    if args.fluency_weight:
        funcs.append(fluency_reward(reference, tokenizer))
        weights.append(args.fluency_weight)
    intrinsic = build_intrinsic_reward(args, "sentiment", tokenizer, embedded)
    if intrinsic is not None:
        funcs.append(intrinsic)
        weights.append(args.intrinsic_weight)
    grpo_kwargs = {**(EMBEDDED_GRPO if embedded else {"logging_steps": 1}), **args.grpo}
    grpo_kwargs.update(output_dir=output_dir, max_steps=args.max_steps, seed=args.seed, reward_weights=weights)
    config = GRPOConfig(**grpo_kwargs)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    reference.to(trainer.accelerator.device)  # the fluency scorer runs next to the policy (it is loaded on the CPU)
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


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, grpo_overrides, rest = split_config_argv(argv)
    data = load_yaml(config_path)
    if data.get("algorithm") == "ppo":
        return _run_ppo(data, rest)
    grpo = {**(data.pop("grpo", None) or {}), **grpo_overrides}
    known = {f.name for f in fields(GRPOScriptArguments)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{config_path}: unknown fields {sorted(unknown)}; GRPOConfig fields go under `grpo:`.")
    defaults = GRPOScriptArguments(**data, grpo=grpo)
    args = parse_script_args(GRPOScriptArguments, rest, default=defaults)
    return run_grpo(args)


def _run_ppo(data: dict[str, Any], rest: list[str]) -> list[dict]:
    data = {k: v for k, v in data.items() if k != "algorithm"}
    # one output flag for the whole family: --output_dir is the PPO script's --model_save_path
    rest = [
        "--model_save_path" if a == "--output_dir" else a.replace("--output_dir=", "--model_save_path=") for a in rest
    ]
    ppo_config = PPOArgs(**(data.pop("ppo_config", None) or {}))
    defaults = _ppo_script.ScriptArguments(**data, ppo_config=ppo_config)
    return _ppo_script.main(parse_script_args(_ppo_script.ScriptArguments, rest, default=defaults))


if __name__ == "__main__":
    history = main()
    if history:
        print(json.dumps(history[-1]))
