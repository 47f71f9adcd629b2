"""Text diversity of generations (the training logs' distinct-2 and the evaluation scripts' dist-n)."""

from __future__ import annotations

from collections.abc import Sequence


def distinct_n(generations: Sequence[str], n: int) -> float:
    """dist-n of one prompt's samples: distinct word n-grams over all samples / total words of the samples.

    dist-n (docs/evaluation.md) = |{n-grams of all samples}| / sum_i |words(sample_i)|, words = `str.split()`
    (whitespace runs). The denominator is the total word count for every n (not the n-gram count), as in the
    DExperts/RELC code; that code split on single spaces (`split(' ')`), which also counts an empty "word" for the
    leading space of a continuation and for double spaces, giving slightly lower values than here. 0 when there are
    no words. (The evaluation scripts' `eval_utils.distinct_n` is this function.)
    """
    ngrams = set()
    total_words = 0
    for text in generations:
        words = text.split()
        total_words += len(words)
        ngrams.update(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return len(ngrams) / total_words if total_words else 0.0
