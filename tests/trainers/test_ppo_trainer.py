"""PPOTrainer on the tiny kit: one step trains policy and value, rewards, KL, errors, callbacks, train()."""

import math
import os

import pytest
import torch
from datasets import Dataset
from tiny_configs import step_logs, tiny_ppo_args
from tiny_data import SHORT_PROMPTS
from transformers import TrainerCallback

from trl_stable import PPOConfig, PPOTrainer
from trl_stable.core.kl import kl_estimate
from trl_stable.rewards import dense_reward
from trl_stable.testing import build_causal_lm, build_reward_model
from trl_stable.trainers.ppo import AdaptiveKLController, RunningMoments
from trl_stable.trainers.ppo.value_head import ValueHead


def _args(tmp_path, **kw):
    return tiny_ppo_args(tmp_path, **{"max_new_tokens": 6, **kw})


def _queries(tokenizer, n=4):
    texts = ["The movie was", "I think", "A story about", "We saw"]
    return [torch.tensor(tokenizer(texts[i % 4])["input_ids"]) for i in range(n)]


def _snapshot(trainer):
    return {n: p.detach().clone() for n, p in trainer.unwrapped().named_parameters()}


def _changed(trainer, before):
    return {n for n, p in trainer.unwrapped().named_parameters() if not torch.equal(p, before[n])}


def test_one_step_changes_policy_and_value_weights(tmp_path, tokenizer):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    args = _args(tmp_path, learning_rate=1e-3, mini_batch_size=4)  # one update: its ratio must be exactly 1
    trainer = PPOTrainer(model, args=args, processing_class=tokenizer)
    queries = _queries(tokenizer)
    responses = trainer.generate(queries, return_prompt=False)
    assert all(r.dim() == 1 and 1 <= len(r) <= 6 for r in responses)
    before = _snapshot(trainer)
    token_rewards = [[0.1] * (len(r) - 1) + [1.0] for r in responses]
    stats = trainer.step(queries, responses, token_rewards)
    changed = _changed(trainer, before)
    assert any(n.startswith("policy.") for n in changed)
    assert {"value_head.summary.weight", "value_head.summary.bias"} <= changed
    for key in (
        "objective/kl",
        "objective/entropy",
        "objective/rlhf_reward",
        "objective/non_score_reward",
        "policy/approxkl",
        "policy/clipfrac",
        "loss/policy",
        "loss/value",
        "val/clipfrac",
        "val/ratio",
        "dense/reward_mean",
    ):
        assert key in stats and math.isfinite(stats[key]), key
    # first update of the first epoch: rollout and update passes agree
    assert stats["val/ratio"] == pytest.approx(1.0, abs=1e-4)
    assert stats["dense/reward_mean"] == pytest.approx(sum(sum(r) for r in token_rewards) / 4, rel=1e-5)
    assert trainer.state.global_step == 1 and trainer.state.log_history[-1]["step"] == 1


def test_generate_return_prompt_and_single_query(tmp_path, tokenizer):
    model = build_causal_lm("gpt2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path), processing_class=tokenizer)
    q = _queries(tokenizer, 1)[0]
    full = trainer.generate(q, max_new_tokens=3)
    assert isinstance(full, torch.Tensor) and torch.equal(full[: len(q)], q) and len(full) <= len(q) + 3
    outs = trainer.generate(_queries(tokenizer), length_sampler=lambda: 2, return_prompt=False, batch_size=2)
    assert len(outs) == 4 and all(len(o) <= 2 for o in outs)


def test_per_token_rewards_kl_and_score(tmp_path, tokenizer):
    """The rewards fed to GAE are -kl_coef*KL + dense + score on the last token (checked through a spy)."""
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path, init_kl_coef=0.5, adap_kl_ctrl=False), processing_class=tokenizer)
    seen = {}
    import trl_stable.core.estimators as estimators_mod

    real = estimators_mod.compute_gae

    def spy(rewards, values, mask, gamma, lam, bootstrap):
        seen.update(rewards=rewards.clone(), mask=mask.clone())
        return real(rewards, values, mask, gamma, lam, bootstrap)

    estimators_mod.compute_gae = spy
    original_pass = trainer.rollout_pass

    def fake_kl(batch):
        out, logs = original_pass(batch)
        out["kl"] = torch.full_like(out["kl"], 0.2)
        return out, logs

    trainer.rollout_pass = fake_kl
    try:
        queries = _queries(tokenizer)
        responses = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10]), torch.tensor([11, 12, 13])]
        dense = [[1.0, 0.0, 2.0], [0.5, 0.5], [3.0], [0.0, 0.0, 0.0]]
        trainer.step(queries, responses, dense, scores=[10.0, 20.0, 30.0, 40.0])
    finally:
        estimators_mod.compute_gae = real
    expected = torch.tensor(
        [
            [1.0 - 0.1, -0.1, 2.0 - 0.1 + 10.0],
            [0.5 - 0.1, 0.5 - 0.1 + 20.0, 0.0],
            [3.0 - 0.1 + 30, 0, 0],
            [-0.1, -0.1, -0.1 + 40.0],
        ]
    )
    torch.testing.assert_close(seen["rewards"], expected)
    torch.testing.assert_close(seen["mask"], torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]))


