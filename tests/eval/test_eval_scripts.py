"""Evaluation scripts: metric definitions against hand-computed values, the Perspective client against a local HTTP
server, and each script end to end on a tiny kit model."""

import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from trl_stable.testing import build_causal_lm, build_reward_model, build_tokenizer, save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    tok = build_tokenizer()
    return save_tiny(tmp_path_factory.mktemp("tiny_lm"), build_causal_lm("gpt2", tok, seed=0), tok)


def test_distinct_n_matches_hand_count():
    from eval_utils import distinct_n

    gens = ["the cat sat", "the cat ran"]  # 6 words
    assert distinct_n(gens, 1) == pytest.approx(4 / 6)  # the, cat, sat, ran
    assert distinct_n(gens, 2) == pytest.approx(3 / 6)  # (the cat), (cat sat), (cat ran)
    assert distinct_n(gens, 3) == pytest.approx(2 / 6)
    assert distinct_n(["", ""], 1) == 0.0


def test_conditional_perplexity_matches_token_by_token_reference(tiny_dir):
    from eval_utils import conditional_perplexity, load_causal_lm

    model, tok = load_causal_lm(tiny_dir, device="cpu")
    prompt, gen = "The movie was", " great and warm"
    ppl = conditional_perplexity(model, tok, [prompt], [[gen, ""]])[0]
    # Independent reference: one forward per generated token, probability of that token given everything before it.
    p_ids, g_ids = tok(prompt)["input_ids"], tok(gen)["input_ids"]
    nll = 0.0
    with torch.no_grad():
        for k, target in enumerate(g_ids):
            ctx = torch.tensor([p_ids + g_ids[:k]])
            probs = torch.softmax(model(input_ids=ctx).logits[0, -1].double(), -1)
            nll -= math.log(probs[target].item())
    assert ppl[0] == pytest.approx(math.exp(nll / len(g_ids)), rel=1e-4)
    assert math.isnan(ppl[1])  # an empty generation has no perplexity


def test_toxicity_metrics_by_hand():
    from eval_toxicity import toxicity_metrics

    m = toxicity_metrics([[0.1, 0.7, None], [0.2, 0.3], [None, None]])
    assert m["avg_max_toxicity"] == pytest.approx((0.7 + 0.3) / 2)
    assert m["toxicity_prob"] == pytest.approx(0.5) and m["num_prompts"] == 2 and m["failed_samples"] == 3


def test_vader_classifier_maps_compound_to_probability():
    from scorers import build_sentiment_classifier, vader_compound

    texts = ["I loved this wonderful film", "a terrible, boring mess", "the train leaves at noon"]
    probs = build_sentiment_classifier("vader")(texts)
    assert probs == pytest.approx([(c + 1) / 2 for c in vader_compound(texts)])
    assert probs[0] > 0.5 > probs[1] and probs[2] == 0.5  # neutral text is not counted as positive (p > 0.5)


def test_rouge_uses_stemming():
    from scorers import RougeScorer

    scores = RougeScorer().score("the cats were running", "the cat was running")
    assert scores["rouge1"] == pytest.approx(0.75)  # the, cat(s), running match; were/was do not


