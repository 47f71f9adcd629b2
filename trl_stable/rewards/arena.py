"""Group arena reward (GAR): rank a prompt's G completions by pairwise judging; round robin or Swiss pairing, byes,
failed calls and stable indices as docs/agent_steps.md ("Group arena reward") states them."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trl_stable.monitoring.metric_names import ARENA_FAILED_JUDGE_CALLS, ARENA_JUDGE_CALLS
from trl_stable.rewards.critic.templates import PROMPTS_DIR  # the bundled templates (package data), the judge's too
from trl_stable.rewards.dense import failure_cause
from trl_stable.rewards.failure_guard import FailureGuard

Judge = Callable[[str, str, str], float | None]
PAIRINGS = ("round_robin", "swiss")
# Backtracking steps allowed to find one round's rematch-free pairing: the search is exponential in the worst case
# (many rounds for a large G, e.g. 31 rounds of G = 32 took seconds), and a round that needs more stops the arena.
MAX_PAIRING_SEARCH = 20_000
_VERDICTS = (("[[a]]", 1.0), ("[[b]]", 0.0), ("[[c]]", 0.5), ("[[tie]]", 0.5))


def check_arena_args(pairing: str, rounds: int | None) -> None:
    """Raise ValueError for an unknown `pairing` or a `rounds` that is not a positive Swiss round count."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}.")
    if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1):
        raise ValueError(f"rounds must be an int >= 1 or None (ceil(log2 G)), got {rounds!r}.")
    if rounds is not None and pairing == "round_robin":
        raise ValueError("`rounds` applies to pairing='swiss' only; round robin plays every pair once.")


@dataclass
class ArenaResult:
    """The outcome of one arena.

    Attributes:
        rewards: Per response, wins / matches played (0.5 for a response that played no match, e.g. G = 1).
        wins: Per response, the sum of its match scores.
        matches: Per response, the number of matches played.
        buchholz: Per response, the sum of its opponents' final win totals (the Swiss tie-break).
        standings: Response indices, best first (wins, then Buchholz, then index).
        pairings: The matches played, ``(i, j)`` in the order they were played.
        rounds: Rounds played.
        judge_calls: Judge invocations (two per match with `both_orders`).
        failed_calls: Judge calls that failed and were scored as draws.
        failure: Why the first failed call failed (None when none did).
    """

    rewards: list[float]
    wins: list[float]
    matches: list[int]
    buchholz: list[float]
    standings: list[int]
    pairings: list[tuple[int, int]] = field(default_factory=list)
    rounds: int = 0
    judge_calls: int = 0
    failed_calls: int = 0
    failure: str | None = None


