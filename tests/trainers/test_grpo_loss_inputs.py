"""What TRL's loss actually receives from trl_stable.GRPOTrainer, checked against values computed by hand.

The batch is captured at `_compute_loss` (after TRL's shuffle and split), and every expected number is recomputed here
in plain Python from the completion tokens, never by calling trl_stable.core.
"""

import math
from collections import defaultdict

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args
from tiny_data import PROMPTS  # 3 tokens each: no padding

from trl_stable import GRPOTrainer
from trl_stable.testing import build_causal_lm


def token_reward(completion_ids, **kwargs):
    """A reward in {0, .25, .5, .75, 1} that the test can recompute from the completion tokens alone."""
    return [(sum(ids) % 5) / 4 for ids in completion_ids]


class LossInputSpy(GRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.loss_inputs.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return super()._compute_loss(model, inputs)


def make_trainer(tokenizer, tmp_path, rollout_func=None, **config):
    defaults = dict(
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # a 16-row generation batch, shuffled by TRL and split over two loss calls
        num_generations=4,
        learning_rate=0.0,  # the policy stays the rollout policy, so log-probs can be recomputed afterwards
        seed=0,
    )
    defaults.update(config)
    trainer = LossInputSpy(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=[token_reward],
        args=tiny_grpo_args(tmp_path, **defaults),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.loss_inputs = []
    return trainer


def rows(inputs_list):
    """(prompt tokens, completion tokens, advantage row, row index, chunk) for every row the loss saw."""
    out = []
    for chunk in inputs_list:
        for i in range(chunk["completion_ids"].size(0)):
            prompt = tuple(chunk["prompt_ids"][i][chunk["prompt_mask"][i].bool()].tolist())
            completion = tuple(chunk["completion_ids"][i][chunk["completion_mask"][i].bool()].tolist())
            out.append((prompt, completion, chunk["advantages"][i], i, chunk))
    return out


def hand_rloo(group):
    total = sum(group)
    return [r - (total - r) / (len(group) - 1) for r in group]


def hand_ngrpo(group, r_max=1.0, eps=1e-6):
    values = group + [r_max]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(r - mean) / (std + eps) for r in group]


def hand_grpo(group, eps=1e-4):
    mean = sum(group) / len(group)
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
    return [(r - mean) / (std + eps) for r in group]


@pytest.mark.parametrize(
    "config, hand",
    [
        ({"advantage_estimator": "rloo"}, hand_rloo),
        ({"advantage_estimator": "ngrpo"}, hand_ngrpo),
        ({"advantage_estimator": "grpo"}, hand_grpo),
        ({"advantage_eps": 0.5}, lambda group: hand_grpo(group, eps=0.5)),  # trl_stable takes over from TRL
    ],
)
def test_loss_sees_the_preset_advantages(tokenizer, tmp_path, config, hand):
    trainer = make_trainer(tokenizer, tmp_path, **config)
    trainer.train()
    seen = rows(trainer.loss_inputs)
    assert len(trainer.loss_inputs) == 2 and len(seen) == 16  # generation batch: 8 rows x 2 accumulation steps
    groups = defaultdict(list)
    for prompt, completion, adv, *_ in seen:
        groups[prompt].append((completion, adv))
    assert len(groups) == 4 and all(len(g) == 4 for g in groups.values())
    rewards_seen = []
    for members in groups.values():
        rewards = [(sum(c) % 5) / 4 for c, _ in members]
        rewards_seen += rewards
        expected = hand(rewards)
        got = [adv.item() for _, adv in members]
        assert got == pytest.approx(expected, abs=1e-5), (rewards, got, expected)
    # the rewards recomputed here are the ones TRL logged
    logged = [h for h in trainer.state.log_history if "reward" in h][0]["reward"]
    assert logged == pytest.approx(sum(rewards_seen) / len(rewards_seen), abs=1e-6)


def manual_sampler_logps(model, input_ids, prompt_len, temperature, top_k, top_p):
    """log p of each completion token under temperature -> top-k -> top-p (HF's order and tie rules), by hand."""
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[:, prompt_len - 1 : -1].float() / temperature
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending, as TopPLogitsWarper
    remove_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
    remove_sorted[..., -1] = False  # keep at least one token
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    logits = logits.masked_fill(remove, float("-inf"))
    completion = input_ids[:, prompt_len:]
    return torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


def test_hf_sampler_logps_match_independent_recomputation(tokenizer, tmp_path):
    sampling = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
    trainer = make_trainer(tokenizer, tmp_path, capture_sampler_logps=True, **sampling)
    trainer.train()
    checked = 0
    for chunk in trainer.loss_inputs:
        mask = chunk["completion_mask"].bool()
        ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], 1)
        expected = manual_sampler_logps(trainer.model, ids, chunk["prompt_ids"].size(1), **sampling)
        got = chunk["sampling_per_token_logps"]
        torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=0)
        checked += int(mask.sum())
    assert checked > 0
    # top-k/top-p renormalise: the sampler's log-probs sit above the temperature-only ones TRL trains on
    chunk = trainer.loss_inputs[0]
    ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], 1)
    trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, torch.ones_like(ids), chunk["completion_ids"].size(1)
    )
    mask = chunk["completion_mask"].bool()
    assert (chunk["sampling_per_token_logps"][mask] >= trl_logps.detach()[mask] - 1e-5).all()


