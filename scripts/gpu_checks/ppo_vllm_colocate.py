"""PPO rollouts through vLLM colocate (`PPOConfig(use_vllm=True, vllm_mode="colocate")`): two `train()` steps with the
decoupled loss fed by vLLM's sampler log-probs, and the mismatch monitor's statistics logged."""

from common import PROMPTS, finite, last_step, length_reward, need, need_cuda, scaled_model_dir

need_cuda()
need("vllm")

from datasets import Dataset  # noqa: E402

from trl_stable import PPOConfig, PPOTrainer  # noqa: E402

if "use_vllm" not in PPOConfig.__dataclass_fields__:
    raise SystemExit("PPOConfig has no use_vllm field: PPO vLLM rollouts are missing from this build")
path = scaled_model_dir("qwen2")
args = PPOConfig(
    output_dir=path + "_out",
    batch_size=8,
    mini_batch_size=4,
    ppo_epochs=1,
    max_new_tokens=8,
    max_steps=2,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.2,
    use_decoupled_loss=True,
    bf16=True,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
)
trainer = PPOTrainer(path, reward_funcs=length_reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
trainer.train()
logs = last_step(trainer)
finite(logs, "loss/total", "objective/kl")
mismatch = [k for k in logs if k.startswith("mismatch/")]
assert mismatch, f"no mismatch statistics logged: {sorted(logs)[:20]}"
print(f"OK: 2 PPO steps with vLLM colocate rollouts, {len(mismatch)} mismatch metrics, loss {logs['loss/total']:.4f}")
