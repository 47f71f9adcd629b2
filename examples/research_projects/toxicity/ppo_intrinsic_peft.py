"""Detoxification with PPO + intrinsic rewards, training a LoRA adapter (RELC's Llama-2 self-critique experiment).

One process holds the policy once: the reference model is the same weights with the adapter disabled, so a 7B chat
model fits on one GPU (add `--load_in_4bit` to load it in 4 bits with bitsandbytes). This command runs
`ppo_intrinsic.py --use_peft` with the flags given: every flag of `ppo_intrinsic.py` applies, with the LoRA flags
`--lora_r 16`, `--lora_alpha 32`, `--lora_dropout 0.05`, `--lora_target_modules`.

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

import os
import sys
from collections.abc import Sequence
from pathlib import Path

TOXICITY_SCRIPT = Path(__file__).resolve().parent / "ppo_intrinsic.py"


def command(argv: Sequence[str]) -> list[str]:
    """The toxicity script's command line with a LoRA adapter: this process becomes it (the same Python and
    environment; under `accelerate launch` each process keeps its rank)."""
    return [sys.executable, str(TOXICITY_SCRIPT), "--use_peft", *argv]


if __name__ == "__main__":
    os.execv(sys.executable, command(sys.argv[1:]))