# Per-token offsets of the fake inference engine: behav = logp - delta, so w = exp(delta) (NaN: no score -> w = 1)
DELTAS = [0.0, math.log(2.0), math.log(0.3), math.log(8.0), float("nan"), math.log(0.55)]
EXPECTED_W = [1.0, 2.0, 0.3, 8.0, 1.0, 0.55]
EXPECTED_ICEPOP_KEEP = [True, True, False, False, True, True]  # band [0.5, 5], inclusive


def vllm_like_rollout(prompts, trainer):
    """Stands in for vLLM: fixed-length completions and per-token log-probs ('logprobs') off by known offsets."""
    gen = torch.Generator().manual_seed(len(trainer.rollout_log))
    prompt_ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
    completion_ids = [torch.randint(10, 900, (len(DELTAS),), generator=gen).tolist() for _ in prompts]
    ids = torch.tensor([p + c for p, c in zip(prompt_ids, completion_ids)])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[:, len(prompt_ids[0]) - 1 : -1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt_ids[0]) :].unsqueeze(-1)).squeeze(-1)
    # vLLM hands a token it could not score back as None (TRL turns it into NaN)
    behav = [[None if math.isnan(v) else v for v in row] for row in (logps - torch.tensor(DELTAS)).tolist()]
    trainer.rollout_log.append(dict(zip(map(tuple, completion_ids), logps.tolist())))
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": behav}


@pytest.mark.parametrize("token_filter", [None, "icepop"])
def test_decoupled_loss_with_vllm_style_sampler_logps(tokenizer, tmp_path, monkeypatch, token_filter):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        rollout_func=vllm_like_rollout,
        use_decoupled_loss=True,
        token_filter=token_filter,
        max_completion_length=len(DELTAS),
    )
    trainer.rollout_log = []
    trainer.train()
    true_logps = trainer.rollout_log[0]
    groups = defaultdict(list)
    for prompt, completion, adv, i, chunk in rows(trainer.loss_inputs):
        assert completion in true_logps and adv.shape == (len(DELTAS),)
        # the proximal log-probs were recomputed by the trainer and agree with the engine-free forward
        prox = chunk["old_per_token_logps"][i]
        torch.testing.assert_close(prox, torch.tensor(true_logps[completion]), atol=1e-5, rtol=0)
        # vLLM's key reaches the loss unchanged (NaN included)
        behav = chunk["sampling_per_token_logps"][i]
        expected_behav = torch.tensor(true_logps[completion]) - torch.tensor(DELTAS)
        torch.testing.assert_close(behav, expected_behav, equal_nan=True)
        groups[prompt].append((completion, adv))
    for members in groups.values():
        seq_adv = hand_grpo([(sum(c) % 5) / 4 for c, _ in members])
        for (_, adv), a in zip(members, seq_adv):
            keep = EXPECTED_ICEPOP_KEEP if token_filter == "icepop" else [True] * len(DELTAS)
            expected = [a * w * k for w, k in zip(EXPECTED_W, keep)]
            assert adv.tolist() == pytest.approx(expected, abs=1e-4)
    log = [h for h in trainer.state.log_history if "loss" in h][0]
    assert log["behaviour_weight/max"] == pytest.approx(8.0, rel=1e-4)
    assert log["behaviour_weight/min"] == pytest.approx(0.3, rel=1e-4)
    assert log["behaviour_weight/mean"] == pytest.approx(sum(EXPECTED_W) / len(EXPECTED_W), rel=1e-4)
    if token_filter == "icepop":
        assert log["token_filter/icepop/masked_token_frac"] == pytest.approx(2 / 6)
        assert log["token_filter/icepop/masked_seq_frac"] == 1.0
