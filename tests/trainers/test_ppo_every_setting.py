"""Every field of `PPOConfig` does something, or is refused by name with what to use instead (issue 21, item 3).

`TABLE` has one entry per field of ``dataclasses.fields(PPOConfig)``, and `test_table_covers_every_field` fails,
naming it, for a field a new transformers, TRL or trl_stable adds. The kinds of entry (`Effect`, `Refused`,
`Dependent`), the probes and entries of the `TrainingArguments` fields PPO honours as `transformers.Trainer` does, and
the tests that enumerate the table are shared with GRPO's table (`setting_table.py`, which says what each kind shows).

Fields that act only on hardware or launches this machine lacks (CUDA, several processes or nodes) show that the value
reaches the component that uses it (accelerate's plugin or state, the DeepSpeed config, TrainingArguments' own
per-process flags), or that the trainer refuses it here with a clear error; their entries say so. `docs/ppo.md` has
the same table in words.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.utils import DynamoBackend, set_seed
from datasets import Dataset
from setting_table import (
    PROMPTS,
    TMP,
    UNSUPPORTED,
    Ctx,
    Dependent,
    Effect,
    Kit,
    Recorder,
    Refused,
    Run,
    StepCounter,
    id_reward,
    isolated,
    length_reward,
    record_method,
    table_tests,
    tracked,
    training_argument_entries,
    training_argument_probes,
)
from setting_table import check as _assert
from setting_table import dependent as _dependent
from setting_table import stat as _stat
from test_ppo_vllm import FakeGeneration
from tiny_configs import step_logs

import trl_stable.trainers.ppo.loop_events as ppo_loop_events
import trl_stable.trainers.ppo.vllm as ppo_vllm
from trl_stable import PPOConfig, PPOTrainer
from trl_stable.rewards.failure_guard import RewardComponentFailure
from trl_stable.testing import MOE_FAMILIES, build_causal_lm, save_tiny
from trl_stable.trainers.ppo.rollout import trim_response
from trl_stable.trainers.ppo.value_head import ValueHead

# Every probe's config: 4 prompts per step in one micro-batch, one PPO epoch, 4 new tokens, one step.
BASE = dict(
    batch_size=4,
    per_device_train_batch_size=4,
    ppo_epochs=1,
    max_new_tokens=4,
    max_prompt_length=16,
    max_steps=1,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
)


def build(ctx: Ctx, args: PPOConfig, model=None, rewards=(length_reward,), dataset=None, **kwargs) -> PPOTrainer:
    model = build_causal_lm("qwen2", ctx.tokenizer, seed=0) if model is None else model
    dataset = Dataset.from_dict({"prompt": PROMPTS}) if dataset is None else dataset
    return PPOTrainer(
        model, reward_funcs=list(rewards), args=args, processing_class=ctx.tokenizer, train_dataset=dataset, **kwargs
    )


def _refusal_build(ctx: Ctx, args: PPOConfig) -> PPOTrainer:
    """A policy by name with a LoRA adapter: how the quantization settings are used."""
    from peft import LoraConfig

    path = save_tiny(ctx.tmp / "policy", build_causal_lm("qwen2", ctx.tokenizer, seed=0), ctx.tokenizer)
    return PPOTrainer(
        path, args=args, processing_class=ctx.tokenizer, peft_config=LoraConfig(r=2, target_modules="all-linear")
    )


KIT = Kit(
    config_cls=PPOConfig,
    base=BASE,
    build=build,
    model=lambda trainer: trainer.policy,
    trained=lambda trainer: trainer.unwrapped(),
    train_loader=lambda trainer: trainer.train_dataloader,
    clear_cache_module=ppo_loop_events,
    refusal_build=_refusal_build,
)
PROBES = training_argument_probes()


def forward_sizes(trainer: PPOTrainer, seen: list) -> None:
    """Record (rows, grad enabled) of every policy + value forward."""

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        if kwargs.get("generation_kwargs") is None:
            seen.append((ids.shape[0], torch.is_grad_enabled()))

    trainer.unwrapped().register_forward_pre_hook(hook, with_kwargs=True)


# ---------------------------------------------------------------------------------------------------- probes
@PROBES.register("compile", "seed", "reference")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields))  # built, not trained (compilation is lazy: a forward would compile)
    return Run(trainer.args, trainer)


@PROBES.register("batches")
def _(ctx, fields):
    recorder, sizes, generated = Recorder(), [], []
    trainer = ctx.build(ctx.config(fields), callbacks=[recorder])
    forward_sizes(trainer, sizes)
    record_method(ctx, trainer, "generate", generated, lambda args, kwargs, out: len(args[0]))
    run = Run(trainer.args, trainer, trainer.train())
    backward_passes = sum(1 for _, grad in sizes if grad)
    run.seen.update(sizes=sizes, generated=generated, forwards_per_step=backward_passes / len(recorder.lrs))
    return run


@PROBES.register("micro")
def _(ctx, fields):
    sizes = []
    trainer = ctx.build(ctx.config(fields))
    forward_sizes(trainer, sizes)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["sizes"] = sizes
    return run


@PROBES.register("vf_coef", "activation_checkpointing", "gradient_checkpointing", "step_mask")
def _(ctx, fields):
    return ctx.train(fields)


def _logit_dtypes(trainer: PPOTrainer, seen: list) -> None:
    head = trainer.policy.get_output_embeddings()
    head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))


@PROBES.register("precision", "precision_fp16")
def _(ctx, fields):
    dtypes = []
    trainer = ctx.build(ctx.config(fields))
    _logit_dtypes(trainer, dtypes)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["dtypes"] = set(dtypes)
    return run


def _checkpointed_layers(run: Run) -> list[tuple[bool, dict | None]]:
    return [
        (bool(layer.gradient_checkpointing), layer._gradient_checkpointing_func.keywords)
        if getattr(layer, "gradient_checkpointing", False)
        else (False, None)
        for layer in run.trainer.policy.model.layers
    ]


@PROBES.register("cache")
def _(ctx, fields):
    outputs = []
    trainer = ctx.build(ctx.config(fields))

    def hook(module, args, kwargs, out):
        if torch.is_grad_enabled():
            outputs.append(getattr(out, "past_key_values", None) is not None)

    trainer.policy.register_forward_hook(hook, with_kwargs=True)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["caches"] = outputs
    return run


@PROBES.register("nan_filter")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields, max_steps=2))
    original = trainer._train_step

    def first_step_nan(rows):  # the loss of a diverged step, as train() collects it
        stats = dict(original(rows))
        if trainer.state.global_step == 1:
            stats["loss/total"] = math.nan
        return stats

    ctx.monkeypatch.setattr(trainer, "_train_step", first_step_nan)
    return Run(trainer.args, trainer, trainer.train())


@PROBES.register("tokens")
def _(ctx, fields):
    masks = []
    trainer = ctx.build(ctx.config(fields, max_steps=2))
    record_method(ctx, trainer, "make_batch", masks, lambda args, kwargs, out: int(out["attention_mask"].sum()))
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["real_tokens"] = sum(masks)
    return run


@PROBES.register("eval")
def _(ctx, fields):
    batches = []
    eval_dataset = Dataset.from_dict({"prompt": PROMPTS[:3]})
    trainer = ctx.build(ctx.config(fields, max_steps=4), eval_dataset=eval_dataset)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["evals"] = [entry["step"] for entry in trainer.state.log_history if "eval_reward" in entry]
    record_method(ctx, trainer, "generate", batches, lambda args, kwargs, out: len(args[0]))
    trainer.evaluate()  # an explicit evaluation, after training
    run.seen["explicit_eval_batches"] = batches
    return run


@PROBES.register("eval_batches")
def _(ctx, fields):
    batches = []
    eval_dataset = Dataset.from_dict({"prompt": PROMPTS[:3]})
    trainer = ctx.build(ctx.config(fields, per_device_eval_batch_size=2), eval_dataset=eval_dataset)
    record_method(ctx, trainer, "generate", batches, lambda args, kwargs, out: len(args[0]))
    trainer.evaluate()
    return Run(trainer.args, trainer, seen={"eval_batches": batches})


@PROBES.register("resume")
def _(ctx, fields):
    save = dict(save_strategy="steps", save_steps=1)
    first = ctx.build(ctx.config({}, **save), callbacks=[StepCounter()])
    epoch0 = [[row["prompt"] for row in batch] for batch in first.train_dataloader]
    first.train()  # one step: checkpoint-1
    counter, steps = StepCounter(), []
    trainer = ctx.build(ctx.config(fields, max_steps=2, **save), callbacks=[counter])
    original = trainer._train_step

    def recording(rows):
        steps.append((trainer.state.global_step, [row["prompt"] for row in rows]))
        return original(rows)

    ctx.monkeypatch.setattr(trainer, "_train_step", recording)
    run = Run(trainer.args, trainer, trainer.train())
    counters = [c for c in trainer.callback_handler.callbacks if isinstance(c, StepCounter)]
    run.seen.update(epoch0=epoch0, steps=steps, counter=counter, counters=counters)
    return run


def _first_epoch(run: Run) -> list[str]:
    return [row["prompt"] for batch in run.trainer.train_dataloader for row in batch]


@PROBES.register("data_seed", "group_by_length")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields), dataset=_length_dataset())
    return Run(trainer.args, trainer)


def _length_dataset() -> Dataset:
    # `length`: the characters of each prompt; `n_tokens`: the reverse order (what a precomputed column may hold)
    lengths = [len(p) for p in PROMPTS]
    rank = {n: i for i, n in enumerate(sorted(lengths))}
    return Dataset.from_dict(
        {"prompt": PROMPTS, "length": lengths, "n_tokens": [len(PROMPTS) - 1 - rank[n] for n in lengths]}
    )


def _grouped_by(run: Run, column: str) -> bool:
    """Trainer's length grouping, per PPO batch: each batch sorted by `column`, longest first (transformers swaps the
    dataset's longest row to the front of the first batch, so the first row of a batch is left out)."""
    dataset = _length_dataset()
    value = dict(zip(dataset["prompt"], dataset[column]))
    batches = [[value[row["prompt"]] for row in batch] for batch in run.trainer.train_dataloader]
    return all(batch[1:] == sorted(batch[1:], reverse=True) for batch in batches)


