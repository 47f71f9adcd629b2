"""The health rules on synthetic log histories: each alarm trips on its failure, a healthy run trips none."""

import math
import random

import pytest

from trl_stable.monitoring import ALARMS, HealthConfig, HealthTracker, extract_gauges
from trl_stable.monitoring.health import floor_from_reference

CAP = 64
KL_TARGET = 6.0  # PPOConfig's default `target`


def healthy_history(n=80, seed=0, converge=False):
    """A run that learns: reward rises (noisy), few zero-std groups, steady grad norm and length, slow entropy decline,
    small mismatch. With `converge`, the reward rises to 0.98 and then stays flat at the maximum."""
    rng = random.Random(seed)
    history = []
    for i in range(n):
        t = i / n
        reward = min(0.2 + 1.6 * t, 0.98) if converge else 0.2 + 0.6 * t
        history.append(
            {
                "step": i + 1,
                "loss": rng.uniform(-0.02, 0.02),
                "grad_norm": 0.5 + rng.uniform(-0.2, 0.2),
                "reward": min(reward + rng.uniform(-0.04, 0.04), 1.0),  # a mean of rewards <= 1
                "frac_reward_zero_std": 0.15 + rng.uniform(-0.1, 0.1),
                "completions/mean_length": 30 + rng.uniform(-4, 4),
                "completions/clipped_ratio": 0.02,
                "entropy": 2.0 - 0.6 * t + rng.uniform(-0.05, 0.05),
                "mismatch/logp_abs_diff/mean": 0.002 + rng.uniform(0, 0.002),
                "token_filter/icepop/masked_token_frac": 0.01,
                "token_filter/icepop/masked_seq_frac": 0.3,  # sequence shares are not the gauge
                "retokenization/mismatched": 0.0,
                "objective/kl": KL_TARGET * (0.7 + rng.uniform(-0.25, 0.25)),  # held near its target
            }
        )
    return history


def replay(history, **config):
    tracker = HealthTracker(HealthConfig(**config), max_completion_length=CAP, kl_target=KL_TARGET)
    events = []
    for record in history:
        events.extend(tracker.update(record, step=record["step"]))
    return tracker, events


