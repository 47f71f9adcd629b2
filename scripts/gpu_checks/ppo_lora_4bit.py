"""PPO with a LoRA adapter on a 4-bit (bitsandbytes NF4) policy: two `train()` steps on the scaled-up tiny kit."""

from common import PROMPTS, finite, last_step, length_reward, need, need_cuda, scaled_model_dir

need_cuda()
need("bitsandbytes", "peft")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402

from trl_stable import PPOConfig, PPOTrainer  # noqa: E402

path = scaled_model_dir("llama")
args = PPOConfig(
    output_dir=path + "_out",
    batch_size=8,
    mini_batch_size=4,
    ppo_epochs=1,
    max_new_tokens=8,
    max_steps=2,
    load_in_4bit=True,
    bf16=True,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
)
peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
trainer = PPOTrainer(
    path,
    reward_funcs=length_reward,
    args=args,
    peft_config=peft_config,
    train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
)
import bitsandbytes as bnb  # noqa: E402

policy = trainer.unwrapped().policy
assert any(isinstance(m, bnb.nn.Linear4bit) for m in policy.modules()), "the policy has no 4-bit layers"
trainable = [n for n, p in trainer.unwrapped().named_parameters() if p.requires_grad]
assert trainable and all("lora_" in n or "value_head" in n for n in trainable), trainable[:5]
trainer.train()
finite(last_step(trainer), "loss/total", "objective/kl")
peak = torch.cuda.max_memory_allocated() >> 20
print(f"OK: 2 steps, {len(trainable)} trainable tensors (LoRA + value head), peak {peak} MiB")
