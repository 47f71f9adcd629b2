"""trl_stable.GRPOTrainer: every preset and filter trains a tiny model, and the batch it trains on is checked."""

import math

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args
from tiny_data import PROMPTS, length_reward

from trl_stable import GRPOTrainer
from trl_stable.core import (
    behaviour_weight,
    decoupled_ppo_loss,
    icepop_mask,
    kpop_mask,
    reward_to_go,
)
from trl_stable.rewards.dense import dense_reward
from trl_stable.testing import build_causal_lm


def vowel_reward(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


class SpyTrainer(GRPOTrainer):
    """Keeps the last generation batch and the rewards it was built from."""

    def _postprocess_generation(self, output, record):
        self.spy_rewards = record.rewards_per_func.clone()
        self.spy_before = {k: v.clone() if torch.is_tensor(v) else v for k, v in output.items()}
        out = super()._postprocess_generation(output, record)
        # the dense rewards are collected inside _postprocess_generation (prefetched in _calculate_rewards)
        self.spy_dense = None if record.dense_rewards is None else record.dense_rewards.clone()
        return out

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.spy_out = {k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()}
        return out


def make_trainer(tokenizer, tmp_path, reward_funcs=(length_reward,), eval_dataset=None, **config):
    args = tiny_grpo_args(tmp_path, **{"learning_rate": 1e-3, "seed": 0, **config})
    return SpyTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )


def train(trainer):
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(math.isfinite(h["loss"]) for h in logs)
    return logs[-1]


def loss_mask(out):
    mask = out["completion_mask"]
    return mask if "tool_mask" not in out else mask * out["tool_mask"]


# ---------------------------------------------------------------- advantage presets
@pytest.mark.parametrize("estimator", ["liteppo", "rloo", "ngrpo"])
def test_trl_stable_estimators_train_and_match_core(tokenizer, tmp_path, caplog, estimator):
    trainer = make_trainer(
        tokenizer, tmp_path, reward_funcs=(length_reward, vowel_reward), advantage_estimator=estimator
    )
    with caplog.at_level("WARNING"):
        log = train(trainer)
    # these rewards go above 1: NGRPO's virtual "best" sample of reward 1 is not the best, and the user is told
    assert ("exceeds ngrpo_r_max=1.0" in caplog.text) == (estimator == "ngrpo")
    grouped = (trainer.spy_rewards * trainer.reward_weights).sum(1).view(-1, 2).double()
    if estimator == "ngrpo":  # one virtual sample of reward 1 per group of two
        full = torch.cat([grouped, torch.ones(grouped.size(0), 1, dtype=grouped.dtype)], 1)
        expected = (grouped - full.mean(1, keepdim=True)) / (full.std(1, keepdim=True) + 1e-6)
    elif estimator == "liteppo":  # group mean, std of the centred rewards over the batch
        centred = grouped - grouped.mean(1, keepdim=True)
        expected = centred / (centred.flatten().pow(2).sum() / (centred.numel() - 1)).sqrt().add(1e-4)
    else:  # leave-one-out baseline: in a group of two, the other sample
        expected = grouped - grouped.flip(1)
    torch.testing.assert_close(trainer.spy_out["advantages"].double(), expected.flatten(), atol=1e-5, rtol=1e-5)
    assert "advantages/length_reward/std" in log


@pytest.mark.parametrize(
    "estimator, trl_fields",
    [
        ("dr_grpo", {"scale_rewards": "none", "loss_type": "dr_grpo"}),
        ("gdpo", {"multi_objective_aggregation": "normalize_then_sum"}),
    ],
)
def test_trl_backed_presets(tokenizer, tmp_path, estimator, trl_fields):
    trainer = make_trainer(
        tokenizer, tmp_path, reward_funcs=(length_reward, vowel_reward), advantage_estimator=estimator
    )
    for name, value in trl_fields.items():
        assert getattr(trainer.args, name) == value
    log = train(trainer)
    if estimator == "gdpo":  # per-reward group z-scores, summed, then z-scored over the batch (by hand)
        assert "advantages/vowel_reward/abs_mean" in log
        rewards = trainer.spy_rewards.double()
        grouped = rewards.view(-1, 2, rewards.size(1))
        z = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view_as(rewards)
        summed = z.sum(1)
        expected = (summed - summed.mean()) / (summed.std() + 1e-4)
        torch.testing.assert_close(trainer.spy_out["advantages"].double(), expected, atol=1e-5, rtol=1e-5)
    else:
        grouped = trainer.spy_rewards.sum(1).view(-1, 2)
        expected = (grouped - grouped.mean(1, keepdim=True)).flatten()  # group mean, no std
        torch.testing.assert_close(trainer.spy_out["advantages"], expected)