def raised(events):
    return [e.alarm for e in events if e.kind == "raised"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("converge", [False, True])
def test_healthy_run_raises_nothing(seed, converge):
    tracker, events = replay(healthy_history(seed=seed, converge=converge))
    assert events == []
    assert tracker.active == []
    assert tracker.flags()["health/active_alarms"] == 0.0


def with_fault(key, values_from, start=30, n=80):
    """A healthy history where `key` takes `values_from(i)` from record `start` on."""
    history = healthy_history(n=n)
    for i, record in enumerate(history):
        if i >= start:
            record[key] = values_from(i)
    return history


FAULTS = {
    "zero_std": ("frac_reward_zero_std", lambda i: 0.7),
    "reward_plateau": ("reward", lambda i: 0.55),
    "reward_above_max": ("reward", lambda i: 1.4),
    "grad_norm_vanishing": ("grad_norm", lambda i: 0.0),
    "length_near_cap": ("completions/mean_length", lambda i: 0.95 * CAP),
    "entropy_collapse": ("entropy", lambda i: 0.01),
    "mismatch": ("mismatch/logp_abs_diff/mean", lambda i: 0.05),
    "token_filter_masked": ("token_filter/icepop/masked_token_frac", lambda i: 0.4),
    "retokenization": ("retokenization/mismatched", lambda i: 2.0),
    "nonfinite": ("grad_norm", lambda i: float("nan")),
    "kl_above_target": ("objective/kl", lambda i: 5 * KL_TARGET),
}


def test_every_alarm_has_a_fault():
    assert set(FAULTS) == set(ALARMS)


@pytest.mark.parametrize("alarm", sorted(FAULTS))
def test_fault_trips_its_alarm_once(alarm):
    key, values = FAULTS[alarm]
    tracker, events = replay(with_fault(key, values, start=30, n=120))
    names = raised(events)
    assert alarm in names
    assert names.count(alarm) == 1  # debounced: raised once, not every step
    event = next(e for e in events if e.alarm == alarm)
    spec = ALARMS[alarm]
    assert event.cause == spec.cause and event.remedy == spec.remedy and event.symptom
    assert alarm in tracker.active
    assert tracker.flags()[f"health/alarm/{alarm}"] == 1.0
    if alarm == "nonfinite":
        assert event.step == 31  # no patience for NaN
        assert event.severity == "critical"
    elif alarm == "reward_plateau":
        # The window (50) must first fill with the flat reward; then the plateau's patience (50 // 5).
        assert 31 < event.step <= 31 + 50 + 10
        assert "best reward reached" in event.symptom
    elif alarm == "kl_above_target":
        assert event.step == 31 + 4  # kl_patience 5: sustained, not one noisy batch
    else:
        assert event.step == 31 + 2  # patience 3: the third consecutive record
    # An alarm driven by one gauge must not drag unrelated alarms with it.
    unrelated = set(names) - {alarm, "grad_norm_vanishing", "zero_std"}
    assert unrelated <= {"reward_plateau"} if alarm == "reward_above_max" else unrelated == set()


def test_alarm_clears_after_recovery_and_single_spike_is_ignored():
    history = with_fault("frac_reward_zero_std", lambda i: 0.8 if i < 40 else 0.1, start=30)
    history[60]["frac_reward_zero_std"] = 0.9  # one bad record: below patience
    _, events = replay(history)
    kinds = [(e.kind, e.alarm, e.step) for e in events]
    assert kinds == [("raised", "zero_std", 33), ("cleared", "zero_std", 43)]


def test_clipped_ratio_alone_trips_length_alarm():
    tracker, events = replay(with_fault("completions/clipped_ratio", lambda i: 0.5))
    assert raised(events) == ["length_near_cap"]
    assert "50% of completions truncated at the cap, up from 2% at the start" in events[0].symptom


def test_repeat_every_and_disabled_alarms():
    history = with_fault("mismatch/logp_abs_diff/mean", lambda i: 0.05, start=0, n=130)
    _, events = replay(history, repeat_every=50)
    assert [e.kind for e in events] == ["raised", "repeated", "repeated"]
    assert [e.step for e in events] == [3, 53, 103] and events[1].since == 3
    assert "still holds (since step 3)" in events[1].message() and "Remedy" not in events[1].message()
    _, events = replay(history, repeat_every=0)
    assert [e.kind for e in events] == ["raised"]
    _, events = replay(history, disabled_alarms=["mismatch"])
    assert events == []


def test_threshold_is_configurable():
    history = with_fault("mismatch/logp_abs_diff/mean", lambda i: 0.02)
    assert raised(replay(history)[1]) == ["mismatch"]
    assert raised(replay(history, mismatch_threshold=0.03)[1]) == []


def test_grad_norm_relative_floor_uses_early_reference():
    # 0.5 early, then 1e-3: far above the absolute floor 1e-6 but below 1% of the reference 0.5.
    history = with_fault("grad_norm", lambda i: 1e-3)
    assert raised(replay(history)[1]) == ["grad_norm_vanishing"]
    event = [e for e in replay(history)[1] if e.kind == "raised"][0]
    assert event.threshold == pytest.approx(0.01 * 0.5, rel=0.5)


def test_plateau_needs_declared_max_and_converged_is_not_plateau():
    history = with_fault("reward", lambda i: 0.55, n=120)
    assert raised(replay(history)[1]) == ["reward_plateau"]
    assert raised(replay(history, reward_max=None)[1]) == []
    history = with_fault("reward", lambda i: 0.97, n=120)
    assert raised(replay(history)[1]) == []


def noisy_reward(n, rise, noise, seed):
    rng = random.Random(seed)
    return [{"step": i + 1, "reward": 0.2 + rise * i / n + rng.gauss(0, noise)} for i in range(n)]


@pytest.mark.parametrize("seed", range(10))
def test_noisy_but_rising_reward_is_not_a_plateau(seed):
    # A realistic per-step reward/mean: +0.5 over 150 records under noise of std 0.06 (a window of 20 records
    # raised the plateau alarm on every one of these seeds).
    assert raised(replay(noisy_reward(150, rise=0.5, noise=0.06, seed=seed))[1]) == []


def test_noisy_flat_reward_is_a_plateau_and_stays_raised():
    _, events = replay(noisy_reward(150, rise=0.0, noise=0.06, seed=0))
    assert [(e.kind, e.alarm) for e in events if e.kind != "repeated"] == [("raised", "reward_plateau")]


def test_clipped_ratio_alarm_needs_no_cap():
    # A plain TRL run whose cap is unknown still reports truncation; the mean length alone needs the cap.
    tracker = HealthTracker(HealthConfig())
    events = []
    for step in range(1, 9):  # 5 records of reference (5% truncated), then 60%: raised on the third
        clipped = 0.05 if step <= 5 else 0.6
        events += tracker.update({"completions/mean_length": 500.0, "completions/clipped_ratio": clipped}, step=step)
    assert [(e.kind, e.alarm, e.step) for e in events] == [("raised", "length_near_cap", 8)]
    assert events[0].symptom == (
        "60% of completions truncated at the cap, up from 5% at the start (alarm at a rise of 30 points)"
    )
    tracker = HealthTracker(HealthConfig())
    assert not any(tracker.update({"completions/mean_length": 500.0}, step=s) for s in range(1, 9))


def truncated_by_design(n=160, seed=0, blow_up_at=None):
    """PPO records of a run that truncates by design, as the README's main command does (lengths drawn in [15, 20]
    per batch, cap 20, batches of 16): a mean length of 10-15 tokens and 10-45% of the responses cut at their drawn
    length. From `blow_up_at` on, the policy loops: every response runs to the cap."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        looping = blow_up_at is not None and i >= blow_up_at
        truncated = 1.0 if looping else rng.choice([2, 3, 4, 5, 6, 7]) / 16
        length = 19.5 if looping else rng.uniform(10, 15)
        out.append({"step": i + 1, "tokens/response_len_mean": length, "tokens/truncated_frac": truncated})
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncation_by_design_raises_nothing_a_loop_does(seed):
    """The class of false alarm the README's main command raised at step 3 (38% truncated against an absolute 30%):
    a level that is the run's design from its first step is no alarm; the same run starting to loop is one."""
    tracker = HealthTracker(HealthConfig(), max_completion_length=20)
    assert [e for r in truncated_by_design(seed=seed) for e in tracker.update(r, step=r["step"])] == []
    tracker = HealthTracker(HealthConfig(), max_completion_length=20)
    events = [e for r in truncated_by_design(seed=seed, blow_up_at=80) for e in tracker.update(r, step=r["step"])]
    assert [(e.kind, e.alarm, e.step) for e in events if e.kind != "repeated"] == [("raised", "length_near_cap", 83)]
    assert events[0].symptom.startswith("mean completion length 19.5 is 98% of the cap 20 (it started at 1")
    assert "100% of completions truncated at the cap, up from" in events[0].symptom


def test_completions_at_the_cap_from_the_start_raise_nothing():
    """A fixed-length run (EOS masked, every completion 16 of 16 tokens) sits at the cap by design: neither its
    length nor its truncated share can rise, and neither alarms."""
    tracker = HealthTracker(HealthConfig(), max_completion_length=16)
    records = [{"tokens/response_len_mean": 16.0, "tokens/truncated_frac": 1.0} for _ in range(60)]
    assert not any(tracker.update(r, step=i + 1) for i, r in enumerate(records))
    assert tracker.active == []


def test_length_symptom_names_what_tripped():
    _, events = replay(with_fault("completions/mean_length", lambda i: 0.95 * CAP))
    assert events[0].symptom.startswith(f"mean completion length {0.95 * CAP:.1f} is 95% of the cap {CAP} (it started")
    _, events = replay(with_fault("completions/clipped_ratio", lambda i: 0.5))
    # the mean length (~30) is far from the cap: the symptom gives its share, it does not call it "near"
    assert "near" not in events[0].symptom and "50% of completions truncated" in events[0].symptom


def test_ppo_per_token_entropy_is_preferred_over_the_summed_one():
    # PPO's objective/entropy sums over a response, so it halves when responses halve: not a collapse.
    assert extract_gauges({"objective/entropy": 12.0, "policy/entropy": 1.5}) == {"entropy": 1.5}


def test_first_steps_eval_logs_and_sparse_records_raise_nothing():
    history = healthy_history(n=60)
    # The first two steps of a run can look bad (all groups solved or failed): shorter than the patience.
    history[0].update(frac_reward_zero_std=0.9, grad_norm=0.0)
    history[1].update(frac_reward_zero_std=0.8, grad_norm=0.0)
    mixed = []
    for i, record in enumerate(history):
        mixed.append(record)
        if i % 10 == 0:  # evaluation logs, a learning-rate-only record and a record with some gauges missing
            mixed.append({"step": record["step"], "eval_loss": 9.0, "eval_reward": 0.0, "eval_entropy": 0.0})
            mixed.append({"step": record["step"], "learning_rate": 0.0, "epoch": 0.1})
            mixed.append({"step": record["step"], "reward": record["reward"]})
    tracker, events = replay(mixed)
    assert events == [] and tracker.active == []


def test_trl_vllm_and_ppo_keys_are_read():
    gauges = extract_gauges(
        {
            "env/reward_mean": 0.3,
            "objective/entropy": 1.2,
            "sampling/sampling_logp_difference/mean": 0.02,
            "kpop/masked_frac": 0.2,
            "token_filter/icepop/masked_seq_frac": 0.9,
            "token_filter/kpop/clamped_token_frac": 0.1,
            "eval_icepop/masked_frac": 0.9,
            "grad_norm": None,
        }
    )
    assert gauges == {"reward": 0.3, "entropy": 1.2, "mismatch": 0.02, "masked_fraction": 0.2}
    ppo = extract_gauges(
        {
            "policy/grad_norm": 0.3,
            "loss/total": 1.0,
            "tokens/response_len_mean": 12.0,
            "token_filter/icepop/masked_token_frac": 0.25,
            "token_filter/icepop/masked_seq_frac": 0.9,
        }
    )
    assert ppo == {"grad_norm": 0.3, "loss": 1.0, "completion_length": 12.0, "masked_fraction": 0.25}
    custom = extract_gauges({"my/score": 0.4}, {"reward": ["my/score"]})
    assert custom == {"reward": 0.4}


def test_records_without_gauges_change_nothing():
    tracker = HealthTracker(HealthConfig())
    assert tracker.update({"train_runtime": 3.0, "train_loss": 0.1}, step=5) == []
    assert tracker.last_gauges == {}


def test_event_record_is_strict_json():
    import json

    _, events = replay(with_fault("grad_norm", lambda i: float("inf")))
    record = [e for e in events if e.alarm == "nonfinite"][0].to_record()
    json.dumps(record, allow_nan=False)
    assert "grad_norm=inf" in record["symptom"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"zero_std_healthy": 0.6, "zero_std_alarm": 0.5}, "zero_std_healthy"),
        ({"patience": 0}, "patience"),
        ({"plateau_window": 3}, "plateau_window"),
        ({"mismatch_band": (1.1, 0.9)}, "mismatch_band"),
        ({"disabled_alarms": ["nope"]}, "disabled_alarms"),
        ({"critical_alarms": ["nope"]}, "critical_alarms"),
        ({"stop_after_critical_steps": 0}, "stop_after_critical_steps"),
        ({"metric_keys": {"nope": ["x"]}}, "metric_keys"),
        ({"length_cap_ratio": 1.5}, "length_cap_ratio"),
        ({"mismatch_threshold": -1.0}, "mismatch_threshold"),
        ({"kl_target": 0.0}, "kl_target"),
        ({"kl_target": float("nan")}, "kl_target"),
        ({"kl_alarm_ratio": 0.5}, "kl_alarm_ratio"),
        ({"kl_patience": 0}, "kl_patience"),
    ],
)
def test_bad_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HealthConfig(**kwargs)


