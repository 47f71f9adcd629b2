"""Intermediate step rewards: weights, per-dimension scores by hand, penalties, GDPO reward functions."""

import json

import pytest

from trl_stable.rewards import (
    PenaltyRule,
    StepReward,
    StepRewardWeights,
    invalid_call_penalty,
    parse_agent_step,
    tool_overuse_penalty,
)

GT = {"tool": "get_weather", "arguments": {"city": "Paris", "days": 3}, "plan": ["get the forecast", "answer"]}
PERFECT = (
    "Thought: First I need the forecast because the user asked for it.\n"
    "Plan: 1. get the forecast 2. answer\n"
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
)


def test_perfect_answer_scores_exactly_one():
    scores = StepReward().score(PERFECT, GT)
    assert scores["total"] == 1.0  # exactly, not 0.9999999999999999
    assert {k: scores[k] for k in ("tool_name", "arguments", "reasoning", "plan")} == dict.fromkeys(
        ("tool_name", "arguments", "reasoning", "plan"), 1.0
    )
    # Other decimal weights that sum to one also give exactly 1.0.
    other = StepReward(weights={"tool_name": 0.3, "arguments": 0.3, "reasoning": 0.3, "plan": 0.1})
    assert other.score(PERFECT, GT)["total"] == 1.0


@pytest.mark.parametrize(
    "weights",
    [
        {"tool_name": 0.5, "arguments": 0.2, "reasoning": 0.2, "plan": 0.0},  # max 0.9
        {"tool_name": 0.5, "arguments": 0.3, "reasoning": 0.2, "plan": 0.1},  # max 1.1
        {"tool_name": 1.2, "arguments": -0.2, "reasoning": 0.0, "plan": 0.0},  # negative
        {"tool_name": float("nan"), "arguments": 0.2, "reasoning": 0.2, "plan": 0.1},
    ],
)
def test_wrong_weights_raise(weights):
    with pytest.raises(ValueError, match="weights"):
        StepRewardWeights(**weights)
    with pytest.raises(ValueError):
        StepReward(weights=weights)


def test_weights_within_float_tolerance_are_rescaled_to_score_exactly_one():
    # 0.1 + 5e-10 is within the 1e-9 tolerance: accepted, rescaled by the sum, and a perfect answer is exactly 1.0.
    weights = StepRewardWeights(plan=0.1 + 5e-10)
    assert weights.plan == pytest.approx(0.1 + 5e-10) and weights.plan != 0.1 + 5e-10
    assert StepReward(weights=weights).score(PERFECT, GT)["total"] == 1.0
    # Thirds: not exact in binary either.
    thirds = {"tool_name": 1 / 3, "arguments": 1 / 3, "reasoning": 1 / 3, "plan": 0.0}
    assert StepReward(weights=thirds).score(PERFECT, GT)["total"] == 1.0
    with pytest.raises(ValueError, match="sum to"):
        StepRewardWeights(plan=0.1 + 2e-9)  # off by more than the tolerance
    with pytest.raises(ValueError, match="real numbers"):
        StepRewardWeights(tool_name=True, arguments=0.0, reasoning=0.0, plan=0.0)  # a bool is not a weight


def test_unknown_weight_name_raises():
    with pytest.raises(ValueError, match="Unknown step-reward weight"):
        StepReward(weights={"tool": 1.0})


def test_partial_scores_by_hand():
    completion = (
        "I think so.\nPlan: get the forecast\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "paris", "days": 3, "unit": "C"}}</tool_call>'
    )
    s = StepReward().score(completion, GT)
    # name right; args: keys {city, days, unit}, only days matches -> 1/3; no connective ("so" alone is not
    # one, "so that" is) -> 0; plan covers 1 of 2 items -> 0.5.
    assert s["tool_name"] == 1.0
    assert s["arguments"] == pytest.approx(1 / 3)
    assert s["reasoning"] == 0.0
    assert s["plan"] == 0.5
    assert s["total"] == pytest.approx(0.5 + 0.2 / 3 + 0.1 * 0.5)
    # Exact argument matching: all or nothing.
    assert StepReward(exact_arguments=True).score(completion, GT)["arguments"] == 0.0
    # One connective of the two required -> 0.5.
    assert StepReward().score("Thought: because it rains.", GT)["reasoning"] == 0.5


