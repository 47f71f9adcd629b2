"""trl_stable.GRPOConfig: presets set TRL's fields, contradictory settings raise ValueError naming the fields."""

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args

from trl_stable import GRPOTrainer
from trl_stable.testing import build_causal_lm


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "sapo", "use_decoupled_loss": True}, "sapo.*use_decoupled_loss"),
        ({"token_filter": "kpop", "use_decoupled_loss": True, "token_filter_action": "clamp"}, "token_filter_action"),
        ({"token_filter": "kpop", "use_decoupled_loss": True, "token_filter_lower": 0.5}, "token_filter_lower"),
        ({"token_filter": "icepop", "use_decoupled_loss": True, "token_filter_lower": 6.0}, "token_filter_lower"),
        (
            {
                "token_filter": "icepop",
                "use_decoupled_loss": True,
                "token_filter_lower": 1.0,
                "token_filter_upper": 1.0,
            },
            "token_filter_lower",
        ),
        ({"token_filter": "icepop", "use_decoupled_loss": True, "token_filter_lower": -0.5}, "positive"),
        ({"token_filter": "icepop", "use_decoupled_loss": True, "token_filter_upper": 0.0}, "positive"),
        ({"token_filter": "kpop", "use_decoupled_loss": True, "token_filter_upper": 0.0}, "token_filter_upper"),
        ({"token_filter": "icepop"}, "use_decoupled_loss=True"),
        ({"token_filter": "tis", "use_decoupled_loss": True}, "token_filter"),
        ({"token_filter_level": "batch"}, "token_filter_level"),
        ({"advantage_estimator": "ngrpo", "ngrpo_num_virtual": 0}, "ngrpo_num_virtual"),
        ({"advantage_estimator": "ppo"}, "advantage_estimator"),
        ({"advantage_mean_level": "prompt"}, "advantage_mean_level"),
        ({"advantage_estimator": "gdpo", "advantage_std_level": "batch"}, "advantage_std_level"),
        ({"advantage_leave_one_out": True, "advantage_mean_level": "none"}, "advantage_leave_one_out"),
        ({"advantage_estimator": "dr_grpo", "scale_rewards": "batch"}, "scale_rewards"),
        ({"advantage_estimator": "rloo", "multi_objective_aggregation": "normalize_then_sum"}, "gdpo"),
        ({"advantage_eps": 1e-3, "multi_objective_aggregation": "normalize_then_sum"}, "advantage_estimator='gdpo'"),
        ({"overlong_penalty_tokens": 9}, "overlong_penalty_tokens"),
        ({"overlong_penalty_tokens": 4, "overlong_penalty_factor": 0.0}, "overlong_penalty_factor"),
        ({"dense_reward_gamma": 0.0}, "dense_reward_gamma"),
        ({"dynamic_sampling_max_refills": 2}, "dynamic_sampling=True"),
        ({"dynamic_sampling": True, "dynamic_sampling_max_refills": -1}, "dynamic_sampling_max_refills"),
        ({"nan_reward_action": "ignore"}, "nan_reward_action"),
        ({"use_decoupled_loss": True, "use_transformers_continuous_batching": True}, "continuous_batching"),
        ({"use_decoupled_loss": True, "token_filter_action": "clamp"}, "token_filter_action only apply"),
        ({"use_decoupled_loss": True, "token_filter_upper": 2.0}, "token_filter_upper only apply"),
        ({"advantage_estimator": "rloo", "scale_rewards": "batch"}, "scale_rewards='batch'.*advantage_std_level"),
        ({"scale_rewards": "none", "advantage_leave_one_out": True}, "scale_rewards='none'"),
        ({"advantage_estimator": "gdpo", "advantage_eps": 1e-6}, "advantage_eps does not apply"),
        ({"advantage_estimator": "ngrpo", "advantage_std_unbiased": False}, "advantage_std_unbiased does not apply"),
        ({"use_decoupled_loss": True, "loss_type": "vespo"}, "vespo.*use_decoupled_loss"),
        ({"use_decoupled_loss": True, "use_vllm": True}, "vllm_importance_sampling_correction=False"),
    ],
)
def test_bad_settings_raise(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_grpo_args(tmp_path, **kwargs)


def test_presets_set_trl_fields_and_defaults_leave_them(tmp_path):
    assert tiny_grpo_args(tmp_path).advantage_settings is None
    dr = tiny_grpo_args(tmp_path, advantage_estimator="dr_grpo")
    assert (dr.scale_rewards, dr.loss_type, dr.advantage_settings) == ("none", "dr_grpo", None)
    assert tiny_grpo_args(tmp_path, advantage_estimator="dr_grpo", loss_type="bnpo").loss_type == "bnpo"
    gdpo = tiny_grpo_args(tmp_path, advantage_estimator="gdpo")
    assert gdpo.multi_objective_aggregation == "normalize_then_sum"
    rloo = tiny_grpo_args(tmp_path, advantage_estimator="rloo").advantage_settings
    assert (rloo["mean_level"], rloo["std_level"], rloo["leave_one_out"]) == ("group", None, True)
    custom = tiny_grpo_args(tmp_path, advantage_estimator="liteppo", advantage_std_level="none").advantage_settings
    assert custom["std_level"] is None and custom["eps"] == 1e-4
    ngrpo = tiny_grpo_args(tmp_path, advantage_estimator="ngrpo").advantage_settings
    assert ngrpo == {"estimator": "ngrpo", "r_max": 1.0, "num_virtual": 1, "eps": 1e-6}
    assert tiny_grpo_args(tmp_path, advantage_estimator="gdpo").advantage_settings is None  # TRL's normalize_then_sum
    # TRL's scaling choice stays TRL's; an eps or a biased std makes trl_stable compute the same preset itself
    assert tiny_grpo_args(tmp_path, scale_rewards="batch").advantage_settings is None
    grpo_eps = tiny_grpo_args(tmp_path, advantage_eps=1e-6).advantage_settings
    assert (grpo_eps["mean_level"], grpo_eps["std_level"], grpo_eps["eps"]) == ("group", "group", 1e-6)
    assert tiny_grpo_args(tmp_path, advantage_std_unbiased=False).advantage_settings["unbiased"] is False
    assert tiny_grpo_args(tmp_path, token_filter="kpop", use_decoupled_loss=True).filter_bounds == (None, 2.0)
    assert tiny_grpo_args(tmp_path, token_filter="icepop", use_decoupled_loss=True).filter_bounds == (0.5, 5.0)


def test_reward_weights_of_wrong_length(tokenizer, tmp_path):
    def r(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="reward_weights has 3 entries but 2 reward functions"):
        GRPOTrainer(
            model=build_causal_lm("qwen2", tokenizer),
            reward_funcs=[r, r],
            args=tiny_grpo_args(tmp_path, reward_weights=[1.0, 1.0, 1.0]),
            train_dataset=Dataset.from_dict({"prompt": ["a b"] * 4}),
            processing_class=tokenizer,
        )


def test_plain_trl_config_works_with_options_off(tokenizer, tmp_path):
    import trl

    def r(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = tiny_grpo_args(tmp_path, config_class=trl.GRPOConfig, max_completion_length=4)
    trainer = GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer),
        reward_funcs=r,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}),
        processing_class=tokenizer,
    )
    assert trainer._opt("use_decoupled_loss") is False and not trainer._needs_sampler_logps()
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


