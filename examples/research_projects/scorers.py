"""Environment scorers shared by the training scripts (as rewards) and the evaluation scripts (as metrics).

- sentiment: VADER offline (compound c -> positive probability (c + 1) / 2), two other offline lexicons for
  evaluation (TextBlob's pattern adjective lexicon, AFINN-165), or a transformers classifier (paper:
  lvwerra/distilbert-imdb for training, distilbert-base-uncased-finetuned-sst-2-english for evaluation);
- toxicity: Perspective API when a key is given (threaded, rate-limited, retried), else the local
  alt-profanity-check classifier;
- summarization: ROUGE-1/2/L F-measures with stemming (rouge-score).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from tqdm.auto import tqdm

VADER = "vader"
# Offline sentiment evaluators built independently of VADER (the embedded environment reward): TextBlob's
# PatternAnalyzer (De Smedt & Daelemans, JMLR 2012: hand-rated adjectives of product reviews) and AFINN-165
# (Nielsen 2011, the word list of the embedded critic, `critic_lexicon="afinn"`).
TEXTBLOB = "textblob"
AFINN = "afinn"
OFFLINE_SENTIMENT = (VADER, TEXTBLOB, AFINN)
LOCAL_TOXICITY = "profanity_check"
PERSPECTIVE = "perspective"
PERSPECTIVE_URL = "https://commentanalyzer.googleapis.com/v1alpha1/comments:analyze"
PERSPECTIVE_KEY_ENV = "PERSPECTIVE_API_KEY"


def vader_compound(texts: Sequence[str]) -> list[float]:
    """VADER compound sentiment in [-1, 1] of each text (0 for text without sentiment words)."""
    analyzer = _vader()
    return [analyzer.polarity_scores(t)["compound"] for t in texts]


_VADER_ANALYZER = None


def _vader():
    global _VADER_ANALYZER
    if _VADER_ANALYZER is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _VADER_ANALYZER = SentimentIntensityAnalyzer()
    return _VADER_ANALYZER


def textblob_polarity(texts: Sequence[str]) -> list[float]:
    """TextBlob's PatternAnalyzer polarity in [-1, 1] of each text (``pip install textblob``; no corpus download)."""
    from textblob import TextBlob

    return [float(TextBlob(t).sentiment.polarity) for t in texts]


def afinn_score(texts: Sequence[str]) -> list[float]:
    """Sum of the AFINN-165 valences (-5..5) of each text's words, a negator ("not", "n't", ...) among the three
    preceding words of the same clause flipping a word, as the AFINN lexicon critic reads them."""
    critic = _afinn_critic()
    return [sum(valence for _, _, valence in critic.scored_spans(t)) for t in texts]


_AFINN_CRITIC = None


def _afinn_critic():
    global _AFINN_CRITIC
    if _AFINN_CRITIC is None:
        from trl_stable.rewards import LexiconCritic

        _AFINN_CRITIC = LexiconCritic("sentiment", lexicon="afinn")
    return _AFINN_CRITIC


def build_sentiment_classifier(
    name: str = VADER, device: int | str | None = None
) -> Callable[[list[str]], list[float]]:
    """A function from texts to positive-class probabilities in [0, 1].

    "vader": VADER's compound score c mapped to (c + 1) / 2, so "positive" (p > 0.5) means c > 0 and a text with
    no sentiment words (c = 0) does not count as positive. "textblob": TextBlob's polarity p mapped to (p + 1) / 2.
    "afinn": the AFINN sum s mapped to (tanh(s / 5) + 1) / 2. For all three, positive means a score above 0.
    Otherwise a transformers text-classification model: the probability of its positive label (a label containing
    "POS", or LABEL_1 for unnamed binary labels).
    """
    if name == VADER:
        return lambda texts: [(c + 1.0) / 2.0 for c in vader_compound(texts)]
    if name == TEXTBLOB:
        return lambda texts: [(p + 1.0) / 2.0 for p in textblob_polarity(texts)]
    if name == AFINN:
        return lambda texts: [(math.tanh(s / 5.0) + 1.0) / 2.0 for s in afinn_score(texts)]
    pipe = _hf_pipeline(name, device)

    def score(texts: list[str]) -> list[float]:
        return [_positive(labels, name) for labels in pipe(list(texts), batch_size=32)]

    return score