class _Tournament:
    """The state of one arena; the driver asks for a round's pairs and records their judge outcomes."""

    def __init__(self, n: int, pairing: str, rounds: int | None, seed: int):
        self.n = n
        self.pairing = pairing
        self.wins = [0.0] * n
        self.opponents: list[list[int]] = [[] for _ in range(n)]  # per player, one entry per match
        self.byes: set[int | None] = set()
        self.pairings: list[tuple[int, int]] = []
        self.rounds_played = 0
        self.judge_calls = 0
        self.failed_calls = 0
        self.failure: str | None = None
        self.max_rounds = 1 if pairing == "round_robin" else rounds or (math.ceil(math.log2(n)) if n > 1 else 0)
        # The seeded order decides round 1 (where every score is 0) and breaks the later rounds' remaining ties.
        seed_order = list(range(n))
        random.Random(seed).shuffle(seed_order)
        self.seed_rank = {player: rank for rank, player in enumerate(seed_order)}
        self.done = n < 2 or self.max_rounds == 0

    def buchholz(self, i: int) -> float:
        return sum(self.wins[j] for j in self.opponents[i])

    def next_round(self) -> list[tuple[int, int]]:
        """The next round's pairs; [] (and done) when the arena is over or no rematch-free pairing is found."""
        if self.done:
            return []
        if self.pairing == "round_robin":
            return [(i, j) for i in range(self.n) for j in range(i + 1, self.n)]
        order = sorted(range(self.n), key=lambda i: (-self.wins[i], -self.buchholz(i), self.seed_rank[i]))
        # Odd: the lowest-ranked player without a bye sits out (all had one: the lowest-ranked), if the rest pair.
        byes = sorted(reversed(order), key=lambda p: p in self.byes) if len(order) % 2 else [None]
        for bye in byes:
            self._budget = MAX_PAIRING_SEARCH
            pairs = self._pair([p for p in order if p != bye])
            if pairs is not None:
                self.byes.add(bye)  # None for an even count: nobody sits out
                return pairs
        self.done = True
        return []

    def _pair(self, players: list[int]) -> list[tuple[int, int]] | None:
        """Rank-order neighbours paired with no rematch, backtracking; None if none exists or the budget runs out."""
        if not players:
            return []
        self._budget -= 1
        if self._budget < 0:
            return None
        first, rest = players[0], players[1:]
        for k, other in enumerate(rest):
            if other in self.opponents[first]:
                continue
            tail = self._pair(rest[:k] + rest[k + 1 :])
            if tail is not None:
                return [(first, other), *tail]
        return None

    def record(
        self, pairs: Sequence[tuple[int, int]], outcomes: list[float | None], per_match: int, cause: str | None
    ) -> None:
        """Score the round's matches from their judge calls (`per_match` each, None a failed call, `cause` why)."""
        self.judge_calls += len(outcomes)
        self.failed_calls += outcomes.count(None)
        if self.failure is None and None in outcomes:
            self.failure = cause
        for m, (i, j) in enumerate(pairs):
            p = _match_score(outcomes[m * per_match : (m + 1) * per_match])
            self.wins[i] += p
            self.wins[j] += 1.0 - p
            self.opponents[i].append(j)
            self.opponents[j].append(i)
        self.pairings += pairs
        self.rounds_played += 1
        self.done = self.rounds_played >= self.max_rounds

    def result(self) -> ArenaResult:
        matches = [len(o) for o in self.opponents]
        rewards = [self.wins[i] / matches[i] if matches[i] else 0.5 for i in range(self.n)]
        buchholz = [self.buchholz(i) for i in range(self.n)]
        standings = sorted(range(self.n), key=lambda i: (-self.wins[i], -buchholz[i], i))
        return ArenaResult(
            rewards=rewards, wins=list(self.wins), matches=matches, buchholz=buchholz, standings=standings,
            pairings=list(self.pairings), rounds=self.rounds_played, judge_calls=self.judge_calls,
            failed_calls=self.failed_calls, failure=self.failure,
        )  # fmt: skip


def _check_prob(value: Any) -> float | None:
    """A judge output as a float in [0, 1]; None for a failed call. Out of range is a judge bug: ValueError."""
    try:
        p = float(value)
    except (TypeError, ValueError):  # None included
        return None
    if math.isnan(p):
        return None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"A judge returned {p}; it must return the first response's win probability in [0, 1].")
    return p