def test_with_changes_revalidates_and_changes_only_what_it_is_asked(tmp_path):
    """`with_changes` is a replaced copy put through trl_stable's own validation: only the asked field differs, the
    original is untouched, a combination the config refuses raises, and TRL's fields are left to a new config."""
    import dataclasses

    original = tiny_grpo_args(tmp_path)
    changed = original.with_changes(advantage_estimator="rloo")
    diff = {
        f.name: (getattr(original, f.name), getattr(changed, f.name))
        for f in dataclasses.fields(original)
        if getattr(original, f.name) != getattr(changed, f.name)
    }
    assert diff == {"advantage_estimator": ("grpo", "rloo")}
    assert changed.advantage_settings["leave_one_out"] and original.advantage_settings is None
    with pytest.raises(ValueError, match="advantage_std_unbiased does not apply to advantage_estimator='ngrpo'"):
        original.with_changes(advantage_estimator="ngrpo", advantage_std_unbiased=False)
    with pytest.raises(ValueError, match="ngrpo_num_virtual"):  # the bounds are checked too
        original.with_changes(advantage_estimator="ngrpo", ngrpo_num_virtual=0)
    with pytest.raises(ValueError, match=r"own GRPOConfig fields only, not \['loss_type'\]"):
        original.with_changes(loss_type="grpo")
    assert original.advantage_estimator == "grpo" and original.advantage_std_unbiased


def test_virtual_samples_config_is_the_ngrpo_copy(tmp_path):
    original = tiny_grpo_args(tmp_path, health_remedy_virtual_samples=True, ngrpo_r_max=2.0)
    remedy = original.virtual_samples_config()
    assert remedy.advantage_settings == {"estimator": "ngrpo", "r_max": 2.0, "num_virtual": 1, "eps": 1e-6}
    assert original.advantage_estimator == "grpo" and not remedy.health_remedy_virtual_samples
    assert tiny_grpo_args(tmp_path).virtual_samples_config() is None