def test_fine_grained_group_group_equals_trl_default(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, advantage_mean_level="group", advantage_std_level="group")
    train(trainer)
    # trl_stable recomputed them; TRL's own computation (kept in spy_before) must agree
    torch.testing.assert_close(trainer.spy_out["advantages"], trainer.spy_before["advantages"])


# ---------------------------------------------------------------- sampler log-probs and the decoupled loss
def test_sampler_logps_recorded_and_match_trainer(tokenizer, tmp_path):
    # learning_rate 0: the policy after the step is the rollout policy, so the trainer's log-probs can be recomputed
    trainer = make_trainer(tokenizer, tmp_path, capture_sampler_logps=True, temperature=0.7, learning_rate=0.0)
    train(trainer)
    out = trainer.spy_out
    assert "sampling_per_token_logps" in out and "old_per_token_logps" not in out  # no extra forward
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    am = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, out["completion_ids"].size(1))
    mask = out["completion_mask"].bool()
    # same temperature processing on both sides: only float noise is left
    assert (out["sampling_per_token_logps"][mask] - ref[mask]).abs().max() < 1e-4


def test_decoupled_loss_top_k_weights_and_fold(tokenizer, tmp_path):
    # top-k renormalises the sampler's distribution, so logp_behav >= logp_prox and w <= 1: a real mismatch
    trainer = make_trainer(tokenizer, tmp_path, use_decoupled_loss=True, top_k=20)
    log = train(trainer)
    out, before = trainer.spy_out, trainer.spy_before
    mask = loss_mask(out)
    w = behaviour_weight(out["old_per_token_logps"], out["sampling_per_token_logps"], mask)
    assert (w[mask.bool()] <= 1 + 1e-5).all() and (w[mask.bool()] < 0.999).any()
    torch.testing.assert_close(out["advantages"], before["advantages"].unsqueeze(1) * w)
    assert log["behaviour_weight/max"] <= 1 + 1e-5


def test_folded_decoupled_loss_equals_core_formula(tokenizer, tmp_path):
    trainer = make_trainer(
        tokenizer, tmp_path, use_decoupled_loss=True, token_filter="icepop", token_filter_lower=0.9, top_k=10
    )
    train(trainer)
    inputs = trainer.spy_out
    model = trainer.model
    trl_loss = trainer._compute_loss(model, inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, am, inputs["completion_ids"].size(1))
    prox, behav, mask = inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], loss_mask(inputs)
    keep = icepop_mask(prox, behav, mask, 0.9, 5.0)
    seq_adv = trainer.spy_before["advantages"].unsqueeze(1).expand_as(prox)
    ref = decoupled_ppo_loss(logps, prox, behaviour_weight(prox, behav, mask), seq_adv, mask, keep, 0.2, 0.2)
    torch.testing.assert_close(trl_loss, ref)


@pytest.mark.parametrize(
    "filter_config",
    [
        {"token_filter": "icepop"},
        {"token_filter": "icepop", "token_filter_level": "sequence", "token_filter_lower": 0.95},
        {"token_filter": "icepop", "token_filter_action": "clamp", "token_filter_lower": 0.95},
        {
            "token_filter": "icepop",
            "token_filter_action": "clamp",
            "token_filter_level": "sequence",
            "token_filter_lower": 0.95,
        },
        {"token_filter": "kpop", "token_filter_upper": 1e-4},
        {"token_filter": "kpop", "token_filter_level": "sequence"},
    ],
)
def test_token_filters_train(tokenizer, tmp_path, filter_config):
    trainer = make_trainer(tokenizer, tmp_path, use_decoupled_loss=True, top_k=10, **filter_config)
    log = train(trainer)
    out, before = trainer.spy_out, trainer.spy_before
    prox, behav, mask = out["old_per_token_logps"], out["sampling_per_token_logps"], loss_mask(out)
    name, level = filter_config["token_filter"], filter_config.get("token_filter_level", "token")
    lower, upper = trainer.args.filter_bounds
    w = behaviour_weight(prox, behav, mask)
    if filter_config.get("token_filter_action") == "clamp":  # by hand: the band applied to w or to its seq mean
        log_w = torch.where(mask.bool(), prox - behav, torch.zeros_like(prox))
        if level == "token":
            clamped = log_w.clamp(math.log(lower), math.log(upper)).exp()
        else:
            seq = log_w.sum(1, keepdim=True) / mask.sum(1, keepdim=True)
            clamped = (log_w + seq.clamp(math.log(lower), math.log(upper)) - seq).exp()
        clamped = torch.where(mask.bool(), clamped, torch.ones_like(clamped))
        torch.testing.assert_close(out["advantages"], before["advantages"].unsqueeze(1) * clamped)
        changed = ((clamped - log_w.exp()).abs() > 1e-6) & mask.bool()
        assert changed.any()  # the band [0.95, 5] or the sequence clamp must bite on top-k-renormalised tokens
        frac = log[f"token_filter/{name}/clamped_token_frac"]
        assert frac == pytest.approx((changed.sum() / mask.sum()).item(), abs=1e-6)
        return
    keep = (
        icepop_mask(prox, behav, mask, lower, upper, level)
        if name == "icepop"
        else kpop_mask(prox, behav, mask, upper, level)
    )
    torch.testing.assert_close(out["advantages"], before["advantages"].unsqueeze(1) * w * keep)
    frac = log[f"token_filter/{name}/masked_token_frac"]
    assert frac == pytest.approx(((mask.bool() & ~keep).sum() / mask.sum()).item(), abs=1e-6)
    if name == "kpop" and level == "token":
        assert frac > 0  # a 1e-4 KL threshold must catch some top-k-renormalised tokens