def _call_judges(
    judge: Any, triples: list[tuple[str, str, str]], max_workers: int
) -> tuple[list[float | None], str | None]:
    """Each (prompt, a, b) triple judged concurrently (None: a failed call), and why the first failed call failed."""
    errors: list[str] = []

    def guarded(call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as err:  # noqa: BLE001 - a failed call is a draw, never a crashed training step
            errors.append(f"the judge {failure_cause(err)}")
            return None

    batch = getattr(judge, "judge_batch", None)
    if callable(batch):
        raw = guarded(lambda: list(batch(triples)))
        raw = [None] * len(triples) if raw is None else raw
        if len(raw) != len(triples):
            raise ValueError(f"judge_batch returned {len(raw)} results for {len(triples)} comparisons.")
    elif max_workers <= 1 or len(triples) == 1:
        raw = [guarded(judge, *t) for t in triples]
    else:
        with cf.ThreadPoolExecutor(max_workers=min(max_workers, len(triples))) as pool:
            raw = list(pool.map(lambda t: guarded(judge, *t), triples))
    probs = [_check_prob(v) for v in raw]
    if not errors and any(p is None for p in probs):
        errors.append("the judge gave no verdict (None, NaN or an answer without one)")
    return probs, errors[0] if errors else None


def _match_score(outcomes: Sequence[float | None]) -> float:
    """The first player's score from P(first wins) [, P(second wins) with the order swapped]; a failed call is 0.5.

    Both orders: p = (p_ab + 1 - p_ba) / 2, which cancels a constant bonus for the first slot.
    """
    p_ab, *rest = (0.5 if p is None else p for p in outcomes)
    return 0.5 * (p_ab + 1.0 - rest[0]) if rest else p_ab


def run_arenas(
    groups: Sequence[tuple[str, Sequence[str]]],
    judge: Judge | Any,
    pairing: str = "round_robin",
    rounds: int | None = None,
    both_orders: bool = True,
    seed: int = 0,
    max_workers: int = 8,
) -> list[ArenaResult]:
    """One arena per ``(prompt, responses)`` group, group k seeded with ``seed + k``. The groups advance in lockstep,
    so each round's judge calls of every group run in one batch.

    Args:
        groups: ``(prompt, responses)`` pairs, the responses being the G completions of that prompt.
        judge: ``judge(prompt, a, b) -> P(a beats b)`` in [0, 1] (0.5 = draw); an exception, None or NaN is a
            failed call and counts as a draw. An object with ``judge_batch(triples)`` is called once per round.
        pairing: "round_robin" (every pair, G(G-1)/2 matches) or "swiss" (ceil(log2 G) rounds of ~G/2 matches,
            equal scores paired, no rematches, Buchholz tie-break).
        rounds: Swiss rounds (None: ceil(log2 G)).
        both_orders: Judge (a, b) and (b, a) and average, cancelling position bias (doubles the calls).
        seed: Seed of the Swiss round-1 pairing and of its remaining ties.
        max_workers: Threads calling a judge without ``judge_batch``.
    """
    check_arena_args(pairing, rounds)
    tournaments = [_Tournament(len(responses), pairing, rounds, seed + k) for k, (_, responses) in enumerate(groups)]
    per_match = 2 if both_orders else 1  # judge calls: (a, b), then (b, a) with `both_orders`
    while True:
        pending = [(k, pairs) for k, t in enumerate(tournaments) if (pairs := t.next_round())]
        if not pending:
            return [t.result() for t in tournaments]
        triples = [
            (groups[k][0], groups[k][1][a], groups[k][1][b])
            for k, pairs in pending
            for i, j in pairs
            for a, b in [(i, j), (j, i)][:per_match]
        ]
        outcomes, cause = _call_judges(judge, triples, max_workers)
        cursor = 0
        for k, pairs in pending:
            tournaments[k].record(pairs, outcomes[cursor : cursor + per_match * len(pairs)], per_match, cause)
            cursor += per_match * len(pairs)


def run_arena(responses: Sequence[str], prompt: str, judge: Judge | Any, **options: Any) -> ArenaResult:
    """`gar_rewards` with the full result (wins, matches, Buchholz, standings, pairings, call counts)."""
    return run_arenas([(prompt, responses)], judge, **options)[0]


def gar_rewards(responses: Sequence[str], prompt: str, judge: Judge | Any, **options: Any) -> list[float]:
    """Group arena rewards of `responses` to `prompt`: wins / matches played, in [0, 1], indexed like `responses`.

    Args:
        responses: The G completions of one prompt.
        prompt: The prompt they answer.
        judge: The pairwise judge (see `run_arenas`).
        **options: `pairing`, `rounds`, `both_orders`, `seed`, `max_workers`: see `run_arenas`.

    Returns:
        One reward per response, in the order given.

    Example:
        ```python
        >>> gar_rewards(["a", "bbb", "cc"], "p", lambda p, a, b: float(len(a) > len(b)))
        [0.0, 1.0, 0.5]
        ```
    """
    return run_arena(responses, prompt, judge, **options).rewards


def load_prompt(name: str) -> str:
    """The text of the bundled template ``trl_stable/prompts/<name>`` (package data)."""
    path = PROMPTS_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"Prompt template {path} not found (trl_stable installed without its package data?). Pass the "
            "template text explicitly, e.g. LLMJudge(backend, template=open('arena_judge.txt').read())."
        )
    return path.read_text(encoding="utf-8")


