"""Every bad setting of PPOConfig, GRPOConfig and CriticRewardConfig is refused when the config is built, with an
error of the right type that names the field (one parametrized case per setting; each was accepted, or failed with
an error that did not name it, before these checks)."""

from __future__ import annotations

import math

import pytest
from tiny_configs import tiny_grpo_args

from trl_stable import PPOConfig
from trl_stable.rewards import CriticRewardConfig
from trl_stable.settings.checks import Bound

NAN, INF = math.nan, math.inf

# (kwargs, error type, the field the message must name)
PPO_CASES = [
    # --- accepted silently: each ran and trained wrongly or not at all
    ({"vf_coef": -1.0}, ValueError, "vf_coef"),
    ({"target_kl": -1.0}, ValueError, "target_kl"),
    ({"target_kl": 0.0}, ValueError, "target_kl"),
    ({"ratio_threshold": 0.0}, ValueError, "ratio_threshold"),
    ({"ratio_threshold": 1.0}, ValueError, "ratio_threshold"),
    ({"init_kl_coef": NAN}, ValueError, "init_kl_coef"),
    ({"init_kl_coef": INF}, ValueError, "init_kl_coef"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_k": -1}, ValueError, "top_k"),
    ({"temperature": NAN}, ValueError, "temperature"),
    ({"max_prompt_length": 0}, ValueError, "max_prompt_length"),
    ({"generation_batch_size": 0}, ValueError, "generation_batch_size"),
    ({"max_steps": 0, "num_train_epochs": 0}, ValueError, "num_train_epochs"),
    ({"cliprange": NAN}, ValueError, "cliprange"),
    ({"cliprange_value": INF}, ValueError, "cliprange_value"),
    ({"score_clip": NAN}, ValueError, "score_clip"),
    ({"horizon": INF}, ValueError, "horizon"),
    ({"target": NAN}, ValueError, "target"),
    ({"reward_weights": [NAN]}, ValueError, "reward_weights[0]"),
    ({"reward_weights": [1.0, INF]}, ValueError, "reward_weights[1]"),
    ({"health_reward_max": NAN}, ValueError, "health_reward_max"),
    ({"health_mismatch_threshold": NAN}, ValueError, "health_mismatch_threshold"),
    (
        {"use_decoupled_loss": True, "token_filter": "kpop", "token_filter_upper": INF},
        ValueError,
        "token_filter_upper",
    ),
    # --- TrainingArguments fields PPO reads
    ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),  # was a ZeroDivisionError
    ({"gradient_accumulation_steps": 1.5}, TypeError, "gradient_accumulation_steps"),
    ({"learning_rate": -1e-5}, ValueError, "learning_rate"),
    ({"learning_rate": NAN}, ValueError, "learning_rate"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"adam_beta1": 1.0}, ValueError, "adam_beta1"),
    ({"adam_beta2": 1.5}, ValueError, "adam_beta2"),
    ({"adam_epsilon": -1e-8}, ValueError, "adam_epsilon"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    ({"max_grad_norm": NAN}, ValueError, "max_grad_norm"),
    ({"num_train_epochs": -1.0}, ValueError, "num_train_epochs"),
    ({"max_steps": -5}, ValueError, "max_steps"),
    ({"seed": -1}, ValueError, "seed"),
    ({"warmup_steps": NAN}, ValueError, "warmup_steps"),
    ({"logging_steps": -1}, ValueError, "logging_steps"),
    ({"save_strategy": "steps", "save_steps": 0}, ValueError, "save_steps"),
    # --- wrong types: refused with a TypeError naming the field, not a failure inside a step
    ({"batch_size": "16"}, TypeError, "batch_size"),
    ({"vf_coef": "0.1"}, TypeError, "vf_coef"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens"),
    # --- step_mask_tools parsed now, not at the first tool call
    ({"step_loss_mask": True, "step_mask_tools": 42}, ValueError, "step_mask_tools"),
    ({"step_loss_mask": True, "step_mask_tools": [{"parameters": {"q": "string"}}]}, ValueError, "step_mask_tools"),
    (
        {"step_loss_mask": True, "step_mask_tools": [{"type": "function", "function": {"parameters": {}}}]},
        ValueError,
        "step_mask_tools",
    ),
    ({"step_loss_mask": True, "step_mask_tools": [{"name": None}]}, ValueError, "step_mask_tools"),
    (
        {"step_loss_mask": True, "step_mask_tools": {"type": "function", "function": {"name": "search"}}},
        ValueError,
        "step_mask_tools",
    ),
    ({"step_loss_mask": True, "step_mask_tools": '{"search": "not a signature"}'}, ValueError, "step_mask_tools"),
    # --- a setting that only applies to another option, set without it: refused (the run would ignore it)
    ({"adap_kl_ctrl": False, "target": 3.0}, ValueError, "target=3.0"),
    ({"adap_kl_ctrl": False, "horizon": 100.0}, ValueError, "horizon"),
    ({"early_stopping": False, "target_kl": 0.1}, ValueError, "target_kl"),
    ({"lam_schedule": "vapo", "lam": 0.9}, ValueError, "lam=0.9"),
    ({"lam_alpha": 0.5}, ValueError, "lam_alpha"),
    ({"lam_schedule": "vapo", "lam_q": 0.25}, ValueError, "lam_q"),
]

GRPO_CASES = [
    # --- trl_stable's fields
    ({"advantage_estimator": "ngrpo", "ngrpo_r_max": NAN}, ValueError, "ngrpo_r_max"),
    ({"advantage_estimator": "ngrpo", "ngrpo_r_max": INF}, ValueError, "ngrpo_r_max"),
    ({"overlong_penalty_tokens": 4, "overlong_penalty_factor": NAN}, ValueError, "overlong_penalty_factor"),
    ({"overlong_penalty_tokens": 4, "overlong_penalty_factor": INF}, ValueError, "overlong_penalty_factor"),
    ({"dense_reward_coef": NAN}, ValueError, "dense_reward_coef"),
    ({"dense_reward_coef": -INF}, ValueError, "dense_reward_coef"),
    ({"advantage_eps": NAN}, ValueError, "advantage_eps"),
    ({"advantage_eps": INF}, ValueError, "advantage_eps"),
    ({"dynamic_sampling": True, "dynamic_sampling_max_refills": 1.0}, TypeError, "dynamic_sampling_max_refills"),
    ({"health_reward_max": NAN}, ValueError, "health_reward_max"),
    ({"health_mismatch_threshold": NAN}, ValueError, "health_mismatch_threshold"),
    ({"step_loss_mask": True, "step_mask_tools": 42}, ValueError, "step_mask_tools"),
    ({"step_loss_mask": True, "step_mask_tools": [{"description": "no name"}]}, ValueError, "step_mask_tools"),
    # --- dependent settings: refused without the option they need
    ({"ngrpo_num_virtual": 3}, ValueError, "ngrpo_num_virtual"),
    ({"ngrpo_r_max": 2.0}, ValueError, "ngrpo_r_max"),
    ({"overlong_penalty_factor": 2.0}, ValueError, "overlong_penalty_factor"),
    ({"capture_sampler_logps": True, "use_transformers_continuous_batching": True}, ValueError, "capture_sampler"),
    # --- TRL's and TrainingArguments' fields, which TRL does not check
    ({"reward_weights": [NAN]}, ValueError, "reward_weights[0]"),
    ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),
    ({"per_device_train_batch_size": 0}, ValueError, "per_device_train_batch_size"),
    ({"num_generations": 0}, ValueError, "num_generations"),  # was a ZeroDivisionError in TRL's __post_init__
    ({"generation_batch_size": 0}, ValueError, "generation_batch_size"),
    ({"steps_per_generation": 0}, ValueError, "steps_per_generation"),
    ({"max_completion_length": 0}, ValueError, "max_completion_length"),
    ({"temperature": 0.0}, ValueError, "temperature"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_k": -1}, ValueError, "top_k"),
    ({"min_p": 1.5}, ValueError, "min_p"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
    ({"beta": NAN}, ValueError, "beta"),
    ({"beta": -0.1}, ValueError, "beta"),
    ({"epsilon": 0.0}, ValueError, "epsilon"),
    ({"epsilon_high": NAN}, ValueError, "epsilon_high"),
    ({"delta": 0.5}, ValueError, "delta"),
    ({"num_iterations": 0}, ValueError, "num_iterations"),
    ({"top_entropy_quantile": 0.0}, ValueError, "top_entropy_quantile"),
    ({"ref_model_mixup_alpha": 1.5}, ValueError, "ref_model_mixup_alpha"),
    ({"ref_model_sync_steps": 0}, ValueError, "ref_model_sync_steps"),
    ({"sapo_temperature_neg": 0.0}, ValueError, "sapo_temperature_neg"),
    ({"vllm_importance_sampling_clip_max": -1.0}, ValueError, "vllm_importance_sampling_clip_max"),
    ({"off_policy_mask_threshold": -1.0}, ValueError, "off_policy_mask_threshold"),
    ({"learning_rate": NAN}, ValueError, "learning_rate"),
    ({"max_steps": 0, "num_train_epochs": 0}, ValueError, "num_train_epochs"),
    ({"entropy_coef": NAN}, ValueError, "entropy_coef"),  # any other float field: NaN and inf refused
]

CRITIC_CASES = [
    ({"critic_timeout": NAN}, ValueError, "critic_timeout"),
    ({"critic_timeout": INF}, ValueError, "critic_timeout"),
    ({"critic_rate_limit": NAN}, ValueError, "critic_rate_limit"),
    ({"critic_temperature": INF}, ValueError, "critic_temperature"),
    ({"critic_retry_after_max": INF}, ValueError, "critic_retry_after_max"),
    ({"critic_max_retries": 1.5}, TypeError, "critic_max_retries"),
    ({"critic_concurrency": True}, TypeError, "critic_concurrency"),
    ({"positive_reward_value": "0.5"}, TypeError, "positive_reward_value"),
    ({"fuzzy_min_similarity": 0.7}, ValueError, "fuzzy_min_similarity"),  # without fuzzy_span_matching
]


def _ppo(tmp_path, **kwargs):
    return PPOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)


def _check(build, kwargs, error, field):
    with pytest.raises(error) as info:
        build(**kwargs)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert field in str(info.value), f"the message does not name {field!r}: {info.value}"


@pytest.mark.parametrize("kwargs, error, field", PPO_CASES, ids=[repr(case[0]) for case in PPO_CASES])
def test_ppo_config_refuses(tmp_path, kwargs, error, field):
    _check(lambda **kw: _ppo(tmp_path, **kw), kwargs, error, field)


@pytest.mark.parametrize("kwargs, error, field", GRPO_CASES, ids=[repr(case[0]) for case in GRPO_CASES])
def test_grpo_config_refuses(tmp_path, kwargs, error, field):
    _check(lambda **kw: tiny_grpo_args(tmp_path, **kw), kwargs, error, field)


@pytest.mark.parametrize("kwargs, error, field", CRITIC_CASES, ids=[repr(case[0]) for case in CRITIC_CASES])
def test_critic_config_refuses(kwargs, error, field):
    _check(CriticRewardConfig, kwargs, error, field)


def test_messages_say_what_is_valid_and_how_to_fix_it(tmp_path):
    with pytest.raises(ValueError) as info:
        _ppo(tmp_path, top_p=1.5)
    assert str(info.value) == "top_p=1.5 must be a finite number in (0, 1]. 1.0 turns nucleus sampling off."
    with pytest.raises(ValueError) as info:
        _ppo(tmp_path, early_stopping=False, target_kl=0.1)
    assert str(info.value) == (
        "target_kl=0.1 only applies with early_stopping=True; without it the run would ignore it. Set "
        "early_stopping=True, or unset target_kl."
    )
    with pytest.raises(ValueError, match=r"Set max_steps > 0 \(steps\) or num_train_epochs > 0"):
        _ppo(tmp_path, max_steps=0, num_train_epochs=0)
    with pytest.raises(ValueError, match="step_mask_tools is invalid: Tools must be a list .* got int 42"):
        _ppo(tmp_path, step_loss_mask=True, step_mask_tools=42)
    with pytest.raises(ValueError, match="A tool spec needs a non-empty 'name'"):
        tiny_grpo_args(
            tmp_path, step_loss_mask=True, step_mask_tools=[{"type": "function", "function": {"parameters": {}}}]
        )


def test_defaults_and_valid_edges_are_accepted(tmp_path):
    _ppo(tmp_path)
    tiny_grpo_args(tmp_path)
    CriticRewardConfig()
    edges = _ppo(
        tmp_path,
        top_p=1.0,
        top_k=0,
        max_grad_norm=0.0,  # no clipping (RELC's None)
        target_kl=None,
        init_kl_coef=0.0,
        vf_coef=0.0,
        max_prompt_length=None,
        min_new_tokens=0,
        max_steps=0,  # with num_train_epochs > 0: train for epochs
        adap_kl_ctrl=False,  # target and horizon at their defaults
        early_stopping=False,
        lam_schedule="vapo",
        lam_alpha=0.2,
        step_loss_mask=True,
        step_mask_tools='["search", {"type": "function", "function": {"name": "calc"}}]',
    )
    assert edges.step_mask_tools == ["search", {"type": "function", "function": {"name": "calc"}}]  # parsed JSON
    tiny_grpo_args(tmp_path, advantage_estimator="ngrpo", ngrpo_r_max=-0.5, ngrpo_num_virtual=2)
    tiny_grpo_args(tmp_path, health_remedy_virtual_samples=True, ngrpo_r_max=2.0)  # the remedy switches to 'ngrpo'
    tiny_grpo_args(tmp_path, dense_reward_coef=-0.5, top_k=None, min_p=0.0, delta=1.5, epsilon_high=0.28)
    tiny_grpo_args(tmp_path, overlong_penalty_tokens=4, overlong_penalty_factor=0.5)
    CriticRewardConfig(intrinsic_reward_threshold=INF, critic_temperature=0.0, critic_rate_limit=None)
    CriticRewardConfig(intrinsic_reward_threshold=-INF)


def test_grpo_dense_settings_need_a_dense_reward_function(tmp_path, tokenizer):
    from datasets import Dataset

    from trl_stable import GRPOTrainer
    from trl_stable.rewards import dense_reward
    from trl_stable.testing import build_causal_lm

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    @dense_reward
    def first_token(completion_ids, **kwargs):
        return [[1.0] + [0.0] * (len(ids) - 1) for ids in completion_ids]

    data = Dataset.from_dict({"prompt": ["a b", "c d"]})
    model = build_causal_lm("qwen2", tokenizer)
    with pytest.raises(ValueError, match="dense_reward_coef=0.3 only applies with a dense reward function"):
        GRPOTrainer(
            model,
            length,
            tiny_grpo_args(tmp_path, dense_reward_coef=0.3),
            train_dataset=data,
            processing_class=tokenizer,
        )
    args = tiny_grpo_args(tmp_path, dense_reward_coef=0.3, dense_reward_gamma=0.9)
    GRPOTrainer(model, [length, first_token], args, train_dataset=data, processing_class=tokenizer)


def test_bound_describes_its_rule():
    assert Bound(low=1, integer=True).describe() == "an integer >= 1"
    assert Bound(low=0.0, high=1.0, low_open=True).describe() == "a finite number in (0, 1]"
    assert Bound(low=0.0, low_open=True, optional=True).describe() == "None or a finite number > 0"
    assert Bound(low=0.0, high=1.0, high_open=True).accepts(0.0) and not Bound(high=1.0, high_open=True).accepts(1.0)