@PROBES.register("accelerator")
def _(ctx, fields):
    deferred = []
    trainer = ctx.build(ctx.config(fields, per_device_train_batch_size=2, gradient_accumulation_steps=2))
    original = trainer.accelerator.no_sync

    def no_sync(model):
        deferred.append(1)
        return original(model)

    ctx.monkeypatch.setattr(trainer.accelerator, "no_sync", no_sync)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["deferred_syncs"] = len(deferred)
    return run


def _accelerator_settings(run: Run):
    accelerator, loader = run.trainer.accelerator, run.trainer.train_dataloader
    assert (accelerator.even_batches, accelerator.use_seedable_sampler) == (False, False)
    assert accelerator.non_blocking is True and accelerator.dispatch_batches is False
    assert type(loader.base_dataloader.batch_sampler.sampler).__name__ == "RandomSampler"  # not accelerate's seedable
    assert run.seen["deferred_syncs"] == 0  # sync_each_batch: no micro-batch defers the gradient all-reduce


@PROBES.register("by_name")
def _(ctx, fields):
    path = save_tiny(ctx.tmp / "policy", build_causal_lm("qwen2", ctx.tokenizer, seed=0), ctx.tokenizer)
    fields = {k: (path if k == "model_name" else v) for k, v in fields.items()}
    model = None if "model_name" in fields else path
    args = ctx.config(fields)
    trainer = PPOTrainer(model, reward_funcs=[length_reward], args=args, processing_class=ctx.tokenizer)
    return Run(args, trainer, seen={"model_arg": model, "path": path})


@PROBES.register("dropout")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields), model=build_causal_lm("gpt2", ctx.tokenizer, seed=0))  # dropout 0.1
    return Run(trainer.args, trainer)


def _rollout_batches(ctx: Ctx, trainer: PPOTrainer, seen: list) -> None:
    record_method(ctx, trainer, "rollout_pass", seen, lambda args, kwargs, out: out[0])


@PROBES.register("kl")
def _(ctx, fields):
    batches = []
    trainer = ctx.build(ctx.config(fields, learning_rate=1e-2, max_steps=2))
    _rollout_batches(ctx, trainer, batches)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["batches"] = batches
    return run


def _kl_coefs(run: Run) -> list[float]:
    return [entry["objective/kl_coef"] for entry in run.logs]


@PROBES.register("adaptive")
def _(ctx, fields):
    run = ctx.train(fields, learning_rate=1e-2, kl_penalty="abs", max_steps=3)
    return run


@PROBES.register("update", "ratio", "target_kl")
def _(ctx, fields):
    return ctx.train(fields, learning_rate=1e-2, ppo_epochs=2, per_device_train_batch_size=2)


@PROBES.register("early_stop_off")
def _(ctx, fields):
    # a learning rate of 1 moves the policy by more than 1.5 x target_kl (6) within a step
    return ctx.train(fields, learning_rate=1.0, ppo_epochs=4, per_device_train_batch_size=2)


def _advantage_calls(ctx: Ctx, trainer: PPOTrainer, seen: list) -> None:
    record_method(
        ctx,
        trainer,
        "compute_advantages",
        seen,
        lambda args, kwargs, out: {"batch": args[0], "out": out[0], "kl_coef": trainer.kl_ctl.value},
    )


def _gae_run(ctx: Ctx, fields: dict, **base) -> Run:
    calls = []
    trainer = ctx.build(ctx.config(fields, **base))
    _advantage_calls(ctx, trainer, calls)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["call"] = calls[0]
    return run


@PROBES.register("gae")
def _(ctx, fields):
    return _gae_run(ctx, fields)


@PROBES.register("lam_vapo")
def _(ctx, fields):
    return _gae_run(ctx, fields)


@PROBES.register("lam_relative")
def _(ctx, fields):
    return _gae_run(ctx, fields, lam_schedule="relative_position")