def test_critical_set_is_configurable():
    assert HealthConfig().critical == {"grad_norm_vanishing", "entropy_collapse", "nonfinite"}
    assert HealthConfig(critical_alarms=["zero_std"]).critical == {"zero_std"}
    assert math.isfinite(HealthConfig().mismatch_threshold)


def test_zero_std_symptom_uses_the_configured_bands():
    history = with_fault("frac_reward_zero_std", lambda i: 0.7)
    (event,) = replay(history, zero_std_healthy=0.2, zero_std_alarm=0.6)[1]
    assert event.symptom == "70% of the groups have zero reward variance (healthy < 20%, alarm > 60%)"


def test_confident_model_is_not_an_entropy_collapse():
    # An instruct model can start at 0.04 nats/token, below the absolute floor (0.05): judged by its own start.
    steady = [{"step": i, "entropy": 0.04} for i in range(1, 40)]
    assert replay(steady)[1] == []
    falling = steady[:10] + [{"step": i, "entropy": 0.01} for i in range(11, 20)]  # 0.01 < 0.5 x 0.04
    assert raised(replay(falling)[1]) == ["entropy_collapse"]


@pytest.mark.parametrize(
    "reference, expected",
    [(None, 0.05), (2.0, 0.2), (0.3, 0.05), (0.04, 0.02), (0.0, 0.0)],
)
def test_floor_from_reference_by_hand(reference, expected):
    # entropy defaults: absolute 0.05, relative 10%; the floor never exceeds half the reference
    assert floor_from_reference(reference, 0.05, 0.1) == pytest.approx(expected)