@pytest.mark.parametrize("kl_penalty", ["kl", "abs", "mse", "k3", "low_var_kl", "full"])
def test_kl_estimators(tmp_path, tokenizer, kl_penalty):
    model = build_causal_lm("gpt2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path, kl_penalty=kl_penalty), processing_class=tokenizer)
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    if kl_penalty != "full":
        # k3 = exp(ref - logp) - (ref - logp) - 1: e^-0.5 + 0.5 - 1 and e^1 - 1 - 1 (low_var_kl: the same, in range)
        k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
        expected = {"kl": [0.5, -1.0], "abs": [0.5, 1.0], "mse": [0.125, 0.5], "k3": k3, "low_var_kl": k3}
        torch.testing.assert_close(kl_estimate(logp, ref, kl_penalty), torch.tensor(expected[kl_penalty]))
    # with the reference equal to the initial policy, every estimator gives KL 0 on the first rollout
    stats = trainer.step(_queries(tokenizer), [torch.tensor([5, 6])] * 4, scores=[1.0, 0.0, 1.0, 0.0])
    assert stats["objective/kl"] == pytest.approx(0.0, abs=1e-5)


def test_adaptive_kl_controller_and_running_moments():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=100)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 100 / 10000))
    ctl.update(current_kl=5.4, n_steps=100)  # error -0.1
    assert ctl.value == pytest.approx(0.2 * 1.002 * (1 - 0.1 * 0.01))
    rm = RunningMoments()
    xs = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    rm.update(xs[:2])
    rm.update(xs[2:])
    assert rm.mean == pytest.approx(4.0)
    assert rm.std == pytest.approx(xs.std().item(), rel=1e-6)


def test_score_scaling_norm_and_clip(tmp_path, tokenizer):
    model = build_causal_lm("gpt2", tokenizer, seed=0)
    args = _args(tmp_path, use_score_scaling=True, use_score_norm=True, score_clip=0.5)
    trainer = PPOTrainer(model, args=args, processing_class=tokenizer)
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0])
    out = trainer.scale_scores(scores, torch.ones(4, dtype=torch.bool))
    expected = ((scores - scores.mean()) / (scores.std() + 1e-8)).clamp(-0.5, 0.5)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # the next batch is scaled by the running statistics of both batches; its invalid (NaN-reward) sample is left out
    nxt = torch.tensor([0.0, 10.0, 999.0])
    seen = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 10.0])
    out = trainer.scale_scores(nxt, torch.tensor([True, True, False]))
    expected = ((nxt[:2] - seen.mean()) / (seen.std() + 1e-8)).clamp(-0.5, 0.5)
    torch.testing.assert_close(out[:2], expected, rtol=1e-4, atol=1e-4)
    assert trainer.running.count == 6
    scaling_only = PPOTrainer(
        model, args=_args(tmp_path, use_score_scaling=True), processing_class=tokenizer
    ).scale_scores(scores, torch.ones(4, dtype=torch.bool))
    torch.testing.assert_close(scaling_only, scores / (scores.std() + 1e-8), rtol=1e-4, atol=1e-4)