def _reference_returns(call: dict, eos: int, gamma: float, lam: Callable[[int], float], whiten: bool, bootstrap: bool):
    """GAE by hand: the per-token reward -kl_coef KL + dense + score on the last token (whitened keeping its mean),
    then A_t = delta_t + gamma lam A_{t+1}, delta_t = r_t + gamma V_{t+1} - V_t; the returns A + V."""
    batch = call["batch"]
    mask = batch["response_mask"].double()
    rewards = -call["kl_coef"] * batch["kl"].double() * mask + batch["dense_rewards"].double()
    lengths = mask.sum(1).long()
    for i, length in enumerate(lengths.tolist()):
        rewards[i, length - 1] += float(batch["scores"][i])
    rewards = rewards * mask
    if whiten:
        n = mask.sum()
        mean = rewards.sum() / n
        var = ((rewards - mean) ** 2 * mask).sum() / (n - 1)
        rewards = ((rewards - mean) / torch.sqrt(var + 1e-8) + mean) * mask
    values = batch["values"].double() * mask
    returns = torch.zeros_like(values)
    for i, length in enumerate(lengths.tolist()):
        ended = int(batch["response_ids"][i, length - 1]) == eos
        next_value = float(batch["bootstrap_values"][i]) if bootstrap and not ended else 0.0
        advantage = 0.0
        for t in reversed(range(length)):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            advantage = delta + gamma * lam(length) * advantage
            returns[i, t] = advantage + float(values[i, t])
            next_value = float(values[i, t])
    return returns, mask


def _check_returns(run: Run, **override):
    args = run.args
    schedule = override.pop("schedule", args.lam_schedule)
    alpha, q = override.pop("alpha", args.lam_alpha), override.pop("q", args.lam_q)
    lam = override.pop("lam", args.lam)
    if schedule == "vapo":
        lam_of = lambda n: max(0.0, 1.0 - 1.0 / (alpha * n))  # noqa: E731
    elif schedule == "relative_position":
        lam_of = lambda n: 1.0 if n == 1 else q ** (1.0 / (n - 1))  # noqa: E731
    else:
        lam_of = lambda n: lam  # noqa: E731
    settings = dict(gamma=args.gamma, whiten=args.whiten_rewards, bootstrap=args.bootstrap_truncated)
    settings.update(override)
    expected, mask = _reference_returns(run.seen["call"], run.trainer.eos_token_id, lam=lam_of, **settings)
    actual = run.seen["call"]["out"]["returns"].double() * mask
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@PROBES.register("reward_weights", "gdpo")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields), rewards=(length_reward, id_reward))
    return Run(trainer.args, trainer, trainer.train())


QUERIES = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9, 10]), torch.tensor([11])]
RAW_SCORES = [1.0, 2.0, 3.0, 5.0]


@PROBES.register("scores")
def _(ctx, fields):
    calls = []
    trainer = ctx.build(ctx.config(fields))
    _advantage_calls(ctx, trainer, calls)
    responses = trainer.generate(QUERIES, return_prompt=False)
    trainer.step(QUERIES, responses, scores=RAW_SCORES)
    return Run(trainer.args, trainer, seen={"scores": calls[0]["batch"]["scores"]})


def _scaled(run: Run, scaling=None, norm=None, clip="args") -> torch.Tensor:
    """Old TRL's score options by hand: / running std (unbiased, one batch seen), - running mean first, clip."""
    args = run.args
    scaling = args.use_score_scaling if scaling is None else scaling
    norm = args.use_score_norm if norm is None else norm
    clip = args.score_clip if clip == "args" else clip
    raw = torch.tensor(RAW_SCORES, dtype=torch.float64)
    out = raw
    if scaling:
        out = ((raw - raw.mean()) if norm else raw) / raw.std()
    if clip is not None:
        out = out.clamp(-clip, clip)
    return out.float()


@PROBES.register("nan_reward")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields))
    responses = trainer.generate(QUERIES, return_prompt=False)
    stats = trainer.step(QUERIES, responses, scores=[math.nan, 1.0, 2.0, 3.0])
    return Run(trainer.args, trainer, seen={"stats": stats})


@PROBES.register("big_reward")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields))
    responses = trainer.generate(QUERIES, return_prompt=False)
    stats = trainer.step(QUERIES, responses, scores=[1.0, 2.0, 50.0, 3.0])
    return Run(trainer.args, trainer, seen={"stats": stats})


def broken_reward(completions, **kwargs):
    raise KeyError("topic")


@PROBES.register("failing_reward")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields, max_steps=2, nan_reward_action="zero"), rewards=(broken_reward,))
    run = Run(trainer.args, trainer)
    try:
        run.output = trainer.train()
    except RewardComponentFailure as err:
        run.seen["stopped"] = (trainer.state.global_step, str(err))
    return run


def _generated(ctx: Ctx, fields: dict, **base) -> Run:
    queries, responses, calls = [], [], []
    trainer = ctx.build(ctx.config(fields, **base))
    record_method(
        ctx,
        trainer,
        "generate",
        queries,
        lambda args, kwargs, out: (responses.extend(len(r) for r in out), [len(q) for q in args[0]])[1],
    )
    record_method(ctx, trainer.policy, "generate", calls, lambda args, kwargs, out: kwargs["max_new_tokens"])
    run = Run(trainer.args, trainer, trainer.train())
    run.seen.update(query_lengths=[n for step in queries for n in step], lengths=responses, caps=calls)
    return run


@PROBES.register("generation", "generation_kwargs", "length_sampler")
def _(ctx, fields):
    return _generated(ctx, fields)


@PROBES.register("temperature")
def _(ctx, fields):
    logits = []
    trainer = ctx.build(ctx.config(fields))

    def rollout_with_logits(batch):
        with torch.no_grad():  # the policy's raw logits, by a forward of our own, before any update
            out = trainer.policy(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits
        result = original(batch)
        logits.append((out, result[0]))
        return result

    original = trainer.rollout_pass
    ctx.monkeypatch.setattr(trainer, "rollout_pass", rollout_with_logits)
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["logits"] = logits[0]
    return run


def _check_temperature(run: Run, temperature: float):
    logits, batch = run.seen["logits"]
    width = batch["response_ids"].shape[1]
    scores = logits[:, -width - 1 : -1].float() / temperature
    expected = torch.log_softmax(scores, -1).gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["old_logprobs"][mask], expected[mask], rtol=1e-4, atol=1e-4)


@PROBES.register("top_k", "top_p")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields))
    sampled = [trainer.generate(QUERIES, return_prompt=False) for _ in range(2)]
    greedy = []
    for q in QUERIES:
        out = trainer.policy.generate(
            input_ids=q.unsqueeze(0), attention_mask=torch.ones(1, len(q), dtype=torch.long), do_sample=False,
            max_new_tokens=trainer.args.max_new_tokens, pad_token_id=trainer.pad_token_id,
        )  # fmt: skip
        greedy.append(trim_response(out[0, len(q) :], trainer.eos_token_id).tolist())
    return Run(trainer.args, trainer, seen={"sampled": [[r.tolist() for r in s] for s in sampled], "greedy": greedy})