def test_decoupled_with_misaligned_steps_reuses_trl_old_logps(tokenizer, tmp_path):
    # num_iterations=2: TRL computes old_per_token_logps itself; the decoupled loss must not add another forward
    trainer = make_trainer(tokenizer, tmp_path, use_decoupled_loss=True, num_iterations=2, max_steps=2)
    calls = []
    original = trainer._compute_proximal_logps
    trainer._compute_proximal_logps = lambda output: calls.append(1) or original(output)
    train(trainer)
    assert calls == [] and "old_per_token_logps" in trainer.spy_before


# ---------------------------------------------------------------- dense rewards
def test_dense_rewards_reward_to_go(tokenizer, tmp_path):
    seen = {}

    @dense_reward
    def first_token_bonus(completion_ids, env_rewards, **kwargs):
        seen["env_rewards"] = list(env_rewards)
        return [[1.0] + [0.0] * (len(ids) - 1) if i % 2 == 0 else None for i, ids in enumerate(completion_ids)]

    trainer = make_trainer(
        tokenizer,
        tmp_path,
        reward_funcs=(length_reward, first_token_bonus, vowel_reward),
        reward_weights=[1.0, 0.5, 2.0],
        dense_reward_coef=0.3,
        dense_reward_gamma=0.9,
    )
    assert trainer.reward_func_names == ["length_reward", "vowel_reward"]
    log = train(trainer)
    out, before = trainer.spy_out, trainer.spy_before
    env = (trainer.spy_rewards * torch.tensor([1.0, 2.0])).sum(1)
    assert seen["env_rewards"] == pytest.approx(env.tolist())
    mask = out["completion_mask"]
    dense = torch.zeros_like(mask, dtype=torch.float32)
    dense[0::2, 0] = 0.5  # weight 0.5 on the even rows' first token
    expected = (before["advantages"].unsqueeze(1) + 0.3 * reward_to_go(dense, mask, 0.9)) * mask
    torch.testing.assert_close(out["advantages"], expected)
    # unweighted, like TRL's rewards/<name>/mean: two rows with a 1.0 over all completion tokens
    assert log["rewards/first_token_bonus/token_mean"] == pytest.approx(2 / mask.sum().item())


def test_only_dense_rewards_is_an_error(tokenizer, tmp_path):
    @dense_reward
    def only(completion_ids, **kwargs):
        return [None] * len(completion_ids)

    with pytest.raises(ValueError, match="sequence-level reward"):
        make_trainer(tokenizer, tmp_path, reward_funcs=(only,))


# ---------------------------------------------------------------- dynamic sampling, overlong, NaN
def test_dynamic_sampling_drops_zero_variance_groups(tokenizer, tmp_path):
    def half_constant(prompts, completions, **kwargs):
        # prompts 0 and 1 (rows 0-3 after TRL's repeat sampler) give a constant reward
        return [1.0 if p in PROMPTS[:2] else float(len(c)) for p, c in zip(prompts, completions)]

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(half_constant,), dynamic_sampling=True)
    log = train(trainer)
    out = trainer.spy_out
    rewards = trainer.spy_rewards[:, 0].view(-1, 2)
    zero = (rewards[:, 0] == rewards[:, 1]).repeat_interleave(2)
    assert zero.any()
    assert (out["tool_mask"][zero] == 0).all() and (out["tool_mask"][~zero] == 1).all()
    assert out["num_items_in_batch"] == loss_mask(out).sum()
    assert log["dynamic_sampling/frac_groups_dropped"] == pytest.approx(zero.float().mean().item())


