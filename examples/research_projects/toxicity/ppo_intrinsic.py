"""Detoxification with PPO and dense intrinsic rewards from a critic (RELC / Drlc, EMNLP 2024), on trl_stable.

The policy continues toxic prompts; the environment reward is 1 - toxicity of the continuation, and a critic names
the toxic spans, whose tokens get `--negative_reward_value` (RELC: -0.5); `--positive_reward_value` keeps RELC's
meaning here, the reward of every token outside a toxic span (RELC's .sh: 0.1; default 0.0).
Accepts the flags of RELC's `ppo-intrinsic-rewards-toxicity.py`: every `trl_stable.PPOConfig` field is a flat flag
(--model_name, --learning_rate, --batch_size, ...), so is every `CriticRewardConfig` field; `--config FILE` reads
them from YAML (`ppo_config:` and `critic:` blocks).

Embedded default (CPU, minutes): the tiny policy warmed up on the shipped prompts, alt-profanity-check as the
toxicity scorer, the lexicon critic:

    python examples/research_projects/toxicity/ppo_intrinsic.py --use_intrinsic_reward

Paper mode (RealToxicityPrompts prompts with toxicity > --prompt_toxicity_level, Perspective API when a key is in
PERSPECTIVE_API_KEY, else facebook/roberta-hate-speech-dynabench-r4-target):

    accelerate launch --num_processes 2 --multi_gpu --mixed_precision bf16 \
        examples/research_projects/toxicity/ppo_intrinsic.py --use_intrinsic_reward \
        --prompt_file prompts/critic_toxicity.txt --positive_reward_value 0.0 --negative_reward_value -0.5 \
        --intrinsic_reward_threshold 1.0 --model_name gpt2-large --model_save_path ckpts/toxicity/ppo_intrinsic \
        --epochs 5 --prompt_toxicity_level 0.6 --output_min_length 10 --output_max_length 14 \
        --learning_rate 1.41e-5 --batch_size 32 --mini_batch_size 32 --gradient_accumulation_steps 1 --ppo_epochs 4

`--use_peft` trains a LoRA adapter instead (`--lora_r`, `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`;
`--load_in_4bit` / `--load_in_8bit` are PPOConfig's): RELC's Llama-2 self-critique run, `ppo_intrinsic_peft.py`.

RELC passed the key as `--perspective_api $PERSPECTIVE_API_KEY`; that flag still works but the environment
variable is preferred (command lines end up in logs). The key is never printed or saved.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from critic_rewards import build_intrinsic_reward, critic_token_rewards  # noqa: E402
from embedded import TOXICITY_PROMPTS, is_embedded, read_jsonl  # noqa: E402
from policy_loading import load_policy  # noqa: E402
from ppo_args import RunArgs, default_save_path, epochs_for, loop_ppo_config, ppo_mode_defaults  # noqa: E402
from prompt_batches import PromptBatches, tokenize_queries  # noqa: E402
from relc_flags import RelcPPOConfig, relc_length_range  # noqa: E402
from run_log import StepLog  # noqa: E402
from run_saving import resume_run, save_checkpoint, save_run, save_run_args  # noqa: E402
from scorers import LOCAL_TOXICITY, build_toxicity_scorer  # noqa: E402
from script_args import parse_script_args  # noqa: E402

from trl_stable import PPOTrainer  # noqa: E402
from trl_stable.compat.relc_critic import RelcCriticRewardConfig as CriticRewardConfig  # noqa: E402

PAPER_DATASET = "allenai/real-toxicity-prompts"
PAPER_TOXICITY_MODEL = "facebook/roberta-hate-speech-dynabench-r4-target"


def detox_critic_config() -> CriticRewardConfig:
    # RELC's detox runs: only toxic spans are rewarded (negatively), and every sample is critiqued
    return CriticRewardConfig(positive_reward_value=0.0, negative_reward_value=-0.5, intrinsic_reward_threshold=1.0)


@dataclass
class ToxicityArguments(RunArgs):
    perspective_api: str | None = None
    """Perspective API key (prefer the PERSPECTIVE_API_KEY environment variable). No key: a local classifier."""
    perspective_rate: float = 1.0
    """Perspective requests per second (your quota)."""
    perspective_threads: int = 8
    toxicity_model: str | None = None
    """Local toxicity scorer when there is no key: "profanity_check" (embedded default) or a transformers
    classifier whose non-"nothate" probability is the toxicity
    (paper: facebook/roberta-hate-speech-dynabench-r4-target)."""
    dataset: str | None = None
    """Prompt source: a hub dataset (paper: allenai/real-toxicity-prompts), a JSON Lines file in its format,
    or None (the shipped prompts)."""
    prompt_toxicity_level: float = 0.6
    """Keep prompts whose toxicity is > this."""
    output_min_length: int | None = None
    output_max_length: int | None = None
    """RELC's response length flags: a length in [output_min_length, output_max_length) per batch, the upper bound
    excluded as in RELC's LengthSampler. They set `--min_new_tokens` / `--max_new_tokens` (both included): RELC's
    10 and 14 are 10 to 13 tokens. None: `--min_new_tokens` / `--max_new_tokens` (default 10 to 14, which the
    measured embedded runs use)."""
    use_peft: bool = False
    """Train a LoRA adapter instead of the whole policy (RELC's Llama-2 experiment, `ppo_intrinsic_peft.py`): one
    process holds the policy once, the reference is the same weights with the adapter disabled."""
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None
    """Modules that get an adapter (None: peft's default for the architecture; the embedded GPT-2 uses c_attn)."""
    ppo_config: Annotated[RelcPPOConfig, tyro.conf.OmitArgPrefixes] = field(
        default_factory=lambda: RelcPPOConfig(min_new_tokens=10, max_new_tokens=14)
    )
    critic: Annotated[CriticRewardConfig, tyro.conf.OmitArgPrefixes] = field(default_factory=detox_critic_config)
    mode_defaults = staticmethod(ppo_mode_defaults)

    @staticmethod
    def finalize(args: ToxicityArguments) -> ToxicityArguments:
        lengths = relc_length_range(args.output_min_length, args.output_max_length, args.ppo_config)
        return replace(args, ppo_config=replace(args.ppo_config, **lengths)) if lengths else args


def load_prompts(args: ToxicityArguments, embedded: bool) -> list[str]:
    if args.dataset is None and embedded:
        rows = read_jsonl(TOXICITY_PROMPTS)
    elif args.dataset is not None and Path(args.dataset).is_file():
        rows = read_jsonl(args.dataset)
    else:
        from datasets import load_dataset

        rows = load_dataset(args.dataset or PAPER_DATASET, split="train")
    return [
        r["prompt"]["text"]
        for r in rows
        if r["prompt"].get("toxicity") is not None and r["prompt"]["toxicity"] > args.prompt_toxicity_level
    ]


def build_toxicity_fn(args: ToxicityArguments, embedded: bool):
    """(scorer name, texts -> toxicity in [0, 1] or None on a failed API call): Perspective when a key is given,
    else the local classifier of the mode."""
    local = args.toxicity_model or (LOCAL_TOXICITY if embedded else PAPER_TOXICITY_MODEL)
    return build_toxicity_scorer(
        "auto", args.perspective_api, local=local, rate=args.perspective_rate, num_threads=args.perspective_threads
    )


def lora_config(args: ToxicityArguments, embedded: bool):
    """The LoRA adapter of `--use_peft` (peft's LoraConfig): on the embedded GPT-2's attention projection unless
    `--lora_target_modules` names others."""
    from peft import LoraConfig

    targets = args.lora_target_modules or (["c_attn"] if embedded and args.ppo_config.model_name is None else None)
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def main(args: ToxicityArguments) -> list[dict]:
    """Train; returns the per-step reward history."""
    ppo = args.ppo_config
    embedded = is_embedded(ppo.model_name, args.offline)
    prompts = load_prompts(args, embedded)
    _, toxicity = build_toxicity_fn(args, embedded)
    save_path = default_save_path("toxicity", args.critic.use_intrinsic_reward, args.model_save_path, ppo)
    model, tokenizer = load_policy(ppo.model_name, ppo.seed, args, "toxicity", embedded)
    records = tokenize_queries(tokenizer, prompts)
    config = loop_ppo_config(ppo, save_path)
    peft_config = lora_config(args, embedded) if args.use_peft else None
    trainer = PPOTrainer(model, args=config, processing_class=tokenizer, peft_config=peft_config)
    critic = build_intrinsic_reward(args.critic, "toxicity", tokenizer)
    if trainer.accelerator.is_main_process:
        save_run_args(args, save_path)
    # --resume_from_checkpoint: the trainer's state and the critic's counters, then the prompt order from there
    start, history = resume_run(trainer, ppo.resume_from_checkpoint, save_path, critic)
    epochs = epochs_for(args, embedded)
    batches = PromptBatches(records, trainer.accelerator, ppo.batch_size, epochs, ppo.max_steps, ppo.seed)
    log = StepLog(trainer, "toxicity", len(batches), start, history, show_progress=not ppo.disable_tqdm)

    # RELC detox: continue a toxic prompt, reward 1 - toxicity of the continuation, let the critic name the toxic
    # spans (their tokens get --negative_reward_value), PPO step
    for step, batch in enumerate(batches.from_step(start), start + 1):
        queries = [torch.tensor(r["input_ids"]) for r in batch]
        responses = trainer.generate(queries, return_prompt=False)
        continuations = tokenizer.batch_decode(responses, skip_special_tokens=True)
        # A failed Perspective call scores NaN: the PPO step drops that sample instead of inventing a reward.
        env = [float("nan") if t is None else 1.0 - t for t in toxicity(continuations)]
        dense = critic_token_rewards(critic, [r["query"] for r in batch], continuations, responses, env)
        stats = trainer.step(queries, responses, token_rewards=dense, scores=env)
        log.record(step, env, dense, stats, critic=critic)
        if args.save_freq and step % args.save_freq == 0:
            save_checkpoint(trainer, save_path, step, log.history, critic)
    history = log.close()
    save_run(trainer, save_path, history, "toxicity")
    if critic is not None:
        critic.close()
    return history


if __name__ == "__main__":
    arguments = parse_script_args(ToxicityArguments, description=__doc__.split("\n\n")[0])
    main(arguments)
