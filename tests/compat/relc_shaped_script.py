"""A RELC-shaped PPO script on `trl_stable.compat.relc`, offline on the tiny kit.

Written from the structure of RELC's public scripts (dataset -> collator -> config -> value-head model -> reference
model -> PPOTrainer(config, model, ref, tokenizer, dataset=, data_collator=) -> loop over `ppo_trainer.dataloader`:
generate with a LengthSampler, reward, critic spans via `query_batch_span`, per-token rewards of len(q) + len(r) - 1,
step, log_stats; then ``if accelerator.is_main_process: save_pretrained``). The critic is the loopback server whose
URL is in OPENAI_BASE_URL. Writes `result_<rank>.json` into the output directory given as argv[1].
"""

import argparse
import json
import os
import sys

import torch
from datasets import Dataset

from trl_stable.compat.relc import (
    AutoModelForCausalLMWithValueHead,
    LengthSampler,
    PPOConfig,
    PPOTrainer,
    create_reference_model,
    query_batch_span,
    set_seed,
)
from trl_stable.testing import build_causal_lm, build_tokenizer

torch.set_num_threads(1)
PROMPT = "Find the negative words in: {}"
POSITIVE = {"good", "great", "love", "nice"}


def build_dataset(tokenizer, input_size):
    texts = ["The movie was good", "A story about love", "I think the plot", "We saw a great film"] * 4
    ds = Dataset.from_dict({"review": texts, "label": [1, 0, 1, 0] * 4})

    def tokenize(sample):
        sample["input_ids"] = tokenizer.encode(sample["review"])[: input_size()]
        sample["query"] = tokenizer.decode(sample["input_ids"])
        return sample

    ds = ds.map(tokenize, batched=False)
    ds.set_format(type="torch")
    return ds


def collator(data):
    return {key: [d[key] for d in data] for key in data[0]}


def lexicon_reward(text):
    words = text.lower().split()
    return torch.tensor(sum(w in POSITIVE for w in words) + 0.1 * len(words))


def intrinsic_rewards(spans, token_lists, negative_value):
    out = []
    for span, tokens in zip(spans, token_lists):
        if span is None or "None identified" in span:
            out.append([0.0] * len(tokens))
        else:
            out.append([negative_value if t.strip() and t.strip() in span else 0.0 for t in tokens])
    return out


def main(args):
    config = PPOConfig(
        model_name="tiny-qwen2",
        query_dataset="inline",
        reward_model="lexicon",
        learning_rate=1e-3,
        batch_size=4,
        mini_batch_size=2,
        ppo_epochs=2,
        seed=0,
        tracker_project_name="relc-compat-test",
        tracker_kwargs={},
        max_grad_norm=1.0,
        ratio_threshold=10.0,
        steps=8,
    )
    tokenizer = build_tokenizer()
    dataset = build_dataset(tokenizer, LengthSampler(2, 5))
    set_seed(config.seed)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(build_causal_lm("qwen2", tokenizer, seed=0))
    ref_model = create_reference_model(model, num_shared_layers=1)
    optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=config.learning_rate)
    ppo_trainer = PPOTrainer(
        config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator, optimizer=optimizer
    )
    generation_kwargs = {
        "min_length": -1,
        "top_k": 0.0,
        "top_p": 1.0,
        "do_sample": True,
        "pad_token_id": tokenizer.eos_token_id,
    }
    output_length_sampler = LengthSampler(3, 6)
    accelerator = ppo_trainer.accelerator
    all_stats, spans_seen = [], []
    for step, batch in enumerate(ppo_trainer.dataloader):
        if step == args.steps:
            break
        query_tensors = batch["input_ids"]
        response_tensors = ppo_trainer.generate(
            query_tensors, return_prompt=False, length_sampler=output_length_sampler, **generation_kwargs
        )
        batch["response"] = tokenizer.batch_decode(response_tensors)
        rewards = [lexicon_reward(q + r) for q, r in zip(batch["query"], batch["response"])]
        token_rewards = []
        for q, r, score in zip(query_tensors, response_tensors, rewards):
            t_reward = torch.zeros(len(q) + len(r) - 1)
            t_reward[-1] = score
            token_rewards.append(t_reward)
        spans = query_batch_span(
            [PROMPT.format(q + r) for q, r in zip(batch["query"], batch["response"])], max_workers=2, max_tokens=60
        )
        spans_seen += spans
        tokens = [[tokenizer.decode(t) for t in torch.cat((q, r))] for q, r in zip(query_tensors, response_tensors)]
        for tok_r, i_r in zip(token_rewards, intrinsic_rewards(spans, tokens, -0.5)):
            i_r = i_r[1:]
            assert len(tok_r) == len(i_r)
            for k in range(len(tok_r)):
                tok_r[k] += i_r[k]
        stats = ppo_trainer.step(query_tensors, response_tensors, token_rewards)
        ppo_trainer.log_stats(stats, batch, rewards)
        all_stats.append({k: stats[k] for k in ("objective/kl", "loss/value", "loss/policy")})
        if accelerator.is_main_process:
            ppo_trainer.save_pretrained(os.path.join(args.out, f"step_{step}"))
    if accelerator.is_main_process:
        ppo_trainer.save_pretrained(os.path.join(args.out, "final"))
    head = ppo_trainer.unwrapped().value_head
    result = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "stats": all_stats,
        "spans": spans_seen,
        "head_is_model_head": head is model.v_head,
        "head_sum": float(sum(p.detach().sum() for p in head.parameters())),
        "policy_sum": float(sum(p.double().sum() for p in model.pretrained_model.parameters())),
        "reward_logs": [h for h in ppo_trainer.state.log_history if "env/reward_mean" in h],
        "game_log": ppo_trainer.tables.get("game_log"),
    }
    with open(os.path.join(args.out, f"result_{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=2)
    main(parser.parse_args())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # launched with two processes
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown: gloo's destructors race with the peer's exit (SIGABRT)