def _greedy(run: Run):
    assert all(s == run.seen["greedy"] for s in run.seen["sampled"])


@PROBES.register("fused")
def _(ctx, fields):
    labelled = []
    trainer = ctx.build(ctx.config(fields))
    trainer.unwrapped().register_forward_pre_hook(
        lambda module, args, kwargs: labelled.append(kwargs.get("labels") is not None), with_kwargs=True
    )
    run = Run(trainer.args, trainer, trainer.train())
    run.seen["labelled"] = labelled
    return run


@PROBES.register("moe")
def _(ctx, fields):
    trainer = ctx.build(ctx.config(fields), model=build_causal_lm(MOE_FAMILIES[0], ctx.tokenizer, seed=0))
    return Run(trainer.args, trainer, trainer.train())


# Behaviour weights w = exp(logp_rollout_pass - logp_sampler) the decoupled probes hand to step(), per sample.
CRAFTED_WEIGHTS = [3.0, 0.3, 1.0, 0.05]


def _decoupled(ctx: Ctx, fields: dict, weights: Callable[[int, int], float], **base) -> Run:
    trainer = ctx.build(ctx.config(fields, **base))
    responses = list(trainer.generate(QUERIES, return_prompt=False))
    with torch.no_grad():
        rollout, _ = trainer.rollout_pass(trainer.make_batch(QUERIES, responses))
    sampler = [
        torch.tensor([float(rollout["old_logprobs"][i, t]) - math.log(weights(i, t)) for t in range(len(r))])
        for i, r in enumerate(responses)
    ]
    stats = trainer.step(QUERIES, responses, scores=[1.0, 0.0, 1.0, 0.0], sampler_logprobs=sampler)
    return Run(trainer.args, trainer, seen={"stats": stats, "lengths": [len(r) for r in responses]})


@PROBES.register("decoupled_clamp")
def _(ctx, fields):
    return _decoupled(ctx, fields, lambda i, t: CRAFTED_WEIGHTS[i])


def _clamped_share(run: Run, lower=None, upper=None) -> None:
    args_lower, args_upper = run.args.filter_bounds
    lower, upper = lower or args_lower, upper or args_upper
    key = "token_filter/icepop/clamped_token_frac"
    assert key in run.seen["stats"]
    lengths = run.seen["lengths"]
    out_of_band = sum(n for n, w in zip(lengths, CRAFTED_WEIGHTS) if not lower <= w <= upper)
    assert run.seen["stats"][key] == pytest.approx(out_of_band / sum(lengths))


@PROBES.register("decoupled_level")
def _(ctx, fields):
    # sample 0: one token far above the band (8) among weights 1, whose geometric mean stays in the band
    return _decoupled(
        ctx,
        fields,
        lambda i, t: (8.0 if t == 0 else 1.0) if i == 0 else CRAFTED_WEIGHTS[i],
        use_decoupled_loss=True,
        token_filter="icepop",
    )


def _masked_share_by_sequence(run: Run):
    lengths, stats = run.seen["lengths"], run.seen["stats"]
    assert lengths[0] > 1
    # sequence level: samples 1 (0.3) and 3 (0.05) masked whole, sample 0 kept (geometric mean 8^(1/n) <= 5)
    assert stats["token_filter/icepop/masked_token_frac"] == pytest.approx((lengths[1] + lengths[3]) / sum(lengths))


@PROBES.register("health_stop")
def _(ctx, fields):
    # grad_norm_vanishing (a critical alarm) holds from the first step when any grad norm counts as near zero
    kwargs = {"grad_norm_floor": 1e9, "patience": 1}
    return ctx.train(fields, max_steps=3, health_monitor_kwargs=kwargs, save_strategy="no")


def _vllm(ctx: Ctx, fields: dict, **base) -> Run:
    FakeGeneration.instances = []
    ctx.monkeypatch.setattr(ppo_vllm, "VLLMGeneration", FakeGeneration)
    path = save_tiny(ctx.tmp / "policy", build_causal_lm("qwen2", ctx.tokenizer, seed=0), ctx.tokenizer)
    args = ctx.config(fields, **base)
    trainer = PPOTrainer(path, reward_funcs=[length_reward], args=args, processing_class=ctx.tokenizer)
    trainer.generate(QUERIES, return_prompt=False)
    helper = FakeGeneration.instances[0] if FakeGeneration.instances else None
    return Run(
        args, trainer, seen={"kwargs": helper.kwargs if helper else {}, "calls": helper.calls if helper else []}
    )


@PROBES.register("vllm_server")
def _(ctx, fields):
    return _vllm(ctx, fields)


@PROBES.register("vllm_host")
def _(ctx, fields):
    return _vllm(ctx, fields, use_vllm=True, vllm_mode="server")


@PROBES.register("vllm_colocate")
def _(ctx, fields):
    return _vllm(ctx, fields, use_vllm=True)


def _helper_got(name: str, value: Any) -> Callable[[Run], None]:
    def check(run: Run):
        assert run.seen["kwargs"].get(name) == value

    return check


@PROBES.register("health")
def _(ctx, fields):
    return ctx.train(fields, max_steps=2)


def _seeded_head(seed: int, run: Run) -> torch.Tensor:
    """The value head the trainer builds first after seeding: set_seed(seed), then ValueHead(hidden size)."""
    set_seed(seed)
    return ValueHead(run.trainer.policy.config.hidden_size).summary.weight


def _shares_first_layer(run: Run) -> bool:
    """The reference holds the policy's own embeddings and first layer (frozen), and a copy of the second."""
    policy, ref = run.trainer.policy.model, run.trainer.ref_model.model
    first = policy.layers[0].self_attn.q_proj.weight
    return (
        ref.layers[0].self_attn.q_proj.weight is first
        and ref.embed_tokens.weight is policy.embed_tokens.weight
        and not first.requires_grad
        and ref.layers[1].self_attn.q_proj.weight is not policy.layers[1].self_attn.q_proj.weight
    )


def _abs_kl(run: Run) -> bool:
    """The rollout pass's per-token KL is |logp - ref_logp| where the two differ in both directions (step 2)."""
    batch = run.seen["batches"][-1]
    mask = batch["response_mask"].bool()
    diff = (batch["old_logprobs"] - batch["ref_logprobs"])[mask]
    return bool((diff < 0).any()) and torch.allclose(batch["kl"][mask], diff.abs(), atol=1e-6)


def _horizon_step(run: Run) -> bool:
    """Ziegler's controller by hand for the first update: coef *= 1 + clip(kl / target - 1, +-0.2) * n / horizon."""
    coefs, kl = _kl_coefs(run), run.logs[0]["objective/kl"]
    error = min(max(kl / run.args.target - 1, -0.2), 0.2)
    return coefs[1] / coefs[0] == pytest.approx(1 + error * run.args.batch_size / 10.0, rel=1e-6)


def _parallelism_config():
    from accelerate import ParallelismConfig

    return ParallelismConfig()


def _health(name: str, value: Any) -> Callable[[Run], None]:
    return lambda run: _assert(
        run.trainer.health_monitor is not None and getattr(run.trainer.health_monitor.config, name) == value
    )


