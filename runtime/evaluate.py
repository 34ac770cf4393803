"""Perplexity and agreement of next-token distributions, for any artifact and backend.

Each window of S tokens is scored the way generation runs, so both graphs and the KV handoff
between them count (h = S // 2):

    decode(empty cache, tokens 0..h-1)   -> predictions of tokens 1..h-1   (decode returns every
                                            position; prefill returns only the last)
    prefill(tokens 0..h-1)               -> prediction of token h, and the KV cache of 0..h-1
    decode(that cache, tokens h..S-1)    -> predictions of tokens h+1..S-1

Every token but the first is predicted exactly once; a fault in either graph, or in the cache
prefill writes for decode, shows up in the score. Perplexity, top-1 agreement and mean KL are
``llmx.compare``'s (the arithmetic verify and calibrate share).

Torch-free: numpy on the logits the backend returns.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from llmx.compare import Agreement, Score
from llmx.errors import InputError
from llmx.runtime.sampling import log_softmax

_LOGITS_BUDGET = 1 << 24  # floats of logits per decode call: bounds memory on large vocabularies


def window_logprobs(backend, windows: list[list[int]]) -> Iterable[np.ndarray]:
    """Next-token log-probabilities [S-1, V] for each window, in order."""
    if not windows:
        return
    length = len(windows[0])
    if any(len(w) != length for w in windows):
        raise InputError("evaluation windows must all have the same length")
    if length < 4:
        raise InputError("an evaluation window needs at least 4 tokens")
    if length > backend.max_seq_len:
        raise InputError(f"windows of {length} tokens exceed the model's maximum length {backend.max_seq_len}")
    rows = max(1, min(8, _LOGITS_BUDGET // (length * backend.vocab_size)))
    for start in range(0, len(windows), rows):
        batch = np.asarray(windows[start : start + rows], dtype=np.int64)
        for logits in _score(backend, batch):
            yield log_softmax(logits)


def _score(backend, batch: np.ndarray) -> np.ndarray:
    """Logits [n, S-1, V] predicting tokens 1..S-1 of each row: decode, prefill, decode on its cache."""
    n, length = batch.shape
    half = length // 2
    head = backend.decode(backend.new_cache(n, length), batch[:, :half])[:, : half - 1].astype(np.float32)  # copy
    cache = backend.new_cache(n, length)
    handoff = backend.prefill(cache, list(range(n)), batch[:, :half].tolist())[:, None].astype(np.float32)
    tail = backend.decode(cache, batch[:, half:])[:, :-1]  # the backend reuses this buffer: used right away
    return np.concatenate([head, handoff, tail], axis=1)


def perplexity(backend, windows: list[list[int]], progress: Callable[[int], None] = lambda n: None,
               score_from: int = 1) -> Score:
    """``score_from``: the first position of each window scored; those before are context only
    (llama.cpp's llama-perplexity scores the second half of each window)."""
    if not 1 <= score_from < len(windows[0] if windows else [0, 0]):
        raise InputError(f"--score-from {score_from} must be at least 1 and less than the window length")
    score = Score()
    for window, logprobs in zip(windows, window_logprobs(backend, windows)):
        score.add(logprobs[score_from - 1:], np.asarray(window[score_from:]))
        progress(1)
    return score


def agreement(reference, candidate, windows: list[list[int]], progress: Callable[[int], None] = lambda n: None) -> Agreement:
    """Score two backends window by window (one window's logits of each in memory at a time)."""
    return agree((next(iter(window_logprobs(reference, [w]))) for w in windows),
                 (next(iter(window_logprobs(candidate, [w]))) for w in windows), windows, progress)


def agree(reference: Iterable[np.ndarray], candidate: Iterable[np.ndarray], windows: list[list[int]],
          progress: Callable[[int], None] = lambda n: None) -> Agreement:
    """Score two sides' log-probabilities of ``windows``, one window of each at a time, in order."""
    result = Agreement()
    for window, ref, cand in zip(windows, reference, candidate):
        result.add(ref, cand, np.asarray(window[1:]))
        progress(1)
    return result