def kl_records(values, coef=0.1):
    return [{"step": i + 1, "objective/kl": v, "objective/kl_coef": coef} for i, v in enumerate(values)]


def test_kl_alarm_needs_sustained_drift_and_clears_on_recovery():
    # target 6, alarm above 12 for 5 records: a spike and a burst of 4 are noise, the 5th record in a row is drift
    values = [5.0] * 10 + [40.0] + [5.0] * 5 + [20.0] * 4 + [5.0] * 5 + [30.0] * 8 + [6.0] * 5
    tracker, events = replay(kl_records(values))
    assert [(e.kind, e.alarm, e.step) for e in events] == [
        ("raised", "kl_above_target", 25 + 5),
        ("cleared", "kl_above_target", 33 + 3),
    ]
    raised_event = events[0]
    assert raised_event.symptom == "KL to the reference 30.00 stays above 12.00 (5.0x the target 6; kl_coef 0.1)"
    assert raised_event.threshold == 12.0 and raised_event.value == 30.0
    for remedy in ("raise init_kl_coef", "adap_kl_ctrl=True", "shorter horizon", "lower the learning rate"):
        assert remedy in raised_event.message()
    assert tracker.active == [] and tracker.flags()["health/alarm/kl_above_target"] == 0.0


def test_kl_alarm_thresholds_are_configurable_and_need_a_target():
    values = [30.0] * 10  # 5x the target
    assert raised(replay(kl_records(values))[1]) == ["kl_above_target"]
    assert raised(replay(kl_records(values), kl_alarm_ratio=6.0)[1]) == []
    assert raised(replay(kl_records(values), kl_target=20.0)[1]) == []  # the config's target wins
    assert [e.step for e in replay(kl_records(values), kl_patience=2)[1]] == [2]
    # GRPO's per-token `kl` has no target: no alarm unless one is declared in its unit
    grpo = [{"step": i, "kl": 0.5} for i in range(1, 11)]
    assert not any(HealthTracker(HealthConfig()).update(r, step=r["step"]) for r in grpo)
    assert raised(replay(grpo, kl_target=0.05)[1]) == ["kl_above_target"]