def test_wrong_tool_gets_no_argument_credit_and_multi_call_alignment():
    wrong = '<tool_call>{"name": "get_news", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    s = StepReward().score(wrong, GT)
    assert s["tool_name"] == 0.0 and s["arguments"] == 0.0
    gt = [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]
    two = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    )
    s = StepReward().score(two, gt)
    assert s["tool_name"] == 0.5 and s["arguments"] == 0.5
    three = two + '<tool_call>{"name": "b", "arguments": {}}</tool_call>'  # an extra call dilutes: 1 of 3
    assert StepReward().score(three, gt)["tool_name"] == pytest.approx(1 / 3)
    # No call expected and none made: full tool credit (a final-answer step).
    assert StepReward().score("Thought: first, then done.", {"plan": []})["total"] == 1.0


def test_formats_json_react_and_chinese_connectives():
    thought = "首先查询天气，然后回答"
    js = json.dumps(
        {"thought": thought, "plan": ["get the forecast", "answer"], "tool": "get_weather", "args": GT["arguments"]}
    )
    assert StepReward().score(js, GT)["total"] == 1.0
    react = (
        "Thought: First look it up, then answer.\nPlan: get the forecast; answer\n"
        'Action: get_weather\nAction Input: {"city": "Paris", "days": 3}'
    )
    assert StepReward().score(react, json.dumps(GT))["total"] == 1.0
    step = parse_agent_step('<tool_call>{"name": oops}</tool_call> text')
    assert step.invalid_calls == 1 and step.calls == []


def test_penalties():
    rule = tool_overuse_penalty("check_status", max_calls=1)
    sr = StepReward(penalties=[rule, invalid_call_penalty(-0.2)])
    call = '<tool_call>{"name": "check_status", "arguments": {}}</tool_call>'
    once = sr.score(call, {"tool": "check_status"})
    assert once["penalty"] == 0.0 and "penalty/overuse_check_status" not in once
    twice = sr.score(call * 2 + "<tool_call>{", {"tool": "check_status"})
    assert twice["penalty/overuse_check_status"] == -0.3 and twice["penalty/invalid_call"] == -0.2
    assert twice["penalty"] == pytest.approx(-0.5)
    # With include_prompt, calls already made in the trajectory count.
    history = tool_overuse_penalty("check_status", max_calls=1, include_prompt=True)
    assert StepReward(penalties=[history]).score(call, {"tool": "check_status"}, prompt=call)["penalty"] == -0.3
    assert StepReward(penalties=[rule], clip_min=0.0).score(call * 3, GT)["total"] == 0.0
    with pytest.raises(ValueError, match="<= 0"):
        PenaltyRule("bonus", 0.1, lambda *a: True)
    with pytest.raises(ValueError, match="unique"):
        StepReward(penalties=[rule, rule])


def test_trl_reward_function_interface_and_gdpo_dimensions():
    sr = StepReward(penalties=[tool_overuse_penalty("get_weather", 0, penalty=-0.25)])
    prompts = ["p1", "p2", "p3"]
    completions = [[{"role": "assistant", "content": PERFECT}], "nothing", "x"]
    truths = [GT, GT, None]
    totals = sr(prompts=prompts, completions=completions, ground_truth=truths, trainer_state=None)
    assert totals[0] == pytest.approx(0.75) and totals[2] is None  # None: no ground truth, TRL reads NaN
    funcs = sr.reward_funcs()
    assert [f.__name__ for f in funcs] == ["step_tool_name", "step_arguments", "step_reasoning", "step_plan",
                                           "step_penalty"]  # fmt: skip
    assert sr.reward_weights() == [0.5, 0.2, 0.2, 0.1, 1.0]
    per_dim = [f(prompts=prompts, completions=completions, ground_truth=truths) for f in funcs]
    assert [d[0] for d in per_dim] == [1.0, 1.0, 1.0, 1.0, -0.25]
    assert per_dim[0][1] == 0.0 and per_dim[3][1] == 0.0  # "nothing": no call, no plan items covered
    with pytest.raises(ValueError, match="ground_truth"):
        sr(prompts=prompts, completions=completions)
    # The per-dimension functions share one parse of the batch; a new batch is scored afresh.
    parsed = []
    sr.penalties[0] = PenaltyRule("spy", 0.0, lambda step, gt, prompt: parsed.append(step.text) or False)
    sr._cache = None
    for f in funcs:
        f(prompts=prompts, completions=completions, ground_truth=truths)
    assert len(parsed) == 2  # two rows with ground truth, parsed once for five functions
    assert funcs[0](prompts=prompts, completions=["nothing", PERFECT, "x"], ground_truth=truths)[:2] == [0.0, 1.0]
    assert StepReward().reward_weights() == [0.5, 0.2, 0.2, 0.1] and len(StepReward().reward_funcs()) == 4
