"""Group arena rewards (GAR): round robin vs hand totals, Swiss pairing, position-bias cancelling, GRPO wrapper."""

import math
import random
import threading

import pytest

from trl_stable.rewards import ArenaReward, LLMJudge, gar_rewards, parse_verdict, run_arena

QUALITY = {"a": 0.9, "b": 0.6, "c": 0.3, "d": 0.1}


def bradley_terry(prompt, a, b):
    """Deterministic judge: P(a wins) = q_a / (q_a + q_b)."""
    return QUALITY[a] / (QUALITY[a] + QUALITY[b])


def by_length(prompt, a, b):
    return 1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5


def test_round_robin_matches_hand_totals():
    responses = ["c", "a", "d", "b"]
    rewards = gar_rewards(responses, "p", bradley_terry, both_orders=False)
    # By hand: each response plays the other three; wins are sums of q_i / (q_i + q_j).
    for i, r in enumerate(responses):
        expected = sum(QUALITY[r] / (QUALITY[r] + QUALITY[o]) for o in responses if o != r) / 3
        assert rewards[i] == pytest.approx(expected)
    assert rewards[1] == pytest.approx((0.9 / 1.5 + 0.9 / 1.2 + 0.9 / 1.0) / 3)  # "a", written out
    assert sum(rewards) * 3 == pytest.approx(6)  # 6 matches, one point each
    result = run_arena(responses, "p", bradley_terry, both_orders=False)
    assert result.judge_calls == 6 and result.matches == [3, 3, 3, 3] and result.standings == [1, 3, 0, 2]
    # A symmetric judge gives the same totals with both orders (and twice the calls).
    assert gar_rewards(responses, "p", bradley_terry) == pytest.approx(rewards)
    assert run_arena(responses, "p", bradley_terry).judge_calls == 12


def test_mock_judge_by_length():
    # A mock judge: 0.6 if a is longer else 0.4, one order only.
    def mock(prompt, a, b):
        return 0.6 if len(a) > len(b) else 0.4

    responses = ["x" * 18, "x" * 12, "x" * 20, "x" * 19]
    assert gar_rewards(responses, "p", mock, both_orders=False) == pytest.approx([1.4 / 3, 1.2 / 3, 1.8 / 3, 1.6 / 3])