def parse_verdict(answer: str | None) -> float | None:
    """A judge answer's verdict as P(A wins): the last "[[A]]" -> 1, "[[B]]" -> 0, "[[C]]" / "[[tie]]" -> 0.5; None
    without a verdict (a failed call)."""
    lower = (answer or "").lower()
    pos, verdict = max((lower.rfind(token), value) for token, value in _VERDICTS)
    return verdict if pos >= 0 else None


def completion_text(value: Any) -> str:
    """A completion as plain text: a conversational one is the concatenation of its messages' contents."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "\n".join(str(m.get("content", "")) if isinstance(m, Mapping) else str(m) for m in value)
    return "" if value is None else _prompt_text(value)


def _prompt_text(value: Any) -> str:
    """A prompt as plain text (a conversational one as ``role: content`` lines)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "\n".join(
            f"{m.get('role', 'user')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m) for m in value
        )
    return str(value.get("content", "")) if isinstance(value, Mapping) else str(value)


class JudgeRequestsFailed(RuntimeError):
    """Every request of a judge batch failed (the message names the first failure)."""


class LLMJudge:
    """A pairwise judge over an LLM: fills a template, asks a backend, parses the "[[A]]/[[B]]/[[C]]" verdict.

    Args:
        backend: A critic backend (``trl_stable.rewards.critic``: a list of prompts in, a list of answers
            or None out), or any callable with that signature.
        template: Template text with ``{prompt}``, ``{response_a}``, ``{response_b}``; default
            ``prompts/arena_judge.txt``.
        parser: ``answer -> P(A wins) or None``; default `parse_verdict`.

    Use `LLMJudge.from_chat` for a chat-completions style callable ``messages -> answer text``.
    """

    def __init__(
        self,
        backend: Callable[[list[str]], Sequence[str | None]],
        template: str | None = None,
        parser: Callable[[str | None], float | None] = parse_verdict,
    ):
        self.backend = backend
        self.template = template if template is not None else load_prompt("arena_judge.txt")
        for key in ("{prompt}", "{response_a}", "{response_b}"):
            if key not in self.template:
                raise ValueError(f"The judge template must contain {key}.")
        self.parser = parser

    @classmethod
    def from_chat(
        cls,
        chat: Callable[[list[dict[str, str]]], str | None],
        template: str | None = None,
        max_workers: int = 8,
        system_prompt: str | None = None,
    ) -> LLMJudge:
        """A judge over ``chat(messages) -> text`` (e.g. a wrapper around ``client.chat.completions.create``),
        called concurrently on `max_workers` threads; an exception is a failed call (None)."""

        def backend(prompts: list[str]) -> list[str | Exception | None]:
            def ask(prompt: str) -> str | Exception | None:
                messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
                try:
                    return chat([*messages, {"role": "user", "content": prompt}])
                except Exception as err:  # noqa: BLE001 - a failed request is a draw, counted by the arena
                    return err  # in place of its answer

            with cf.ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(prompts) or 1))) as pool:
                return list(pool.map(ask, prompts))

        return cls(backend, template=template)

    def format(self, prompt: str, a: str, b: str) -> str:
        # replace(), not format(): responses may contain braces.
        return self.template.replace("{prompt}", prompt).replace("{response_a}", a).replace("{response_b}", b)

    def judge_batch(self, triples: Sequence[tuple[str, str, str]]) -> list[float | None]:
        """P(A wins) per triple, None for a failed request or an answer without a verdict; raises
        `JudgeRequestsFailed`, naming the first failure, when every request failed."""
        prompts = [self.format(*t) for t in triples]
        answers = list(self.backend(prompts))
        if len(answers) != len(prompts):
            raise ValueError(f"The judge backend returned {len(answers)} answers for {len(prompts)} prompts.")
        failed = [a for a in answers if isinstance(a, Exception)]
        if failed and len(failed) == len(answers):
            cause = f"{type(failed[0]).__name__}: {str(failed[0])[:200]}"
            raise JudgeRequestsFailed(f"every judge request failed, e.g. {cause}")
        return [None if isinstance(a, Exception) else self.parser(a) for a in answers]

    def __call__(self, prompt: str, a: str, b: str) -> float | None:
        """P(a beats b) for one pair; None for a failed request or an answer without a verdict."""
        try:
            return self.judge_batch([(prompt, a, b)])[0]
        except JudgeRequestsFailed:
            return None


