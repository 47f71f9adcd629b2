"""PPO's fused-head log-probs in bf16 autocast against fp32, on the same model and batch (`--cpu` runs it on CPU).

The rollout pass (`PPOTrainer.rollout_pass`) of a bf16 trainer and of an fp32 trainer over one batch: the log-probs
must stay fp32 tensors and agree within bf16 rounding (mean |diff| < 0.02 nat, max < 0.25 nat).
"""

import sys

from common import need_cuda, scaled_model_dir

cpu = "--cpu" in sys.argv
if not cpu:
    need_cuda()

import torch  # noqa: E402

from trl_stable import PPOConfig, PPOTrainer  # noqa: E402
from trl_stable.testing import build_tokenizer  # noqa: E402

path = scaled_model_dir("qwen2", **({"hidden_size": 64, "intermediate_size": 128} if cpu else {}))
tokenizer = build_tokenizer()
gen = torch.Generator().manual_seed(0)
queries = [torch.randint(10, len(tokenizer), (n,), generator=gen) for n in (5, 3, 7, 4)]
responses = [torch.randint(10, len(tokenizer), (n,), generator=gen) for n in (12, 16, 9, 16)]


def logprobs(bf16: bool) -> torch.Tensor:
    args = PPOConfig(
        output_dir=path + "_out", batch_size=4, mini_batch_size=4, bf16=bf16, use_cpu=cpu, report_to="none",
        disable_tqdm=True, save_strategy="no", fused_lm_head=True,  # the path under test, also on CPU
    )  # fmt: skip
    trainer = PPOTrainer(path, args=args, processing_class=tokenizer)
    assert trainer.fused_policy, "PPO did not install the fused log-prob head"
    batch, _ = trainer.rollout_pass(trainer.make_batch(queries, responses))
    assert batch["old_logprobs"].dtype == torch.float32, batch["old_logprobs"].dtype
    return batch["old_logprobs"] * batch["response_mask"], batch["response_mask"]


fp32, mask = logprobs(False)
bf16, _ = logprobs(True)
diff = (fp32 - bf16).abs()[mask.bool()]
mean, top = diff.mean().item(), diff.max().item()
assert torch.isfinite(bf16).all(), "non-finite bf16 log-probs"
assert mean < 0.02 and top < 0.25, f"bf16 vs fp32 log-probs: mean |diff| {mean:.4f}, max {top:.4f}"
print(f"OK: bf16 vs fp32 fused log-probs, mean |diff| {mean:.4f} nat, max {top:.4f} nat over {diff.numel()} tokens")