def test_score_scaling_of_a_constant_stream_stays_finite(tmp_path, tokenizer):
    model = build_causal_lm("gpt2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path, use_score_scaling=True), processing_class=tokenizer)
    scores = torch.full((4,), 0.7)
    for _ in range(2):
        out = trainer.scale_scores(scores, torch.ones(4, dtype=torch.bool))
    assert trainer.running.std == 0.0
    torch.testing.assert_close(out, scores)  # unscaled, instead of 0.7 / 1e-8


def test_bad_inputs(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="divisible"):
        PPOConfig(output_dir=str(tmp_path), batch_size=8, mini_batch_size=2, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match="kl_penalty"):
        PPOConfig(output_dir=str(tmp_path), kl_penalty="bogus")
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    with pytest.raises(ValueError, match="hidden size"):
        PPOTrainer(model, args=_args(tmp_path), processing_class=tokenizer, value_model=ValueHead(17))
    trainer = PPOTrainer(model, args=_args(tmp_path), processing_class=tokenizer)
    q, r = _queries(tokenizer), [torch.tensor([5, 6, 7])] * 4
    with pytest.raises(ValueError, match="token_rewards\\[1\\] has 2 entries"):
        trainer.step(q, r, [[0.0] * 3, [0.0] * 2, [0.0] * 3, [0.0] * 3])
    with pytest.raises(ValueError, match="different lengths"):
        trainer.step(q, r[:3], [[0.0] * 3] * 4)
    with pytest.raises(ValueError, match="needs `token_rewards`"):
        trainer.step(q, r)
    with pytest.raises(ValueError, match="Every sample"):
        trainer.step(q, r, scores=[float("nan")] * 4)


def test_nan_sample_is_dropped(tmp_path, tokenizer):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path), processing_class=tokenizer)
    r = [torch.tensor([5, 6, 7])] * 4
    with pytest.warns(UserWarning, match="Dropping 1 of 4"):
        stats = trainer.step(_queries(tokenizer), r, [[0.0, 0.0, 1.0], [0.0, float("nan"), 1.0]] + [[0.0] * 3] * 2)
    assert stats["ppo/dropped_samples"] == 1.0
    assert math.isfinite(stats["loss/total"]) and stats["dense/reward_mean"] == pytest.approx(1 / 3)


def test_train_drops_nan_none_and_inf_rewards_and_refuses_strings(tmp_path, tokenizer):
    calls = []

    def flaky(completion_ids, **kw):
        calls.append(1)
        return [float("nan"), 1.0, None, 0.5] if len(calls) == 1 else [float("nan")] * len(completion_ids)

    model = build_causal_lm("qwen2", tokenizer, seed=0)
    ds = Dataset.from_dict({"prompt": SHORT_PROMPTS * 2})
    trainer = PPOTrainer(
        model, reward_funcs=flaky, args=_args(tmp_path, max_steps=2), processing_class=tokenizer, train_dataset=ds
    )
    # NaN and None both mean "does not apply": with a single reward function those samples have no reward
    with pytest.warns(UserWarning, match="Dropping 2 of 4"), pytest.raises(ValueError, match="Every sample"):
        trainer.train()
    first = trainer.state.log_history[0]
    assert first["ppo/dropped_samples"] == 2.0 and first["env/reward_mean"] == pytest.approx(0.75)
    assert math.isfinite(first["loss/total"]) and math.isfinite(first["objective/kl"])

    def infinite(completion_ids, **kw):  # an infinite reward is a broken score: the sample is dropped, like NaN
        return [1.0, float("inf"), 0.0, 0.0]

    trainer = PPOTrainer(
        model, reward_funcs=infinite, args=_args(tmp_path, max_steps=1), processing_class=tokenizer, train_dataset=ds
    )
    with pytest.warns(UserWarning, match="Dropping 1 of 4"):
        trainer.train()
    assert trainer.state.log_history[0]["env/reward_mean"] == pytest.approx(1 / 3)

    def text(completion_ids, **kw):
        return [1.0, "0.5", 0.0, 0.0]

    trainer = PPOTrainer(
        model, reward_funcs=text, args=_args(tmp_path, max_steps=1), processing_class=tokenizer, train_dataset=ds
    )
    with pytest.raises(TypeError, match="'text' returned '0.5' \\(str\\) for completion 1"):
        trainer.train()