class ArenaReward:
    """GAR as a TRL reward function (``reward_funcs=[ArenaReward(judge, pairing="swiss")]``): one arena per prompt
    of the batch, every judge call of a round across all arenas at once. Arena k of call c is seeded with
    ``seed + c * 100003 + k``, so Swiss round-1 pairings change from step to step, reproducibly.

    Groups are found by prompt text (a reward function is not told ``num_generations``): a prompt drawn twice into one
    batch plays one arena of 2G completions, and with several processes ``per_device_train_batch_size`` should be a
    multiple of ``num_generations``, as a group split across processes plays as two smaller arenas.

    Args:
        judge: A pairwise judge (see `run_arenas`) or an `LLMJudge`.
        pairing / rounds / both_orders: See `run_arenas`.
        seed: Base seed.
        max_workers: Judge calls in flight at once (ignored by a ``judge_batch`` judge, which batches itself).
        max_failing_steps: A dead judge (every call of a step failed) gives every completion 0.5, a constant reward;
            after this many such steps in a row the call raises `RewardComponentFailure` naming the judge's cause
            (each one warns). None: never stop.

    Attributes:
        judge_calls / failed_calls: Cumulative counts, also logged per call as ``arena/judge_calls`` and
        ``arena/failed_judge_calls``; checkpoints keep them and the failure guard (`checkpoint_state`).
    """

    def __init__(
        self,
        judge: Judge | Any,
        pairing: str = "round_robin",
        rounds: int | None = None,
        both_orders: bool = True,
        seed: int = 0,
        max_workers: int = 8,
        max_failing_steps: int | None = 5,
    ):
        check_arena_args(pairing, rounds)
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}.")
        self.judge = judge
        self.pairing = pairing
        self.rounds = rounds
        self.both_orders = both_orders
        self.seed = seed
        self.max_workers = max_workers
        self.judge_calls = 0
        self.failed_calls = 0
        self._num_calls = 0
        self._lock = threading.Lock()
        self.__name__ = f"arena_{pairing}"
        self.guard = FailureGuard(
            f"The arena judge of reward function '{self.__name__}'",
            max_failing_steps,
            "ArenaReward(max_failing_steps=...)",
        )

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        order: dict[str, list[int]] = {}
        for idx, p in enumerate(prompts):
            order.setdefault(p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str), []).append(idx)
        members = list(order.values())
        groups = [(_prompt_text(prompts[m[0]]), [completion_text(completions[i]) for i in m]) for m in members]
        with self._lock:
            base_seed = self.seed + self._num_calls * 100003
            self._num_calls += 1
        results = run_arenas(
            groups, self.judge, self.pairing, self.rounds, self.both_orders, base_seed, self.max_workers
        )
        by_index = {idx: reward for m, result in zip(members, results) for idx, reward in zip(m, result.rewards)}
        calls = sum(r.judge_calls for r in results)
        failed = sum(r.failed_calls for r in results)
        with self._lock:
            self.judge_calls += calls
            self.failed_calls += failed
            self.guard.record(calls > 0 and failed == calls, next((r.failure for r in results if r.failure), None))
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            log_metric(ARENA_JUDGE_CALLS, float(calls))  # counts: summed over processes by the trainers
            log_metric(ARENA_FAILED_JUDGE_CALLS, float(failed))
        return [by_index[idx] for idx in range(len(completions))]  # every completion played in its prompt's arena

    def checkpoint_state(self) -> dict[str, Any]:
        """The counts, the seed stream's position and the failure guard, for a trainer's checkpoint."""
        return {
            "judge_calls": self.judge_calls,
            "failed_calls": self.failed_calls,
            "num_calls": self._num_calls,
            "guard": self.guard.checkpoint_state(),
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.judge_calls, self.failed_calls = int(state["judge_calls"]), int(state["failed_calls"])
        self._num_calls = int(state["num_calls"])
        self.guard.load_checkpoint_state(state["guard"])
