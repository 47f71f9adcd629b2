"""Supervised warm start of the summarization policy (RELC starts PPO from an SFT gpt2-medium checkpoint).

Trains on (prompt, summary) pairs with TRL's SFTTrainer, loss on the summary tokens only, and saves a
`from_pretrained`-loadable model + tokenizer that `ppo_rouge.py --model_name` takes. The training itself is
`summarization_sft.train_sft`, which `ppo_rouge.py` also runs before PPO in embedded mode.

Embedded default (CPU, under a minute): the tiny policy on the 18 shipped training articles:

    python examples/research_projects/summarization/sft_warmstart.py --output_dir outputs/summarization/sft

Paper mode (TL;DR data of Stiennon et al. as packaged by CarperAI):

    accelerate launch --num_processes 2 --multi_gpu --mixed_precision bf16 \
        examples/research_projects/summarization/sft_warmstart.py --model_name gpt2-medium \
        --dataset CarperAI/openai_summarize_tldr --output_dir ckpts/summarization/sft_gpt2-medium \
        --max_steps 1000 --learning_rate 5e-5 --batch_size 16
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from script_args import parse_script_args  # noqa: E402
from summarization_sft import SFTArguments, train_sft  # noqa: E402

if __name__ == "__main__":
    train_sft(parse_script_args(SFTArguments, description=__doc__.split("\n\n")[0]))