def build_sentiment_logit(name: str, device: int | str | None = None) -> Callable[[list[str]], list[float]]:
    """The positive-class logit of a transformers classifier: RELC's training reward (lvwerra/distilbert-imdb)."""
    pipe = _hf_pipeline(name, device)

    def score(texts: list[str]) -> list[float]:
        return [_positive(labels, name) for labels in pipe(list(texts), batch_size=32, function_to_apply="none")]

    return score


def _hf_pipeline(name: str, device: int | str | None = None):
    """A text-classification pipeline returning every label's score; by default on this process's GPU (its
    LOCAL_RANK under `accelerate launch`, so the ranks do not all crowd GPU 0), else the CPU."""
    import torch
    from transformers import pipeline

    if device is None:
        device = int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.is_available() else -1
    return pipeline("text-classification", model=name, top_k=None, truncation=True, device=device)


def _positive(labels: list[dict], name: str) -> float:
    by_label = {d["label"].upper(): float(d["score"]) for d in labels}
    pos = next((v for k, v in by_label.items() if "POS" in k), by_label.get("LABEL_1"))
    if pos is None:
        raise ValueError(f"Classifier {name!r} has no positive label among {sorted(by_label)}.")
    return pos


# Labels of the harmless class of toxicity classifiers (facebook/roberta-hate-speech-dynabench-r4-target: nothate).
SAFE_LABELS = ("nothate", "non-toxic", "neutral")


def build_toxicity_classifier(name: str, device: int | str | None = None) -> Callable[[list[str]], list[float]]:
    """Toxicity of a transformers classifier: 1 - probability of its harmless label (one of `SAFE_LABELS`)."""
    pipe = _hf_pipeline(name, device)

    def toxicity(texts: list[str]) -> list[float]:
        out = []
        for labels in pipe(list(texts), batch_size=32):
            safe = [float(d["score"]) for d in labels if d["label"].lower() in SAFE_LABELS]
            if not safe:
                raise ValueError(
                    f"Classifier {name!r} has no harmless label among {sorted(d['label'] for d in labels)}; "
                    f"use one whose labels include one of {SAFE_LABELS}."
                )
            out.append(1.0 - sum(safe))
        return out

    return toxicity


def local_toxicity(texts: Sequence[str]) -> list[float]:
    """Toxicity probability of each text from alt-profanity-check (a linear SVM over a bag of words)."""
    from profanity_check import predict_prob

    texts = list(texts)
    if not texts:
        return []
    return [float(p) for p in predict_prob([t if t.strip() else "." for t in texts])]


class PerspectiveScorer:
    """Toxicity from Google's Perspective API, threaded and rate-limited.

    The key is read from `api_key` or the ``PERSPECTIVE_API_KEY`` environment variable, sent in the
    ``x-goog-api-key`` header (never in the URL), and never printed, logged or put in an error message. Failed
    requests are retried with exponential backoff and jitter on 429, 5xx and network errors; a text that still
    fails scores None (counted in `failures`) so the caller can skip it rather than crash, as RELC's eval did.

    Args:
        api_key: The API key; default ``$PERSPECTIVE_API_KEY``.
        rate: Requests per second over all threads (the default Perspective quota is 1 QPS).
        num_threads: Concurrent requests.
        url: Endpoint (a test can point it at a local server).
        timeout: Seconds per request.
        max_retries: Retries after the first attempt.
    """

    def __init__(
        self,
        api_key: str | None = None,
        rate: float = 1.0,
        num_threads: int = 8,
        url: str = PERSPECTIVE_URL,
        timeout: float = 20.0,
        max_retries: int = 3,
        backoff: float = 1.0,
    ):
        key = api_key or os.environ.get(PERSPECTIVE_KEY_ENV)
        if not key:
            raise ValueError(f"No Perspective API key: set {PERSPECTIVE_KEY_ENV} or pass api_key.")
        self._key = key
        self.url = url
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.num_threads = num_threads
        # imported here so that the scorers stay import-light (trl_stable pulls in torch and TRL)
        from trl_stable.rewards.critic.rate_limit import RateLimiter

        self.limiter = RateLimiter(rate)
        self.requests = 0
        self.failures = 0
        self.retries = 0
        self._count_lock = threading.Lock()

    def __repr__(self) -> str:  # the key stays out of any repr that ends up in a log
        return f"PerspectiveScorer(url={self.url!r}, threads={self.num_threads}, rate={1 / self.limiter.interval:g}/s)"

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def score_one(self, text: str) -> float | None:
        body = json.dumps(
            {"comment": {"text": text or "."}, "languages": ["en"], "requestedAttributes": {"TOXICITY": {}}}
        ).encode()
        for attempt in range(self.max_retries + 1):
            self.limiter.acquire()
            self._count(requests=1)
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json", "x-goog-api-key": self._key}
            )
            retryable = True
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = json.loads(response.read().decode())
                return float(payload["attributeScores"]["TOXICITY"]["summaryScore"]["value"])
            except urllib.error.HTTPError as err:
                retryable = err.code == 429 or err.code >= 500
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
                retryable = True
            except (ValueError, KeyError, TypeError):  # malformed answer: asking again rarely helps
                retryable = False
            if not retryable or attempt == self.max_retries:
                break
            self._count(retries=1)
            time.sleep(self.backoff * (2**attempt) * (0.5 + random.random()))
        self._count(failures=1)
        return None

    def __call__(self, texts: Sequence[str], show_progress: bool = False) -> list[float | None]:
        with ThreadPoolExecutor(max_workers=self.num_threads) as pool:
            iterator = pool.map(self.score_one, list(texts))
            return list(tqdm(iterator, total=len(texts), desc="Perspective API", disable=not show_progress))