# objective/kl of the README's main command (examples/research_projects/sentiment/ppo_intrinsic.py
# --use_intrinsic_reward) under an earlier embedded default (a VADER critic with RELC's unbounded scale, target 6,
# init_kl_coef 0.1, horizon 10000), one value per PPO step; the adaptive coefficient went from 0.1 to 0.103 while
# the KL sat at 5-7x its target for 100 steps
README_RUN_KL = [
    0.0, -0.0, 0.4, 1.3, 2.4, 2.4, 3.3, 2.6, 4.8, 5.6, 6.5, 4.9, 3.8, 5.5, 6.8, 5.9, 7.4, 2.4, 6.4, 6.1, 3.1, 7.3, 4.8,
    7.1, 8.8, 6.7, 10.1, 8.1, 9.8, 11.8, 15.3, 12.7, 18.1, 10.0, 13.7, 19.4, 19.3, 18.3, 14.0, 11.9, 22.0, 23.9, 20.2,
    19.3, 23.3, 27.5, 19.8, 24.8, 26.2, 31.7, 35.1, 35.2, 35.2, 25.4, 41.6, 33.3, 45.8, 32.5, 36.4, 34.8, 41.4, 32.8,
    42.6, 28.6, 42.4, 40.5, 43.1, 37.3, 38.4, 31.6, 41.1, 47.0, 34.8, 33.1, 37.5, 32.5, 49.0, 39.4, 37.5, 43.8, 42.9,
    42.5, 40.0, 44.4, 43.9, 43.5, 38.3, 35.3, 39.8, 42.9, 48.4, 40.1, 38.5, 43.4, 42.5, 41.5, 36.0, 39.8, 32.8, 40.5,
    42.0, 38.1, 42.5, 44.9, 43.3, 41.0, 41.3, 41.0, 40.3, 42.3, 46.7, 43.1, 42.3, 41.5, 46.8, 46.9, 40.7, 40.9, 41.8,
    42.3, 35.8, 42.2, 42.6, 40.5, 43.0, 39.0, 42.7, 40.6, 42.1, 45.3, 42.6, 42.0, 38.8, 36.6, 38.2, 39.6, 38.5, 45.5,
    40.5, 38.4, 38.6, 41.7, 47.7, 42.4, 42.6, 41.9, 41.8, 39.8, 37.9, 40.8, 42.3, 42.5, 43.0, 43.5, 41.0, 38.1, 42.0,
    42.1, 42.4, 41.9,
]  # fmt: skip


def test_readme_main_command_kl_drift_is_flagged():
    tracker, events = replay(kl_records(README_RUN_KL))
    kinds = [(e.kind, e.alarm) for e in events]
    assert kinds[0] == ("raised", "kl_above_target") and ("cleared", "kl_above_target") not in kinds
    assert events[0].step == 39  # above 2 x 6 at steps 35-39 (13.7 ... 14.0): the fifth record in a row
    assert tracker.active == ["kl_above_target"]
    assert "x the target 6" in events[0].symptom
