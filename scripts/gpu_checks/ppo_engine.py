"""PPO and GRPO, two `train()` steps each, under whatever engine `accelerate launch` set up (ZeRO-2, FSDP, DDP).

Run by `scripts/gpu_check.sh` as ``accelerate launch --config_file examples/accelerate_configs/<engine>.yaml
--num_processes 1 scripts/gpu_checks/ppo_engine.py``; checks the step statistics are finite and a checkpoint saves.
"""

from common import PROMPTS, finite, last_step, length_reward, need_cuda, scaled_model_dir

need_cuda()

from datasets import Dataset  # noqa: E402

from trl_stable import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer  # noqa: E402

path = scaled_model_dir("qwen2")
dataset = Dataset.from_dict({"prompt": PROMPTS})
common = dict(max_steps=2, bf16=True, report_to="none", disable_tqdm=True, save_strategy="no")
ppo = PPOTrainer(
    path,
    reward_funcs=length_reward,
    args=PPOConfig(
        output_dir=path + "_ppo", batch_size=8, mini_batch_size=4, ppo_epochs=1, max_new_tokens=8, **common
    ),
    train_dataset=dataset,
)
ppo.train()
finite(last_step(ppo), "loss/total", "objective/kl")
ppo.save_checkpoint()
grpo = GRPOTrainer(
    path,
    reward_funcs=length_reward,
    args=GRPOConfig(
        output_dir=path + "_grpo",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        logging_steps=1,
        **common,
    ),  # fmt: skip
    train_dataset=dataset,
)
grpo.train()
finite([h for h in grpo.state.log_history if "loss" in h][-1], "loss")
engine = ppo.accelerator.distributed_type
print(f"OK: PPO and GRPO, 2 steps each, under {engine}")