def test_overlong_penalty_is_a_reward(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, overlong_penalty_tokens=4, overlong_penalty_factor=2.0)
    assert trainer.reward_func_names[-1] == "overlong_penalty"
    log = train(trainer)
    lengths = trainer.spy_before["completion_mask"].sum(1).float()
    expected = torch.clamp(-(lengths - 4) / 4 * 2.0, max=0.0)
    torch.testing.assert_close(trainer.spy_rewards[:, -1], expected)
    assert "rewards/overlong_penalty/mean" in log


def test_nan_reward_drops_sample_with_counter(tokenizer, tmp_path, caplog):
    def sometimes_nan(completions, **kwargs):
        return [float("nan") if i == 1 else 1.0 + i for i in range(len(completions))]

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(sometimes_nan,), nan_reward_action="drop")
    with caplog.at_level("WARNING"):
        log = train(trainer)
    assert "dropped from the loss" in caplog.text
    assert log["rewards/nan_dropped"] == 1.0
    out = trainer.spy_out
    assert out["tool_mask"][1].sum() == 0 and out["advantages"][1] == 0
    assert out["num_items_in_batch"] == loss_mask(out).sum()


def test_all_nan_rewards_raise(tokenizer, tmp_path):
    def broken(completions, **kwargs):
        return [float("nan")] * len(completions)

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(broken,), nan_reward_action="drop")
    with pytest.raises(ValueError, match="broken"):
        trainer.train()


def test_nan_reward_default_is_trl_advantage_zero(tokenizer, tmp_path):
    """The default keeps TRL's behavior: the unscorable completion stays in the loss with advantage 0."""

    def sometimes_nan(completions, **kwargs):
        return [float("nan") if i == 1 else 1.0 + i for i in range(len(completions))]

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=(sometimes_nan,))
    log = train(trainer)
    assert "rewards/nan_dropped" not in log
    out = trainer.spy_out
    assert out["advantages"][1] == 0 and "tool_mask" not in out
    assert out["num_items_in_batch"] == out["completion_mask"].sum()


def test_dynamic_sampling_refill_keeps_batch_full(tokenizer, tmp_path):
    def half_constant(prompts, completions, **kwargs):
        return [1.0 if p in PROMPTS[:2] else float(len(c)) for p, c in zip(prompts, completions)]

    trainer = make_trainer(
        tokenizer,
        tmp_path,
        reward_funcs=(half_constant,),
        dynamic_sampling=True,
        dynamic_sampling_max_refills=6,
        per_device_train_batch_size=8,
        num_generations=4,
    )
    generated = []
    original = trainer._refill_prompts
    trainer._refill_prompts = lambda n: generated.append(n) or original(n)
    log = train(trainer)
    out = trainer.spy_out  # the spy sees the last post-processed part; check the merged batch via the buffer
    batch = trainer._buffered_inputs[0]
    assert generated and all(n == 8 for n in generated)
    assert batch["completion_ids"].size(0) == 8 == batch["advantages"].size(0)
    mask = loss_mask(batch)
    assert batch["num_items_in_batch"] == mask.sum()
    filled = log["dynamic_sampling/frac_batch_filled"]
    assert filled == pytest.approx((mask.sum(1) > 0).float().mean().item())
    assert filled > 0.5  # refills found informative groups beyond the original two prompts' 4 rows
    assert out["completion_ids"].size(1) <= batch["completion_ids"].size(1)


def test_evaluation_with_decoupled_loss_and_ngrpo(tokenizer, tmp_path):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        advantage_estimator="ngrpo",
        use_decoupled_loss=True,
        token_filter="kpop",
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
        eval_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    train(trainer)
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert evals and math.isfinite(evals[0]["eval_loss"])
    assert "eval_token_filter/kpop/masked_token_frac" in evals[0]


def test_no_batch_value_outlives_its_call(tokenizer, tmp_path):
    """Per-batch values travel in the batch or the call's record, never in attributes left on the trainer."""
    trainer = make_trainer(tokenizer, tmp_path, dynamic_sampling=True, use_decoupled_loss=True)
    train(trainer)
    assert trainer._rollout is None
    stale = ("_batch_rewards_per_func", "_batch_dense_rewards", "_batch_dynamic_keep", "_routing_output")
    assert not [name for name in stale if hasattr(trainer, name)]