def test_callbacks_see_logs(tmp_path, tokenizer):
    events = []

    class Spy(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            events.append("begin")

        def on_step_end(self, args, state, control, **kwargs):
            events.append(("step", state.global_step))

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(("log", logs["objective/kl"]))

    model = build_causal_lm("gpt2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path), processing_class=tokenizer, callbacks=[Spy()])
    trainer.step(_queries(tokenizer), [torch.tensor([5, 6])] * 4, scores=[1.0] * 4)
    assert events[0] == "begin" and ("step", 1) in events and any(e[0] == "log" for e in events if e != "begin")
    assert "objective/kl" in trainer.state.log_history[-1]


def test_tqdm_progress_bar(tmp_path, tokenizer, capsys):
    from transformers.trainer_callback import ProgressCallback

    model = build_causal_lm("gpt2", tokenizer, seed=0)
    ds = Dataset.from_dict({"prompt": SHORT_PROMPTS})
    args = _args(tmp_path, disable_tqdm=False, max_steps=1)
    trainer = PPOTrainer(
        model,
        reward_funcs=lambda completion_ids, **kw: [1.0] * len(completion_ids),
        args=args,
        processing_class=tokenizer,
        train_dataset=ds,
    )
    assert any(isinstance(cb, ProgressCallback) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert "1/1" in capsys.readouterr().err  # the bar reached max_steps


def test_shared_layers_reference(tmp_path, tokenizer):
    model = build_causal_lm("gpt2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path, num_shared_layers=1), processing_class=tokenizer)
    policy = dict(trainer.policy.named_parameters())
    ref = dict(trainer.ref_model.named_parameters())
    assert ref["transformer.h.0.attn.c_attn.weight"] is policy["transformer.h.0.attn.c_attn.weight"]
    assert not policy["transformer.h.0.attn.c_attn.weight"].requires_grad
    assert policy["transformer.h.1.attn.c_attn.weight"].requires_grad
    assert ref["transformer.h.1.attn.c_attn.weight"] is not policy["transformer.h.1.attn.c_attn.weight"]
    before = _snapshot(trainer)
    trainer.step(_queries(tokenizer), [torch.tensor([5, 6])] * 4, scores=[1.0, 0.0, 0.0, 1.0])
    changed = _changed(trainer, before)
    assert not any(".h.0." in n for n in changed) and any(".h.1." in n for n in changed)


def test_separate_value_model(tmp_path, tokenizer):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    critic = build_reward_model("llama", tokenizer, seed=1)
    trainer = PPOTrainer(model, args=_args(tmp_path), processing_class=tokenizer, value_model=critic)
    before = _snapshot(trainer)
    trainer.step(_queries(tokenizer), [torch.tensor([5, 6, 7])] * 4, scores=[1.0, 0.0, 0.0, 1.0])
    changed = _changed(trainer, before)
    assert any(n.startswith("value_backbone.") for n in changed) and "value_head.summary.weight" in changed
    assert trainer.unwrapped().value_head.summary is critic.score  # the 1-label head is reused
    assert critic.score.bias is None  # llama's classifier head has no bias: the saved head must still load
    trainer.save_model(str(tmp_path / "saved"))
    head = ValueHead.from_pretrained(tmp_path / "saved")
    assert torch.equal(head.summary.weight, critic.score.weight.detach()) and head.summary.bias is None
    assert os.path.isfile(tmp_path / "saved" / "value_model" / "config.json")


def test_train_with_reward_functions(tmp_path, tokenizer):
    seen = {}

    def length_reward(prompts, completions, completion_ids, topic, **kw):
        seen["topic"] = topic
        return [float(len(c)) / 10 for c in completion_ids]

    @dense_reward
    def dense(prompts, completions, completion_ids, env_rewards=None, **kw):
        seen["env"] = env_rewards
        return [[0.5] * len(c) for c in completion_ids]

    model = build_causal_lm("qwen2", tokenizer, seed=0)
    rm = build_reward_model("gpt2", tokenizer, seed=3)
    ds = Dataset.from_dict({"prompt": SHORT_PROMPTS * 2, "topic": list("abcdabcd")})
    args = _args(tmp_path, max_steps=2, reward_weights=[2.0, 1.0, 1.0], min_new_tokens=2, max_new_tokens=5)
    trainer = PPOTrainer(
        model, reward_funcs=[length_reward, rm, dense], args=args, processing_class=tokenizer, train_dataset=ds
    )
    out = trainer.train()
    assert out.global_step == 2
    logs = step_logs(trainer)
    # Trainer's end-of-training summary follows the steps
    assert {"train_runtime", "train_loss"} <= set(trainer.state.log_history[-1])
    assert out.training_loss == pytest.approx(sum(h["loss/total"] for h in logs) / 2)
    assert len(logs) == 2 and "rewards/length_reward/mean" in logs[0] and "rewards/dense/sum_mean" in logs[0]
    assert len(seen["topic"]) == 4 and len(seen["env"]) == 4
    assert logs[-1]["dense/reward_mean"] == pytest.approx(0.5 * logs[-1]["tokens/response_len_mean"], rel=1e-5)


def test_reward_rises_on_toy_task(tmp_path, tokenizer):
    """+1 per token id < 300 (about 30% of the vocabulary at init): the mean reward climbs within 20 steps."""

    @dense_reward
    def low_ids(prompts, completions, completion_ids, **kw):
        return [[1.0 if t < 300 else 0.0 for t in ids] for ids in completion_ids]

    model = build_causal_lm("qwen2", tokenizer, seed=0)
    ds = Dataset.from_dict({"prompt": SHORT_PROMPTS * 8})
    args = _args(
        tmp_path,
        batch_size=8,
        mini_batch_size=8,
        ppo_epochs=4,
        max_new_tokens=8,
        learning_rate=1e-2,
        max_steps=20,
        init_kl_coef=0.0,
        adap_kl_ctrl=False,
    )
    trainer = PPOTrainer(model, reward_funcs=low_ids, args=args, processing_class=tokenizer, train_dataset=ds)
    trainer.train()
    curve = [h["dense/reward_mean"] for h in step_logs(trainer)]
    assert sum(curve[-5:]) / 5 > sum(curve[:5]) / 5 + 1.5, curve


def test_train_conversational_prompts(tmp_path, tokenizer):
    seen = {}

    def reward(prompts, completions, **kw):
        seen["prompt"], seen["completion"] = prompts[0], completions[0]
        return [1.0] * len(completions)

    model = build_causal_lm("qwen2", tokenizer, seed=0)
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Say something nice."}]] * 4})
    trainer = PPOTrainer(
        model, reward_funcs=reward, args=_args(tmp_path, max_steps=1), processing_class=tokenizer, train_dataset=ds
    )
    _, ids = trainer._prompt_ids([ds[0]])
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")
    trainer.train()
    assert seen["prompt"][0]["role"] == "user" and seen["completion"][0]["role"] == "assistant"


def test_truncated_share_is_logged(tmp_path, tokenizer):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    trainer = PPOTrainer(model, args=_args(tmp_path, logging_steps=1), processing_class=tokenizer)
    eos = tokenizer.eos_token_id
    # one of four responses ends with EOS, three were cut at the cap
    responses = [torch.tensor([5, 6, eos]), torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10]), torch.tensor([11, 12])]
    trainer.step(_queries(tokenizer), responses, [[0.0] * len(r) for r in responses], scores=[1.0, 0.0, 0.5, 0.2])
    assert trainer.state.log_history[-1]["tokens/truncated_frac"] == pytest.approx(0.75)


# ------------------------------------------------------------------ bad token ids, turn ids and sampler log-probs
def _guarded_model(model):
    """`model`, failing the test when called: each refusal below comes before any forward."""

    def fail(module, args, kwargs):
        raise AssertionError(f"{type(module).__name__} ran before the bad input was refused")

    model.register_forward_pre_hook(fail, with_kwargs=True)
    return model


def _gpt2_trainer(tmp_path, tokenizer, **kw):
    model = _guarded_model(build_causal_lm("gpt2", tokenizer, seed=0))
    return PPOTrainer(model, args=_args(tmp_path, **kw), processing_class=tokenizer)


RESPONSES = [torch.tensor([5, 6, 7])] * 4


@pytest.mark.parametrize("where", ["above", "at", "negative"])
def test_step_refuses_a_token_id_outside_the_vocabulary(tmp_path, tokenizer, where):
    trainer = _gpt2_trainer(tmp_path, tokenizer)
    vocab = trainer.policy.get_input_embeddings().num_embeddings
    value = {"above": vocab + 3, "at": vocab, "negative": -1}[where]
    responses = [*RESPONSES[:1], torch.tensor([5, value, 7]), *RESPONSES[2:]]
    message = (
        rf"responses\[1\] holds token id {value} at position 1, outside \[0, {vocab}\).*from this tokenizer/model"
    )
    with pytest.raises(ValueError, match=message):
        trainer.step(_queries(tokenizer), responses, scores=[1.0] * 4)
    queries = _queries(tokenizer)
    queries[2] = torch.cat([queries[2], torch.tensor([value])])
    with pytest.raises(ValueError, match=rf"queries\[2\] holds token id {value} at position {len(queries[2]) - 1}"):
        trainer.step(queries, RESPONSES, scores=[1.0] * 4)


def test_step_refuses_float_token_ids(tmp_path, tokenizer):
    trainer = _gpt2_trainer(tmp_path, tokenizer)
    queries = _queries(tokenizer)
    queries[0] = torch.tensor([5.7, 6.2])  # was truncated to [5, 6] without a word
    with pytest.raises(ValueError, match=r"queries\[0\] has dtype torch.float32; token ids are integers"):
        trainer.step(queries, RESPONSES, scores=[1.0] * 4)
    responses = [*RESPONSES[:3], torch.tensor([5.0, 6.0], dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"responses\[3\] has dtype torch.float64"):
        trainer.step(_queries(tokenizer), responses, scores=[1.0] * 4)


def test_generate_refuses_bad_token_ids(tmp_path, tokenizer):
    trainer = _gpt2_trainer(tmp_path, tokenizer)
    vocab = trainer.policy.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"query_tensor\[1\] holds token id {vocab + 3} at position 0, outside"):
        trainer.generate([torch.tensor([5]), torch.tensor([vocab + 3])])
    with pytest.raises(ValueError, match=r"query_tensor has dtype torch.float32; token ids are integers"):
        trainer.generate(torch.tensor([5.0, 6.0]))


@pytest.mark.parametrize("bad", ["id", "float"])
def test_train_dataset_input_ids_are_checked_at_start_up_naming_the_row(tmp_path, tokenizer, bad):
    model = build_causal_lm("gpt2", tokenizer, seed=0)
    vocab = model.get_input_embeddings().num_embeddings
    if bad == "id":
        rows, message = [[5, 6], [7, 8], [9, 10], [12, vocab + 3]], rf"row 3 holds token id {vocab + 3} at position 1"
    else:  # arrow stores the column as floats
        rows, message = [[5.0, 6.0], [7.0, 8.5]], "row 0 has dtype torch.float32; token ids are integers"
    with pytest.raises(ValueError, match=f"the input_ids of train_dataset {message}"):
        PPOTrainer(
            _guarded_model(model),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=_args(tmp_path, max_steps=1),
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"input_ids": rows}),
        )


