"""GRPO (trl_stable's, TRL's vLLM path) with `use_vllm=True, vllm_mode="colocate"`: two steps, sampler log-probs
recorded, decoupled loss on."""

from common import PROMPTS, finite, length_reward, need, need_cuda, scaled_model_dir

need_cuda()
need("vllm")

from datasets import Dataset  # noqa: E402

from trl_stable import GRPOConfig, GRPOTrainer  # noqa: E402

path = scaled_model_dir("qwen2")
args = GRPOConfig(
    output_dir=path + "_out",
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    max_steps=2,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.2,
    use_decoupled_loss=True,
    bf16=True,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1,
)
trainer = GRPOTrainer(
    path, reward_funcs=length_reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS})
)
trainer.train()
logs = [h for h in trainer.state.log_history if "loss" in h][-1]
finite(logs, "loss")
print(f"OK: 2 GRPO steps through vLLM colocate, loss {logs['loss']:.4f}")