TABLE: dict[str, Effect | Refused | Dependent] = {
    **training_argument_entries(),
    # --- TrainingArguments: output and length
    # --- batch structure (TRL's PPO mapping: the micro-batch, accumulation, mini-batches)
    "per_device_train_batch_size": Effect(
        2,
        "batches",
        lambda run: _assert({n for n, _ in run.seen["sizes"]} == {2}),
        note="the micro-batch: every forward of the rollout and update passes",
    ),
    "gradient_accumulation_steps": Effect(
        2,
        "batches",
        lambda run: _assert(run.seen["forwards_per_step"] == 2),
        note="backward passes (micro-batches) per optimizer step",
    ),
    "average_tokens_across_devices": Refused(True, UNSUPPORTED),
    # --- optimizer and schedule (Trainer's create_optimizer / create_scheduler)
    "label_smoothing_factor": Refused(0.1, UNSUPPORTED),
    # --- precision and memory
    "bf16": Effect(
        True,
        "precision",
        lambda run: _assert(
            run.trainer.accelerator.mixed_precision == "bf16" and torch.bfloat16 in run.seen["dtypes"]
        ),
        note="on CPU (use_cpu=True, which transformers requires for bf16 there): the passes run under bf16 autocast",
    ),
    "use_cpu": Effect(
        True,
        "precision",
        lambda run: _assert(
            run.args.device.type == "cpu" and run.trainer.train_dataloader.base_dataloader.pin_memory is False
        ),
        note="this machine has no accelerator: the visible effect is transformers switching pinned memory off",
    ),
    "bf16_full_eval": Refused(True, UNSUPPORTED),
    "fp16_full_eval": Refused(True, UNSUPPORTED),
    "activation_checkpointing": Effect(
        True, "activation_checkpointing", lambda run: _assert(run.trainer.policy.is_activation_checkpointing)
    ),
    "activation_checkpointing_kwargs": _dependent(
        {"use_reentrant": True, "every_n_layers": 2},
        "activation_checkpointing=True",
        "activation_checkpointing",
        lambda run: _assert(_checkpointed_layers(run) == [(True, {"use_reentrant": True}), (False, None)]),
    ),
    "gradient_checkpointing": Effect(
        True,
        "gradient_checkpointing",
        lambda run: _assert(run.trainer.policy.is_activation_checkpointing),
        note="transformers' deprecated alias of activation_checkpointing",
    ),
    "gradient_checkpointing_kwargs": _dependent(
        {"use_reentrant": True},
        "activation_checkpointing=True",
        "gradient_checkpointing",
        lambda run: _assert(_checkpointed_layers(run)[0] == (True, {"use_reentrant": True})),
    ),
    "torch_compile": Effect(
        True,
        "compile",
        lambda run: _assert(isinstance(run.trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)),
        note="the PPO passes call the compiled module (test_compiled_step runs one, slow)",
    ),
    "torch_compile_backend": Effect(
        "eager",
        "compile",
        lambda run: _assert(run.trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.EAGER),
    ),
    "torch_compile_mode": Effect(
        "reduce-overhead",
        "compile",
        lambda run: _assert(run.trainer.accelerator.state.dynamo_plugin.mode == "reduce-overhead"),
    ),
    "use_liger_kernel": Refused(True, UNSUPPORTED),
    "liger_kernel_config": Refused({"rope": True}, UNSUPPORTED),
    "use_cache": Effect(
        True,
        "cache",
        lambda run: _assert(run.seen["caches"] and all(run.seen["caches"])),
        note="the policy's training passes build a KV cache (rollouts always generate with one)",
    ),
    "neftune_noise_alpha": Refused(5.0, UNSUPPORTED),
    "auto_find_batch_size": Refused(True, UNSUPPORTED),
    # --- logging
    "logging_nan_inf_filter": Effect(False, "nan_filter", lambda run: _assert(math.isnan(run.output.training_loss))),
    "include_num_input_tokens_seen": Effect(
        "non_padding",
        "tokens",
        lambda run: _assert(
            run.trainer.state.num_input_tokens_seen == run.seen["real_tokens"] > 0
            and run.trainer.state.log_history[-1]["num_input_tokens_seen"] == run.seen["real_tokens"]
        ),
    ),
    # --- evaluation
    "eval_strategy": Effect("steps", "eval", lambda run: _assert(any(s > 0 for s in run.seen["evals"]))),
    "eval_steps": _dependent(
        2, "eval_strategy='steps'", "eval", lambda run: _assert(4 in run.seen["evals"] and 3 not in run.seen["evals"])
    ),
    "eval_delay": _dependent(
        3,
        "eval_strategy='steps' or 'epoch'",
        "eval",
        lambda run: _assert(2 not in run.seen["evals"] and 4 in run.seen["evals"]),
    ),
    "per_device_eval_batch_size": Effect(2, "eval", lambda run: _assert(run.seen["explicit_eval_batches"] == [2, 1])),
    "prediction_loss_only": Refused(True, UNSUPPORTED),
    "eval_on_start": Effect(True, "eval", lambda run: _assert(0 in run.seen["evals"])),
    "eval_do_concat_batches": Refused(False, UNSUPPORTED),
    "eval_use_gather_object": Refused(True, UNSUPPORTED),
    "eval_accumulation_steps": Refused(2, UNSUPPORTED),
    "include_for_metrics": Refused(["inputs"], UNSUPPORTED),
    "batch_eval_metrics": Refused(True, UNSUPPORTED),
    # --- checkpoints
    # --- the Hub (transformers' hf_api replaced by a recorder)
    # --- best model
    # --- resume
    "ignore_data_skip": Effect(
        True, "resume", lambda run: _assert(run.seen["steps"] and run.seen["steps"][0] == (1, run.seen["epoch0"][0]))
    ),
    "restore_callback_states_from_checkpoint": Effect(
        True,
        "resume",
        lambda run: _assert(
            run.seen["counter"] not in run.seen["counters"] and [c.steps for c in run.seen["counters"]] == [2]
        ),
    ),
    "resume_from_checkpoint": Effect(
        f"{TMP}/out/checkpoint-1",
        "resume",
        lambda run: _assert([s for s, _ in run.seen["steps"]] == [1] and run.trainer.state.global_step == 2),
        note="train() without an argument resumes from it (transformers leaves it to your script)",
    ),
    # --- randomness
    "seed": Effect(
        7,
        "seed",
        lambda run: _assert(torch.equal(run.trainer.unwrapped().value_head.summary.weight, _seeded_head(7, run))),
    ),
    "data_seed": _dependent(
        5,
        "a shuffling sampler",
        "data_seed",
        lambda run: _assert(
            _first_epoch(run) == [PROMPTS[i] for i in torch.randperm(8, generator=torch.Generator().manual_seed(5))]
        ),
        off={"train_sampling_strategy": "sequential"},
    ),
    # --- hardware, accelerate and engines
    "accelerator_config": Effect(
        {
            "even_batches": False,
            "use_seedable_sampler": False,
            "non_blocking": True,
            "dispatch_batches": False,
            "gradient_accumulation_kwargs": {"sync_each_batch": True},
        },
        "accelerator",
        _accelerator_settings,
        note="reaches accelerate's Accelerator and the train dataloader; split_batches and the other "
        "gradient_accumulation_kwargs are refused (test_accelerator_config_refusals)",
    ),
    "parallelism_config": Refused(_parallelism_config(), UNSUPPORTED),
    "dataloader_drop_last": Effect(
        True,
        "eval_batches",
        lambda run: _assert(run.seen["eval_batches"] == [2]),
        note="evaluation only, as in Trainer: a training step always takes exactly batch_size prompts",
    ),
    "remove_unused_columns": Refused(True, UNSUPPORTED),
    "label_names": Refused(["labels"], UNSUPPORTED),
    "train_sampling_strategy": Effect(
        "group_by_length",
        "group_by_length",
        lambda run: _assert(_grouped_by(run, run.args.length_column_name)),
        note="'batch_rebalance' is refused (test_sampling_strategies)",
    ),
    "length_column_name": _dependent(
        "n_tokens",
        "train_sampling_strategy='group_by_length'",
        "group_by_length",
        lambda run: _assert(_grouped_by(run, "n_tokens") and not _grouped_by(run, "length")),
    ),
    "debug": Refused("underflow_overflow", "Leave it at ''"),
    "do_train": Refused(True, "trainer.train()", note="a flag for your script, which no trainer reads"),
    "do_eval": Refused(True, "eval_strategy='steps'", note="transformers sets it itself with an eval_strategy"),
    "do_predict": Refused(True, "trainer.evaluate("),
    "local_rank": Refused(1, "Leave local_rank=-1", note="the launcher's local rank must match accelerate's"),
    # --- PPO: models
    "model_name": Effect(
        "<policy>",
        "by_name",
        lambda run: _assert(
            run.seen["model_arg"] is None and run.trainer.policy.config.name_or_path == run.seen["path"]
        ),
    ),
    "model_init_kwargs": Effect(
        {"attn_implementation": "eager"},
        "by_name",
        lambda run: _assert(run.trainer.policy.config._attn_implementation == "eager"),
        note="refused with a model object (test_trainer_arguments_that_override_settings)",
    ),
    "load_in_4bit": Refused(True, "bitsandbytes and a CUDA GPU", at="trainer", note="no CUDA / bitsandbytes here"),
    "load_in_8bit": Refused(True, "bitsandbytes and a CUDA GPU", at="trainer", note="no CUDA / bitsandbytes here"),
    "num_shared_layers": Effect(
        1,
        "reference",
        lambda run: _assert(_shares_first_layer(run)),
        note="refused with ref_model= or a PEFT policy (test_trainer_arguments_...)",
    ),
    "disable_dropout": Effect(
        False,
        "dropout",
        lambda run: _assert(any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in run.trainer.policy.modules())),
    ),
    "log_with": Effect("tensorboard", "tracker", tracked, note="RELC's name of report_to; both at once are refused"),
    # --- PPO: batches
    "batch_size": Effect(8, "batches", lambda run: _assert(run.seen["generated"] == [8])),
    "mini_batch_size": Effect(
        2,
        "micro",
        lambda run: _assert(run.args.per_device_train_batch_size == 2 and {n for n, _ in run.seen["sizes"]} == {2}),
        note="RELC's name of the micro-batch (per_device_train_batch_size)",
    ),
    "ppo_epochs": Effect(2, "batches", _stat("ppo/epochs_done", lambda v: v == 2)),
    # --- PPO: KL
    "kl_penalty": Effect("abs", "kl", lambda run: _assert(_abs_kl(run))),
    "adap_kl_ctrl": Effect(
        False,
        "kl",
        lambda run: _assert(len(set(_kl_coefs(run))) == 1 and run.trainer.kl_ctl.value == _kl_coefs(run)[0]),
    ),
    "init_kl_coef": Effect(
        0.5,
        "kl",
        lambda run: _assert(_kl_coefs(run)[0] == 0.5),
        note="0 with the adaptive controller is refused (it would stay 0)",
    ),
    "target": _dependent(
        1e-4,
        "adap_kl_ctrl=True",
        "adaptive",
        lambda run: _assert(_kl_coefs(run)[2] > _kl_coefs(run)[1]),
        off={"adap_kl_ctrl": False},
    ),
    "horizon": _dependent(
        10.0, "adap_kl_ctrl=True", "adaptive", lambda run: _assert(_horizon_step(run)), off={"adap_kl_ctrl": False}
    ),
    "target_kl": _dependent(
        1e-6,
        "early_stopping=True",
        "target_kl",
        _stat("ppo/early_stop", lambda v: v == 1.0),
        off={"early_stopping": False},
    ),
    "early_stopping": Effect(
        False,
        "early_stop_off",
        lambda run: _assert(all(e["ppo/early_stop"] == 0 and e["ppo/epochs_done"] == 4 for e in run.logs)),
    ),
    # --- PPO: losses
    "cliprange": Effect(10.0, "update", _stat("policy/clipfrac", lambda v: v == 0)),
    "cliprange_value": Effect(10.0, "update", _stat("val/clipfrac", lambda v: v == 0)),
    "vf_coef": Effect(
        0.5,
        "vf_coef",
        lambda run: _assert(
            all(e["loss/total"] == pytest.approx(e["loss/policy"] + 0.5 * e["loss/value"], abs=1e-6) for e in run.logs)
        ),
    ),
    "ratio_threshold": Effect(1.0001, "ratio", _stat("ppo/loss_zeroed", lambda v: v > 0)),
    "use_decoupled_loss": Effect(
        True,
        "decoupled_clamp",
        lambda run: _assert(
            run.seen["stats"].get("behaviour_weight/max", 0) == pytest.approx(max(CRAFTED_WEIGHTS), rel=1e-4)
        ),
    ),
    "token_filter": _dependent(
        "icepop",
        "use_decoupled_loss=True",
        "decoupled_clamp",
        lambda run: _assert(any(k.startswith("token_filter/icepop/") for k in run.seen["stats"])),
    ),
    "token_filter_level": _dependent(
        "sequence", "token_filter='icepop'", "decoupled_level", _masked_share_by_sequence
    ),
    "token_filter_action": _dependent(
        "clamp",
        "token_filter='icepop'",
        "decoupled_clamp",
        lambda run: _assert("token_filter/icepop/clamped_token_frac" in run.seen["stats"]),
    ),
    "token_filter_lower": _dependent(
        0.2, "token_filter='icepop'", "decoupled_clamp", lambda run: _clamped_share(run, lower=0.2)
    ),
    "token_filter_upper": _dependent(
        2.0, "token_filter='icepop'", "decoupled_clamp", lambda run: _clamped_share(run, upper=2.0)
    ),
    # --- PPO: advantages
    "gamma": Effect(0.5, "gae", lambda run: _check_returns(run, gamma=0.5)),
    "lam": _dependent(
        0.5, "lam_schedule=None", "gae", lambda run: _check_returns(run, lam=0.5), off={"lam_schedule": "vapo"}
    ),
    "lam_schedule": Effect(
        "vapo",
        "lam_vapo",
        lambda run: _check_returns(run, schedule="vapo"),
        note="refused together with PPOTrainer(lam_fn=...)",
    ),
    "lam_alpha": _dependent(
        0.5, "lam_schedule='vapo'", "lam_vapo", lambda run: _check_returns(run, schedule="vapo", alpha=0.5)
    ),
    "lam_q": _dependent(
        0.3,
        "lam_schedule='relative_position'",
        "lam_relative",
        lambda run: _check_returns(run, schedule="relative_position", q=0.3),
    ),
    "whiten_rewards": Effect(True, "gae", lambda run: _check_returns(run, whiten=True)),
    "whiten_advantages": Effect(
        False,
        "gae",
        lambda run: torch.testing.assert_close(
            run.seen["call"]["out"]["advantages"] * run.seen["call"]["batch"]["response_mask"],
            (run.seen["call"]["out"]["returns"] - run.seen["call"]["out"]["values"])
            * run.seen["call"]["batch"]["response_mask"],
        ),
    ),
    "bootstrap_truncated": Effect(True, "gae", lambda run: _check_returns(run, bootstrap=True)),
    # --- PPO: scores
    "reward_weights": Effect(
        [2.0, 0.5],
        "reward_weights",
        lambda run: _assert(
            all(
                e["env/reward_mean"]
                == pytest.approx(2 * e["rewards/length_reward/mean"] + 0.5 * e["rewards/id_reward/mean"])
                for e in run.logs
            )
        ),
    ),
    "multi_objective_aggregation": Effect(
        "normalize_then_sum",
        "gdpo",
        lambda run: _assert(all(abs(e["env/reward_mean"]) < 1e-5 and e["env/reward_std"] > 0 for e in run.logs)),
    ),
    "use_score_scaling": Effect(
        True, "scores", lambda run: torch.testing.assert_close(run.seen["scores"], _scaled(run, scaling=True))
    ),
    "use_score_norm": _dependent(
        True,
        "use_score_scaling=True",
        "scores",
        lambda run: torch.testing.assert_close(run.seen["scores"], _scaled(run, scaling=True, norm=True)),
    ),
    "score_clip": Effect(
        0.5, "scores", lambda run: torch.testing.assert_close(run.seen["scores"], _scaled(run, clip=0.5))
    ),
    "nan_reward_action": Effect(
        "zero", "nan_reward", lambda run: _assert(run.seen["stats"].get("ppo/zeroed_samples") == 1)
    ),
    "max_abs_reward": Effect(
        10.0, "big_reward", lambda run: _assert(run.seen["stats"].get("ppo/dropped_samples") == 1)
    ),
    "reward_max_failing_steps": Effect(
        1,
        "failing_reward",
        lambda run: _assert(
            run.seen.get("stopped", (None, ""))[0] == 0 and "'broken_reward' failed" in run.seen["stopped"][1]
        ),
        note="the default (5) lets the 2-step run finish with its completions unscored",
    ),
    # --- PPO: generation
    "max_prompt_length": Effect(2, "generation", lambda run: _assert(max(run.seen["query_lengths"]) == 2)),
    "min_new_tokens": Effect(
        1,
        "length_sampler",
        lambda run: _assert(
            len(set(run.seen["caps"])) > 1
            and min(run.seen["caps"]) >= 1
            and max(run.seen["caps"]) <= run.args.max_new_tokens
        ),
    ),
    "max_new_tokens": Effect(2, "generation", lambda run: _assert(max(run.seen["lengths"]) == 2)),
    "temperature": Effect(2.0, "temperature", lambda run: _check_temperature(run, 2.0)),
    "top_k": Effect(1, "top_k", _greedy),
    "top_p": Effect(1e-3, "top_p", _greedy),
    "generation_batch_size": Effect(1, "length_sampler", lambda run: _assert(len(run.seen["caps"]) == 4)),
    "fused_lm_head": Effect(
        True, "fused", lambda run: _assert(run.trainer.fused_policy and any(run.seen["labelled"]))
    ),
    "generation_kwargs": Effect(
        {"max_new_tokens": 2}, "generation_kwargs", lambda run: _assert(max(run.seen["lengths"]) == 2)
    ),
    "step_loss_mask": Effect(True, "step_mask", _stat("step_mask/frac_invalid_steps", lambda v: v >= 0)),
    "step_mask_tools": _dependent(
        ["search"],
        "step_loss_mask=True",
        "step_mask",
        lambda run: _assert(run.trainer.step_masker is not None and "search" in run.trainer.step_masker.tools),
    ),
    "routing_replay": Effect("R2", "moe", lambda run: _assert(any(k.startswith("routing/") for k in run.logs[0]))),
    # --- health monitor
    "health_monitor": Effect(
        False,
        "plain",
        lambda run: _assert(
            run.trainer.health_monitor is None and not any(k.startswith("health/") for k in run.logs[0])
        ),
    ),
    "health_reward_max": _dependent(
        -100.0,
        "health_monitor=True",
        "health",
        lambda run: _assert(run.logs[-1].get("health/alarm/reward_above_max") == 1),
        off={"health_monitor": False},
    ),
    "health_mismatch_threshold": _dependent(
        0.5,
        "health_monitor=True",
        "health",
        _health("mismatch_threshold", 0.5),
        off={"health_monitor": False},
        note="the mismatch alarm reads mismatch/* (use_decoupled_loss)",
    ),
    "health_remedy_virtual_samples": Refused(True, "Leave it False", note="a GRPO remedy; PPO has no groups"),
    "health_stop_after_critical_steps": _dependent(
        1,
        "health_monitor=True",
        "health_stop",
        lambda run: _assert(run.trainer.state.global_step < run.args.max_steps),
        off={"health_monitor": False},
    ),
    "health_mismatch_monitor": Refused(True, "Leave it False", note="PPO logs mismatch/* with use_decoupled_loss"),
    "health_monitor_kwargs": _dependent(
        {"patience": 1}, "health_monitor=True", "health", _health("patience", 1), off={"health_monitor": False}
    ),
    # --- vLLM (TRL's helper replaced by test_ppo_vllm's fake: vLLM does not run on CPU)
    "use_vllm": Effect(True, "vllm_server", lambda run: _assert(run.seen["calls"])),
    "vllm_mode": _dependent("server", "use_vllm=True", "vllm_server", _helper_got("mode", "server")),
    "vllm_server_base_url": _dependent(
        "http://vllm:9", "use_vllm=True", "vllm_server", _helper_got("server_base_url", "http://vllm:9")
    ),
    "vllm_server_host": _dependent("vllm-host", "use_vllm=True", "vllm_host", _helper_got("server_host", "vllm-host")),
    "vllm_server_port": _dependent(9, "use_vllm=True", "vllm_host", _helper_got("server_port", 9)),
    "vllm_server_timeout": _dependent(5.0, "use_vllm=True", "vllm_server", _helper_got("server_timeout", 5.0)),
    "vllm_group_port": _dependent(5, "use_vllm=True", "vllm_server", _helper_got("group_port", 5)),
    "vllm_gpu_memory_utilization": _dependent(
        0.5, "use_vllm=True", "vllm_colocate", _helper_got("gpu_memory_utilization", 0.5)
    ),
    "vllm_tensor_parallel_size": _dependent(
        2, "use_vllm=True", "vllm_colocate", _helper_got("tensor_parallel_size", 2)
    ),
    "vllm_max_model_length": _dependent(64, "use_vllm=True", "vllm_colocate", _helper_got("max_model_length", 64)),
    "vllm_enable_sleep_mode": _dependent(
        True, "use_vllm=True", "vllm_colocate", _helper_got("enable_sleep_mode", True)
    ),
    "vllm_model_impl": _dependent(
        "transformers", "use_vllm=True", "vllm_colocate", _helper_got("model_impl", "transformers")
    ),
}