@pytest.mark.parametrize("g", [2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_swiss_no_rematch_fewer_calls_stable_indices(g, seed):
    responses = [f"r{k}" + "x" * n for k, n in enumerate(random.Random(g).sample(range(g), g))]  # distinct lengths
    original = list(responses)
    result = run_arena(responses, "p", by_length, pairing="swiss", seed=seed)
    assert responses == original  # the caller's list is never shuffled
    pairs = [tuple(sorted(p)) for p in result.pairings]
    assert len(pairs) == len(set(pairs)), "rematch"
    assert result.rounds == math.ceil(math.log2(g))
    assert all(len(p) == 2 and p[0] != p[1] for p in pairs)
    assert result.judge_calls == 2 * result.rounds * (g // 2)  # ~G/2 matches per round, both orders
    round_robin_calls = g * (g - 1)
    if g > 2:
        assert result.judge_calls < round_robin_calls
    # Rewards belong to the right responses: the longest wins every match, the shortest loses every match.
    lengths = [len(r) for r in responses]
    longest, shortest = lengths.index(max(lengths)), lengths.index(min(lengths))
    assert result.rewards[longest] == 1.0 and result.rewards[shortest] == 0.0
    assert all(0.0 <= r <= 1.0 for r in result.rewards)
    for i in range(g):
        assert result.rewards[i] == pytest.approx(result.wins[i] / result.matches[i])


def test_swiss_pairs_equal_scores_and_buchholz():
    responses = [str(k) * (k + 1) for k in range(8)]
    result = run_arena(responses, "p", by_length, pairing="swiss", seed=3)
    round2 = result.pairings[4:8]
    wins_after_1 = [0.0] * 8
    for i, j in result.pairings[:4]:
        wins_after_1[i] += by_length("p", responses[i], responses[j])
        wins_after_1[j] += by_length("p", responses[j], responses[i])
    assert all(wins_after_1[i] == wins_after_1[j] for i, j in round2)  # winners meet winners
    # Buchholz is the sum of the final win totals of the opponents met.
    for i in range(8):
        opponents = [j for p in result.pairings for j in p if i in p and j != i]
        assert result.buchholz[i] == pytest.approx(sum(result.wins[j] for j in opponents))
    # Standings: wins first, Buchholz breaks ties.
    keys = [(-result.wins[i], -result.buchholz[i], i) for i in result.standings]
    assert keys == sorted(keys)


def test_swiss_stops_when_no_rematch_free_round_exists():
    result = run_arena(["a", "bb", "ccc", "dddd"], "p", by_length, pairing="swiss", rounds=10)
    assert result.rounds == 3 and len(set(map(frozenset, result.pairings))) == 6  # = round robin, then stop
    odd = run_arena(["a", "bb", "ccc"], "p", by_length, pairing="swiss", rounds=3)
    assert odd.rounds == 3 and sorted(map(sorted, odd.pairings)) == [[0, 1], [0, 2], [1, 2]]  # one bye each


def test_both_orders_cancels_a_first_slot_judge():
    always_first = lambda prompt, a, b: 1.0  # noqa: E731
    responses = ["w", "x", "y", "z", "v"]
    for pairing in ("round_robin", "swiss"):
        assert gar_rewards(responses, "p", always_first, pairing=pairing) == [0.5] * 5
    biased = gar_rewards(responses, "p", always_first, both_orders=False)
    assert biased == [1.0, 0.75, 0.5, 0.25, 0.0]  # position, not quality, decides without both orders

    # A judge with a slot-one bias on top of real preferences: both orders recover the unbiased ranking.
    def biased_bt(prompt, a, b):  # +0.1 for slot one; the largest fair value is 0.9, so nothing clips
        return bradley_terry(prompt, a, b) + 0.1

    fair = gar_rewards(["d", "c", "b", "a"], "p", bradley_terry)
    assert gar_rewards(["d", "c", "b", "a"], "p", biased_bt) == pytest.approx(fair, abs=1e-12)
    # By hand for "a": (p_ab + 1 - p_ba) / 2 = ((0.9/q + 0.1) + 1 - (q'/q + 0.1)) / 2 = 0.9/q for each opponent.
    assert fair[3] == pytest.approx((0.9 / 1.0 + 0.9 / 1.2 + 0.9 / 1.5) / 3)
    assert gar_rewards(["d", "c", "b", "a"], "p", biased_bt, both_orders=False)[3] != pytest.approx(fair[3])


def test_failed_calls_are_draws_and_counted():
    def flaky(prompt, a, b):
        if "boom" in (a, b):
            raise RuntimeError("server down")
        return None if "none" in (a, b) else by_length(prompt, a, b)

    result = run_arena(["boom", "x", "none", "yyyyyyyyyy"], "p", flaky)
    # Every call touching "boom" (6: 3 pairs x 2 orders) or "none" (4 more) fails.
    assert result.failed_calls == 10 and result.judge_calls == 12
    assert result.rewards[0] == 0.5 and result.rewards[2] == 0.5
    assert result.rewards[3] == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gar_rewards(["a", "b"], "p", lambda p, a, b: 3.0)
    with pytest.raises(ValueError, match="pairing"):
        gar_rewards(["a", "b"], "p", by_length, pairing="elo")
    assert gar_rewards(["only"], "p", by_length) == [0.5]


def test_parse_verdict_and_llm_judge_over_a_batch_backend():
    assert parse_verdict("A is clearer. [[A]]") == 1.0
    assert parse_verdict("[[A]] at first, but on reflection [[B]]") == 0.0
    assert parse_verdict("tie [[C]]") == 0.5 and parse_verdict("no verdict") is None and parse_verdict(None) is None

    seen = []

    def backend(prompts):  # critic-backend interface: list of prompts in, answers or None out
        seen.append(len(prompts))
        out = []
        for p in prompts:
            a = p.split("[Response A]\n")[1].split("\n[End of Response A]")[0]
            b = p.split("[Response B]\n")[1].split("\n[End of Response B]")[0]
            out.append(None if "{" in a + b else "[[A]]" if len(a) > len(b) else "[[B]]")
        return out

    judge = LLMJudge(backend)
    assert "{prompt}" in judge.template  # loaded from prompts/arena_judge.txt
    result = run_arena(["aaa", "b", "cc", "{json}"], "Write.", judge)
    assert seen == [12]  # one batch for the whole round-robin round
    assert result.failed_calls == 6  # the response with braces is formatted verbatim; the backend refuses it
    assert result.rewards[:3] == pytest.approx([(1 + 1 + 0.5) / 3, (0 + 0 + 0.5) / 3, (0 + 1 + 0.5) / 3])
    with pytest.raises(ValueError, match="response_b"):
        LLMJudge(backend, template="{prompt} {response_a}")


def test_llm_judge_from_chat_callable():
    calls = []

    def chat(messages):
        calls.append(messages)
        if len(calls) == 1:
            raise TimeoutError
        return "[[A]]"

    judge = LLMJudge.from_chat(chat, template="Q {prompt} A {response_a} B {response_b}", system_prompt="Be fair.")
    assert judge("p", "x", "y") is None  # the failed request
    assert judge("p", "x", "y") == 1.0
    assert calls[1] == [{"role": "system", "content": "Be fair."}, {"role": "user", "content": "Q p A x B y"}]


def test_arena_reward_groups_by_prompt_runs_concurrently_and_logs():
    in_flight, peak, lock = [0], [0], threading.Lock()
    both_running = threading.Event()

    def slow_judge(prompt, a, b):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            if in_flight[0] >= 2:
                both_running.set()
        both_running.wait(timeout=2.0)  # returns at once when calls overlap; never hangs
        with lock:
            in_flight[0] -= 1
        return by_length(prompt, a, b)

    logged = {}
    reward = ArenaReward(slow_judge, max_workers=4)
    # Two groups, interleaved, one conversational.
    prompts = ["p1", [{"role": "user", "content": "p2"}], "p1", [{"role": "user", "content": "p2"}], "p1"]
    completions = ["a", [{"role": "assistant", "content": "zz"}], "bbb", [{"role": "assistant", "content": "z"}], "cc"]
    out = reward(prompts=prompts, completions=completions, log_metric=lambda k, v: logged.__setitem__(k, v))
    assert out == [0.0, 1.0, 1.0, 0.0, 0.5]
    assert peak[0] >= 2
    assert logged == {"arena/judge_calls": 8.0, "arena/failed_judge_calls": 0.0}  # (3 + 1) pairs x 2 orders
    assert reward.judge_calls == 8 and reward.__name__ == "arena_round_robin"


def test_arena_reward_swiss_over_a_group_of_eight():
    reward = ArenaReward(by_length, pairing="swiss")
    completions = ["x" * k for k in (3, 1, 7, 5, 2, 8, 4, 6)]
    first = reward(prompts=["p"] * 8, completions=completions)
    assert reward.judge_calls == 3 * 4 * 2  # 3 rounds x 4 matches x 2 orders (round robin: 56)
    assert first[5] == 1.0 and first[1] == 0.0
    assert all(0.0 <= r <= 1.0 for r in first)


def test_llm_judge_over_openai_critic_backend(monkeypatch):
    """The judge prompt travels through the real critic backend (HTTP on 127.0.0.1); a 500 is a counted draw."""
    try:
        from fake_openai_server import FakeOpenAIServer, status
    except ImportError:  # tests/rewards became a package
        from tests.rewards.fake_openai_server import FakeOpenAIServer, status
    from trl_stable.rewards import OpenAICritic

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-dummy")

    def answer(prompt):
        a = prompt.split("[Response A]\n")[1].split("\n[End of Response A]")[0]
        b = prompt.split("[Response B]\n")[1].split("\n[End of Response B]")[0]
        return "A reads better. [[A]]" if len(a) > len(b) else "B is better. [[B]]"

    with FakeOpenAIServer(answer=answer) as server:
        server.script(status(500, match="[Response A]\nshort\n"))
        critic = OpenAICritic(model="judge", base_url=server.base_url, max_retries=0, concurrency=4, timeout=5.0)
        try:
            result = run_arena(["short", "a much longer answer", "medium one"], "Explain.", LLMJudge(critic))
        finally:
            critic.close()
    assert result.judge_calls == 6 and result.failed_calls == 1
    # The 500 hits one of the two requests with "short" in slot A (whichever arrives first): that order is a
    # draw, so "short" gets 0.25 instead of 0 from that match and its opponent 0.75.
    assert sum(result.wins) == pytest.approx(3.0)
    assert result.rewards[0] == pytest.approx(0.25 / 2)
    assert (result.rewards[1], result.rewards[2]) in [(0.875, 0.5), (1.0, 0.375)]


def test_odd_group_bye_is_not_a_match():
    """G = 5 Swiss, 3 rounds of 2 matches: each round one player sits out, scoring nothing and playing nothing."""
    responses = ["x" * n for n in (3, 1, 5, 2, 4)]
    result = run_arena(responses, "p", by_length, pairing="swiss", seed=0)
    assert result.rounds == 3 and len(result.pairings) == 6 and result.judge_calls == 12
    assert sum(result.matches) == 12  # 2 matches per round, two players each: byes are not counted
    byes = [3 - m for m in result.matches]
    assert sum(byes) == 3 and max(byes) == 1  # three different players sat out once each
    for i in range(5):  # hand totals from the pairings: the longer response wins each match
        wins = sum(1.0 for p in result.pairings if i in p and len(responses[i]) == max(len(responses[j]) for j in p))
        assert result.wins[i] == wins and result.rewards[i] == wins / result.matches[i]


def test_swiss_is_deterministic_per_seed():
    responses = [f"r{k}" + "x" * ((k * 5) % 11) for k in range(10)]
    runs = [run_arena(responses, "p", by_length, pairing="swiss", seed=s) for s in (4, 4, 5)]
    assert runs[0].pairings == runs[1].pairings and runs[0].rewards == runs[1].rewards
    first_rounds = {
        tuple(run_arena(responses, "p", by_length, pairing="swiss", seed=s).pairings[:5]) for s in range(6)
    }
    assert len(first_rounds) > 1  # the seed really drives round 1
    reward = ArenaReward(by_length, pairing="swiss", seed=4)
    again = ArenaReward(by_length, pairing="swiss", seed=4)
    batch = {"prompts": ["p"] * 10, "completions": responses}
    assert reward(**batch) == again(**batch) and reward(**batch) == again(**batch)


def test_swiss_pairing_search_is_bounded(monkeypatch):
    """Many rounds of a large group: the exponential backtracking gives up (the arena stops) instead of hanging."""
    import trl_stable.rewards.arena as arena

    monkeypatch.setattr(arena, "MAX_PAIRING_SEARCH", 50)
    names = [f"r{k:02d}" for k in range(32)]
    result = run_arena(names, "p", lambda p, a, b: float(a > b), pairing="swiss", rounds=31, both_orders=False)
    pairs = [frozenset(p) for p in result.pairings]
    assert len(pairs) == len(set(pairs)) and result.rounds < 31
    with pytest.raises(ValueError, match="rounds"):
        ArenaReward(by_length, pairing="swiss", rounds=0)  # validated when built, not at the first training step
