"""Left-padded rows: the trainer's log-prob passes number the tokens as the sampler did, so they agree with it.

HF `generate` derives a left-padded row's position ids from its attention mask; TRL's GRPO forward gives the model
none, which on absolute position embeddings (GPT-2) moves the log-probs of the padded rows by about a nat. With a
trl_stable option that compares with the sampler's log-probs, every GRPO pass takes position ids from the mask; PPO
always does.
"""

import pytest
import torch
import trl
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import length_reward

from trl_stable import GRPOTrainer, PPOTrainer
from trl_stable.testing import build_causal_lm, save_tiny

# 1, 3 and 7 tokens: every batch of 4 rows (2 prompts x 2 generations) mixes lengths, so some rows are left-padded
PROMPTS = ["Hi", "The movie was", "She walked to the store and then", "I think"]


def _model(family, tokenizer):
    # initializer_range 0.2: at the default 0.02 a tiny random model's logits are nearly uniform and the position
    # embeddings barely move them; at 0.2 they matter, as in a trained GPT-2
    return build_causal_lm(family, tokenizer, seed=0, initializer_range=0.2)


class _Spy(GRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.spy_out = {k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()}
        return out


def _grpo(tokenizer, tmp_path, family="gpt2", model=None, **config):
    args = tiny_grpo_args(
        tmp_path,
        max_completion_length=6,
        learning_rate=0.0,  # the policy after the step is the rollout policy: both sides can be recomputed
        disable_dropout=True,  # GPT-2's dropout would make every recomputation differ from the sampler
        seed=0,
        **config,
    )
    return _Spy(
        model=_model(family, tokenizer) if model is None else model,
        reward_funcs=[length_reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )


def _step_log(trainer):
    trainer.train()
    return next(h for h in trainer.state.log_history if "loss" in h)


def _ids_and_mask(out):
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    return ids, torch.cat([out["prompt_mask"], out["completion_mask"]], 1)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_recomputed_logps_equal_the_samplers_on_left_padded_rows(tokenizer, tmp_path, family):
    trainer = _grpo(tokenizer, tmp_path, family, capture_sampler_logps=True)
    _step_log(trainer)
    out = trainer.spy_out
    padded = (out["prompt_mask"] == 0).any(1)
    assert padded.any() and not padded.all()  # rows of different lengths
    ids, mask = _ids_and_mask(out)
    width = out["completion_ids"].size(1)
    sampler, completion = out["sampling_per_token_logps"], out["completion_mask"].bool()
    with torch.no_grad():
        ours = trainer._compute_proximal_logps(out)  # the trainer-side pass the decoupled loss and monitor use
        trl_own, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, width)
    assert (ours - sampler)[completion].abs().max() < 1e-4
    trl_diff = (trl_own - sampler).abs()
    assert trl_diff[~padded][completion[~padded]].max() < 1e-4  # unpadded rows: TRL's numbering is already right
    if family == "gpt2":  # absolute positions: TRL's numbering of the padded rows is what this fixes
        assert trl_diff[padded][completion[padded]].mean() > 0.5
    else:  # rotary positions are relative: the numbering moves only float rounding (large here, at init 0.2)
        assert trl_diff[padded][completion[padded]].max() < 0.05


@pytest.mark.parametrize(
    "config",
    [{"use_decoupled_loss": True, "token_filter": "icepop"}, {"health_mismatch_monitor": True}],
    ids=["decoupled_icepop", "mismatch_monitor"],
)
def test_no_mismatch_and_icepop_masks_nothing_at_equal_weights(tokenizer, tmp_path, config):
    """Equal weights on both sides: the sampler/trainer mismatch is float noise and IcePop keeps every token (with
    TRL's numbering GPT-2's padded rows were off by ~1 nat, up to 2.5, and IcePop masked 21% of all tokens)."""
    log = _step_log(_grpo(tokenizer, tmp_path, **config))
    assert log["mismatch/logp_abs_diff/mean"] < 1e-5
    assert log["mismatch/logp_abs_diff/max"] < 1e-4
    if "token_filter" in config:
        assert log["token_filter/icepop/masked_token_frac"] == 0.0
        assert abs(log["behaviour_weight/min"] - 1) < 1e-3 and abs(log["behaviour_weight/max"] - 1) < 1e-3
        # the update's forward numbers the tokens as the proximal pass did: ratio 1 at the rollout weights
        assert log["clip_ratio/region_mean"] == 0.0


def _spy_position_ids(module, seen):
    def hook(_, args, kwargs):
        if kwargs.get("fused_lm_head"):  # TRL's log-prob passes, not generate's forwards
            seen.append((kwargs.get("position_ids") is not None, torch.is_grad_enabled()))

    return module.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("on", [False, True], ids=["defaults", "decoupled"])
def test_every_pass_or_none_takes_mask_position_ids(tokenizer, tmp_path, on):
    """With the option on, the old-logprob, proximal, reference and update passes all get them (their ratios compare
    like with like); with every option at its default none does, so the numbers stay TRL's."""
    options = {"use_decoupled_loss": True} if on else {}
    path = save_tiny(tmp_path / "policy", _model("gpt2", tokenizer), tokenizer)  # TRL loads the reference from it
    trainer = _grpo(tokenizer, tmp_path, model=path, beta=0.1, num_iterations=2, **options)
    policy, reference = [], []
    _spy_position_ids(trainer.model, policy)
    _spy_position_ids(trainer.ref_model, reference)
    _step_log(trainer)
    assert reference and {grad for _, grad in policy} == {False, True}  # no-grad passes and the update
    assert all(has for has, _ in policy + reference) if on else not any(has for has, _ in policy + reference)


def test_ppo_rollout_pass_equals_the_samplers_on_left_padded_rows(tokenizer, tmp_path):
    """PPO numbers its batch from the attention mask (`make_batch`), in the rollout, reference and update passes."""
    args = tiny_ppo_args(
        tmp_path, use_decoupled_loss=True, token_filter="icepop", learning_rate=0.0, max_new_tokens=4, batch_size=4
    )
    trainer = PPOTrainer(_model("gpt2", tokenizer), args=args, processing_class=tokenizer)
    queries = [torch.tensor(tokenizer(p).input_ids) for p in PROMPTS]
    assert len({len(q) for q in queries}) > 1
    rollout = trainer.generate(queries, return_prompt=False)
    stats = trainer.step(queries, rollout, scores=[1.0, 0.0, 0.5, 0.2])
    assert stats["mismatch/logp_abs_diff/max"] < 1e-4
    assert stats["token_filter/icepop/masked_token_frac"] == 0.0

    # the check sees the bug: numbering the batch from the first column instead moves the padded rows' log-probs
    batch = trainer.make_batch(queries, list(rollout))
    padded = batch["attention_mask"][:, : max(len(q) for q in queries)].eq(0).any(1)
    trainer.model_wrapped.eval()
    ours, _ = trainer.rollout_pass(batch)
    batch["position_ids"] = torch.arange(batch["input_ids"].size(1)).expand_as(batch["input_ids"])
    first_column, _ = trainer.rollout_pass(batch)
    response = batch["response_mask"].bool()
    diff = (first_column["old_logprobs"] - ours["old_logprobs"]).abs()
    assert diff[padded][response[padded]].mean() > 0.5