# ---------------------------------------------------------------------------------------------------- the tests
globals().update(table_tests(KIT, TABLE, PROBES, Path(__file__).resolve().parents[2] / "docs" / "ppo.md"))


# ---------------------------------------------------------------------------------------------------- beyond the table
def test_trainer_arguments_that_override_settings(tmp_path, tokenizer):
    """A PPOTrainer argument that makes a PPOConfig setting meaningless is refused with the setting, not ignored."""
    from peft import LoraConfig

    model = build_causal_lm("qwen2", tokenizer, seed=0)
    args = lambda **kw: PPOConfig(output_dir=str(tmp_path), **{**BASE, **kw})  # noqa: E731
    cases = [
        (dict(args=args(lam_schedule="vapo"), lam_fn=lambda n: n.float() / 10), "lam_schedule='vapo'"),
        (dict(args=args(lam=0.9), lam_fn=lambda n: n.float() / 10), "lam=0.9"),
        (dict(args=args(num_shared_layers=1), ref_model=build_causal_lm("qwen2", tokenizer, seed=1)), "ref_model"),
        (dict(args=args(num_shared_layers=1), peft_config=LoraConfig(r=2, target_modules="all-linear")), "PEFT"),
        (dict(args=args(model_init_kwargs={"attn_implementation": "eager"})), "model_init_kwargs"),
    ]
    for kwargs, named in cases:
        with pytest.raises(ValueError, match=named) as refused:
            PPOTrainer(model, processing_class=tokenizer, **kwargs)
        assert (
            "lam_fn" in str(refused.value)
            or "num_shared_layers" in str(refused.value)
            or "model" in str(refused.value)
        )
    PPOTrainer(model, args=args(), processing_class=tokenizer, lam_fn=lambda n: n.float() / 10)  # lam left alone


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"accelerator_config": {"split_batches": True}}, "split_batches"),
        ({"accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 2}}}, "gradient_accumulation_steps"),
        ({"accelerator_config": {"gradient_accumulation_kwargs": {"adjust_scheduler": False}}}, "adjust_scheduler"),
        ({"train_sampling_strategy": "batch_rebalance"}, "batch_rebalance"),
        ({"optim": "lomo"}, "optim='lomo'"),
        ({"adap_kl_ctrl": True, "init_kl_coef": 0.0}, "init_kl_coef=0"),
        ({"log_with": "wandb", "report_to": "tensorboard"}, "log_with='wandb'"),
        ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
         "metric_for_best_model"),
        ({"use_vllm": True, "vllm_mode": "colocate", "vllm_server_timeout": 5.0}, "vllm_mode='server'"),
        ({"use_vllm": True, "vllm_mode": "server", "vllm_enable_sleep_mode": True}, "vllm_mode='colocate'"),
        ({"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://h:1", "vllm_server_port": 9},
         "vllm_server_base_url=None"),
    ],
)  # fmt: skip
def test_combinations_refused(tmp_path, kwargs, named):
    with isolated(), pytest.raises(ValueError) as refused:
        PPOConfig(output_dir=str(tmp_path), **{**BASE, **kwargs})
    assert named in str(refused.value), str(refused.value)