def build_toxicity_scorer(
    scorer: str = "auto", api_key: str | None = None, local: str = LOCAL_TOXICITY, **perspective_kwargs
) -> tuple[str, Callable[[list[str]], list[float | None]]]:
    """(name, function from texts to toxicity in [0, 1] or None on a failed API call).

    `scorer`: "auto" (Perspective when a key is given or in ``$PERSPECTIVE_API_KEY``, else `local`), "perspective",
    "profanity_check" (alt-profanity-check) or the name of a transformers toxicity classifier
    (`build_toxicity_classifier`). `perspective_kwargs` go to `PerspectiveScorer` (rate, num_threads, url, ...).
    """
    key = api_key or os.environ.get(PERSPECTIVE_KEY_ENV)
    if scorer == "auto":
        scorer = PERSPECTIVE if key else local
    if scorer == PERSPECTIVE:
        return PERSPECTIVE, PerspectiveScorer(api_key=key, **perspective_kwargs)
    if scorer == LOCAL_TOXICITY:
        return LOCAL_TOXICITY, local_toxicity
    return scorer, build_toxicity_classifier(scorer)


def continuation_logprobs(model, tokenizer, prompt: str, continuation: str):
    """log P(c_t | prompt, c_<t) of each token of `continuation` under a causal LM (1-D tensor; empty when the
    continuation has no token).

    The prompt is tokenized with the tokenizer's special tokens (a BOS where the model expects one), the continuation
    without (no BOS in the middle), and the two id lists are concatenated: the continuation is scored as the tokens
    it is made of, not re-merged with the prompt's last word. An empty prompt gets the BOS (or EOS) token as context,
    so the first continuation token is scored too.
    """
    import torch

    p_ids = tokenizer(prompt)["input_ids"] if prompt else []
    if not p_ids:
        p_ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
    c_ids = tokenizer(continuation, add_special_tokens=False)["input_ids"] if continuation else []
    if not c_ids:
        return torch.zeros(0)
    with torch.no_grad():
        ids = torch.tensor([p_ids + c_ids], device=model.device)
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(p_ids) - 1 : -1].float(), dim=-1)
        return logp.gather(-1, ids[0, len(p_ids) :, None])[:, 0].cpu()


class RougeScorer:
    """ROUGE-1/2/L F-measures with Porter stemming (rouge-score), each in [0, 1]."""

    TYPES = ("rouge1", "rouge2", "rougeL")

    def __init__(self):
        from rouge_score import rouge_scorer

        self._scorer = rouge_scorer.RougeScorer(list(self.TYPES), use_stemmer=True)

    def score(self, prediction: str, reference: str) -> dict[str, float]:
        scores = self._scorer.score(reference, prediction)
        return {k: scores[k].fmeasure for k in self.TYPES}

    def __call__(self, predictions: Sequence[str], references: Sequence[str]) -> list[dict[str, float]]:
        return [self.score(p, r) for p, r in zip(predictions, references)]
