"""Detoxification with PPO + intrinsic rewards, training a LoRA adapter (RELC's Llama-2 self-critique experiment).

One process holds the policy once: the reference model is the same weights with the adapter disabled, so a 7B chat
model fits on one GPU (add `--load_in_4bit` to load it in 4 bits with bitsandbytes). Every flag of
`ppo_intrinsic.py` applies, plus the LoRA flags below.

Embedded default (CPU): the tiny policy with a LoRA adapter on its attention projection:

    python examples/research_projects/toxicity/ppo_intrinsic_peft.py --use_intrinsic_reward

Paper mode (RELC: threshold 0.9, batch 16, mini-batch 8, gradient accumulation 2, 3 epochs):

    accelerate launch --num_processes 1 --mixed_precision bf16 \
        examples/research_projects/toxicity/ppo_intrinsic_peft.py \
        --use_intrinsic_reward --prompt_file prompts/critic_toxicity.txt --positive_reward_value 0.0 \
        --negative_reward_value -0.5 --intrinsic_reward_threshold 0.9 --model_name meta-llama/Llama-2-7b-chat-hf \
        --model_save_path ckpts/toxicity/ppo_intrinsic_llama2 --epochs 3 --prompt_toxicity_level 0.6 \
        --output_min_length 10 --output_max_length 14 --learning_rate 1.41e-5 --batch_size 16 --mini_batch_size 8 \
        --gradient_accumulation_steps 2 --ppo_epochs 4

`--critic_backend transformers` with no `--critic_model` is not self-critique here (the critic must be a separate
local model path); point `--critic_base_url` at a vLLM server serving the same chat model for RELC's self-critique.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from research_common import is_embedded, load_script_module, parse_script_args  # noqa: E402

_toxicity = load_script_module(Path(__file__).resolve().parent / "ppo_intrinsic.py", "toxicity_ppo_intrinsic")
ToxicityArguments, main = _toxicity.ToxicityArguments, _toxicity.main


@dataclass
class PeftToxicityArguments(ToxicityArguments):
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = field(default=None)
    """Modules that get an adapter (None: peft's default for the architecture; the embedded GPT-2 uses c_attn)."""


def lora_config(args: PeftToxicityArguments, embedded: bool):
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


def run(args: PeftToxicityArguments) -> list[dict]:
    """Train the adapter with the toxicity script's loop; `--load_in_4bit` / `--load_in_8bit` are PPOConfig's."""
    embedded = is_embedded(args.ppo_config.model_name, args.offline)
    return main(args, peft_config=lora_config(args, embedded))


if __name__ == "__main__":
    arguments = parse_script_args(PeftToxicityArguments, description=__doc__.split("\n\n")[0])
    run(arguments)