@pytest.mark.parametrize("optim, cls", [("adafactor", "Adafactor"), ("adagrad", "Adagrad"), ("rmsprop", "RMSprop")])
def test_optimizers_are_transformers(tmp_path, tokenizer, optim, cls):
    ctx = Ctx(tmp_path, tokenizer, None, KIT)
    trainer = ctx.build(ctx.config({"optim": optim}))
    assert type(trainer.optimizer.optimizer).__name__ == cls


def test_galore_needs_its_package(tmp_path, tokenizer):
    """optim_target_modules acts with a GaLore optimizer, which transformers builds from galore_torch (not installed
    here: the trainer raises naming it)."""
    ctx = Ctx(tmp_path, tokenizer, None, KIT)
    args = ctx.config({"optim": "galore_adamw", "optim_target_modules": ["q_proj"]})
    with pytest.raises(ImportError, match="galore"):
        ctx.build(args)


def test_sequential_sampling_keeps_the_dataset_order(tmp_path, tokenizer):
    ctx = Ctx(tmp_path, tokenizer, None, KIT)
    trainer = ctx.build(ctx.config({"train_sampling_strategy": "sequential"}))
    assert _first_epoch(Run(trainer.args, trainer)) == PROMPTS


def test_optimizer_modes_follow_training_and_evaluation(tmp_path, tokenizer, monkeypatch):
    """Trainer switches an optimizer with train / eval modes (schedule-free optimizers keep two weight sets) to
    train() for its steps and to eval() for evaluate; PPO does too (accelerate's wrapper forwards both)."""
    ctx = Ctx(tmp_path, tokenizer, monkeypatch, KIT)
    args = ctx.config({"max_steps": 2, "eval_strategy": "steps", "eval_steps": 1})
    trainer = ctx.build(args, eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}))
    inner, mode, step_modes, eval_modes = trainer.optimizer.optimizer, ["unset"], [], []
    monkeypatch.setattr(inner, "train", lambda: mode.__setitem__(0, "train"), raising=False)
    monkeypatch.setattr(inner, "eval", lambda: mode.__setitem__(0, "eval"), raising=False)
    step, generate = inner.step, trainer.generate

    def recording_step(*args, **kwargs):
        step_modes.append(mode[0])
        return step(*args, **kwargs)

    def recording_generate(*args, **kwargs):
        if trainer.control.should_evaluate:
            eval_modes.append(mode[0])
        return generate(*args, **kwargs)

    monkeypatch.setattr(inner, "step", recording_step)
    monkeypatch.setattr(trainer, "generate", recording_generate)
    trainer.train()
    assert step_modes == ["train", "train"]
    assert eval_modes == ["eval", "eval"] and mode[0] == "train"


@pytest.mark.slow
def test_compiled_step(tmp_path, tokenizer):
    """torch_compile: the PPO passes run through the compiled module (TorchDynamo captures graphs). Slow: compiling
    on a CPU takes several seconds even with the eager backend."""
    torch._dynamo.reset()
    ctx = Ctx(tmp_path, tokenizer, None, KIT)
    trainer = ctx.build(ctx.config({"torch_compile_backend": "eager"}))
    trainer.train()
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > 0
    assert math.isfinite(step_logs(trainer)[0]["loss/total"])