def test_turn_ids_must_be_integers(tmp_path, tokenizer):
    trainer = _gpt2_trainer(tmp_path, tokenizer)
    turns = [[0, 0, 1]] * 3 + [[0, 0.5, 1]]
    with pytest.raises(ValueError, match=r"turn_ids\[3\] has dtype torch.float32; turn ids are integers"):
        trainer.step(_queries(tokenizer), RESPONSES, scores=[1.0] * 4, turn_ids=turns)


@pytest.mark.parametrize(("value", "shown"), [(0.25, "0.25"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_sampler_logprobs_must_be_log_probabilities(tmp_path, tokenizer, value, shown):
    trainer = _gpt2_trainer(tmp_path, tokenizer, use_decoupled_loss=True)
    sampler = [torch.full((3,), -2.0) for _ in range(4)]
    sampler[2][1] = value
    with pytest.raises(ValueError, match=rf"sampler_logprobs\[2\] holds {shown} at position 1.*finite and <= 0"):
        trainer.step(_queries(tokenizer), RESPONSES, scores=[1.0] * 4, sampler_logprobs=sampler)


def test_sampler_logprobs_nan_means_not_reported(tmp_path, tokenizer):
    # vLLM's None (and TRL's GRPO's NaN): that token is left uncorrected, weight 1
    trainer = PPOTrainer(
        build_causal_lm("gpt2", tokenizer, seed=0),
        args=_args(tmp_path, use_decoupled_loss=True),
        processing_class=tokenizer,
    )
    batch, _ = trainer.rollout_pass(trainer.make_batch(_queries(tokenizer), RESPONSES))
    sampler = [batch["old_logprobs"][i, :3].clone() for i in range(4)]
    sampler[1][0] = float("nan")
    stats = trainer.step(_queries(tokenizer), RESPONSES, scores=[1.0] * 4, sampler_logprobs=sampler)
    assert stats["behaviour_weight/mean"] == pytest.approx(1.0) and stats["behaviour_weight/min"] == pytest.approx(1.0)