class _FakePerspective(BaseHTTPRequestHandler):
    calls: list = []
    script: list = []  # status codes to answer with, in order; then 200
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.calls.append((time.monotonic(), self.path, self.headers.get("x-goog-api-key"), body))
            status = self.script.pop(0) if self.script else 200
        if status != 200:
            self.send_response(status)
            self.end_headers()
            return
        score = 0.9 if "idiot" in body["comment"]["text"] else 0.1
        payload = json.dumps({"attributeScores": {"TOXICITY": {"summaryScore": {"value": score}}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture()
def perspective_server():
    _FakePerspective.calls, _FakePerspective.script = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakePerspective)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1alpha1/comments:analyze", _FakePerspective
    server.shutdown()
    server.server_close()


def test_perspective_scorer_threads_rate_limit_retries_and_hides_key(perspective_server):
    from scorers import PerspectiveScorer

    url, handler = perspective_server
    handler.script = [429, 500]  # two transient failures, then answers
    scorer = PerspectiveScorer(api_key="sk-SECRET", rate=20.0, num_threads=4, url=url, backoff=0.01)
    slots = []  # the limiter's start slots, in the order it handed them out
    real_acquire = scorer.limiter.acquire

    def acquire(*args, **kwargs):
        slot = real_acquire(*args, **kwargs)
        slots.append(slot)
        return slot

    scorer.limiter.acquire = acquire
    scores = scorer(["you idiot", "hello there", "nice day", "what an idiot"])
    assert scores == [0.9, 0.1, 0.1, 0.9]
    assert scorer.retries == 2 and scorer.failures == 0 and scorer.requests == 6
    assert all(key == "sk-SECRET" and "SECRET" not in path for _, path, key, _ in handler.calls)
    assert "SECRET" not in repr(scorer)
    # every request, retries included, took a slot from the rate limiter, and the slots are 1/20 s apart although 4
    # threads were ready (the limiter's own timing is tested in tests/rewards/test_rate_limiter.py); the slots are
    # read from the limiter, not from the server's clock, so machine load cannot move them
    assert len(slots) == scorer.requests == 6
    gaps = [b - a for a, b in zip(sorted(slots), sorted(slots)[1:])]
    assert min(gaps) >= 1 / 20 - 1e-9


def test_perspective_failure_scores_none_and_eval_skips_it(perspective_server, tmp_path, monkeypatch):
    import eval_toxicity
    from scorers import PerspectiveScorer

    url, handler = perspective_server
    handler.script = [400]  # a client error is not retried
    scorer = PerspectiveScorer(api_key="k", rate=100.0, url=url, backoff=0.0, max_retries=2)
    assert scorer(["x"]) == [None] and scorer.failures == 1 and scorer.retries == 0

    gens = tmp_path / "run_generations.jsonl"
    rows = [{"prompt": {"text": "p"}, "generations": [{"text": "you idiot"}, {"text": "fine"}]}]
    gens.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv("PERSPECTIVE_API_KEY", "sk-ENV-SECRET")
    handler.script = [400]  # the first sample fails for good; the other is scored
    summary = eval_toxicity.evaluate(
        eval_toxicity.ToxicityEvalArgs(
            generations_files=[str(gens)], perspective_url=url, rate=100.0, output_dir=str(tmp_path / "out")
        )
    )
    assert summary["run"]["scorer"] == "perspective" and summary["run"]["failed_samples"] == 1
    assert summary["run"]["avg_max_toxicity"] == pytest.approx(0.1)
    for f in (tmp_path / "out").iterdir():
        assert f.suffix == ".png" or "ENV-SECRET" not in f.read_text()


def test_perspective_without_key_is_a_clear_error(monkeypatch):
    from scorers import PerspectiveScorer, build_toxicity_scorer

    monkeypatch.delenv("PERSPECTIVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="PERSPECTIVE_API_KEY"):
        PerspectiveScorer()
    assert build_toxicity_scorer("auto")[0] == "profanity_check"


def test_eval_sentiment_and_toxicity_compare_runs(tiny_dir, tmp_path):
    import eval_sentiment
    import eval_toxicity

    summary = eval_sentiment.evaluate(
        eval_sentiment.SentimentEvalArgs(
            models=[tiny_dir, tiny_dir], names=["baseline", "intrinsic"], num_prompts=2, num_return=2,
            max_new_tokens=5, output_dir=str(tmp_path / "s"),
        )
    )  # fmt: skip
    assert set(summary) == {"baseline", "intrinsic"} and summary["baseline"]["num_samples"] == 4
    rows = [json.loads(x) for x in (tmp_path / "s" / "baseline_generations.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and len(rows[0]["generations"]) == 2 and "positive_prob" in rows[0]["generations"][0]
    assert (tmp_path / "s" / "summary.md").read_text().startswith("| run | positive_rate")
    assert (tmp_path / "s" / "comparison.png").stat().st_size > 0

    tox = eval_toxicity.evaluate(
        eval_toxicity.ToxicityEvalArgs(
            models=[tiny_dir], names=["tiny"], num_prompts=2, num_return=3, max_new_tokens=5, scorer="profanity_check",
            output_dir=str(tmp_path / "t"),
        )
    )  # fmt: skip
    assert 0.0 <= tox["tiny"]["avg_max_toxicity"] <= 1.0 and tox["tiny"]["num_prompts"] == 2


def test_eval_summarization_with_reward_model(tiny_dir, tmp_path):
    import eval_summarization

    tok = build_tokenizer()
    rm_dir = save_tiny(tmp_path / "rm", build_reward_model("gpt2", tok, seed=1), tok)
    summary = eval_summarization.evaluate(
        eval_summarization.SummarizationEvalArgs(
            models=[tiny_dir], names=["tiny"], num_samples=2, max_new_tokens=5, reward_model_path=rm_dir,
            output_dir=str(tmp_path / "out"),
        )
    )  # fmt: skip
    metrics = summary["tiny"]
    assert {"rouge1", "rouge2", "rougeL", "rm_score", "rm_reference_score", "preference_rate"} <= set(metrics)
    assert metrics["preference_rate"] in (0.0, 0.5, 1.0)


def test_distinct_n_denominator_is_total_whitespace_words():
    """docs/evaluation.md: distinct n-grams over the prompt's samples / total words, for every n; words are
    whitespace runs, so a leading space or a double space adds no empty word (DExperts' split(' ') would count one)."""
    from eval_utils import distinct_n

    gens = [" good film", "good  film here"]  # 2 + 3 = 5 words
    assert distinct_n(gens, 1) == pytest.approx(3 / 5)  # good, film, here
    assert distinct_n(gens, 2) == pytest.approx(2 / 5)  # (good film), (film here)
    assert distinct_n(gens, 3) == pytest.approx(1 / 5)  # (good film here)


def test_positive_rate_is_strictly_above_one_half_and_toxicity_max_at_one_half_counts():
    from eval_sentiment import sentiment_metrics
    from eval_toxicity import toxicity_metrics

    m = sentiment_metrics([[0.5, 0.51], [0.2, 0.9]])
    assert m["positive_rate"] == pytest.approx(2 / 4) and m["positive_prob"] == pytest.approx(2.11 / 4)
    t = toxicity_metrics([[0.5, 0.1], [0.49, 0.2], [0.0, 0.3]])
    assert t["toxicity_prob"] == pytest.approx(1 / 3) and t["avg_max_toxicity"] == pytest.approx(
        (0.5 + 0.49 + 0.3) / 3
    )


def test_eval_sampling_defaults_are_the_papers(tiny_dir):
    """25 samples per prompt, nucleus top-p 0.9 (no top-k), 20 new tokens."""
    from eval_sentiment import SentimentEvalArgs
    from eval_toxicity import ToxicityEvalArgs
    from eval_utils import load_causal_lm, sample_continuations

    for args in (SentimentEvalArgs(), ToxicityEvalArgs()):
        assert (args.num_return, args.top_p, args.max_new_tokens) == (25, 0.9, 20)
    model, tok = load_causal_lm(tiny_dir, device="cpu")
    seen = {}
    real = model.generate

    def spy(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    model.generate = spy
    gens = sample_continuations(model, tok, ["The movie", "A film"], num_return=3, max_new_tokens=4)
    assert (seen["top_p"], seen["top_k"], seen["do_sample"], seen["num_return_sequences"]) == (0.9, 0, True, 3)
    assert seen["max_new_tokens"] == 4 and [len(g) for g in gens] == [3, 3]


class _BosTokenizer:
    """The kit tokenizer with a BOS in front when special tokens are asked for (as Llama-style tokenizers do)."""

    def __init__(self):
        self.inner = build_tokenizer()
        self.bos_token_id, self.eos_token_id = self.inner.bos_token_id, self.inner.eos_token_id

    def __call__(self, text, add_special_tokens=True):
        ids = self.inner(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": [self.bos_token_id, *ids] if add_special_tokens else ids}


def test_continuation_logprobs_context_bos_and_empty_prompt(tiny_dir):
    from eval_utils import load_causal_lm
    from scorers import continuation_logprobs

    model, _ = load_causal_lm(tiny_dir, device="cpu")
    tok = _BosTokenizer()

    def reference(context, target):
        out = []
        with torch.no_grad():
            for k, t in enumerate(target):
                logits = model(input_ids=torch.tensor([context + target[:k]])).logits[0, -1].double()
                out.append(torch.log_softmax(logits, -1)[t].item())
        return out

    gen = tok(" was good", add_special_tokens=False)["input_ids"]
    prompt = tok("The movie")["input_ids"]  # BOS first
    got = continuation_logprobs(model, tok, "The movie", " was good")
    assert got.tolist() == pytest.approx(reference(prompt, gen), abs=1e-4)  # no BOS between prompt and continuation
    empty = continuation_logprobs(model, tok, "", " was good")
    assert len(empty) == len(gen) and empty.tolist() == pytest.approx(reference([tok.bos_token_id], gen), abs=1e-4)
    assert len(continuation_logprobs(model, tok, "The movie", "")) == 0


def test_grpo_fluency_reward_is_inverse_conditional_perplexity(tiny_dir):
    import importlib.util
    from pathlib import Path

    from eval_utils import conditional_perplexity, load_causal_lm

    path = Path(__file__).resolve().parents[2] / "examples/research_projects/sentiment/grpo_intrinsic.py"
    name = "sentiment_grpo_intrinsic"  # a script: imported by path, registered first (its dataclasses look it up)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    grpo = sys.modules[name]
    model, tok = load_causal_lm(tiny_dir, device="cpu")
    prompts, completions = ["The movie", "A film"], [" was good", " ran long"]
    fluency = grpo.fluency_reward(model, tok)(prompts, completions)
    ppl = conditional_perplexity(model, tok, prompts, [[c] for c in completions])
    assert fluency == pytest.approx([1 / row[0] for row in ppl], rel=1e-5)
