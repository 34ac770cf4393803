"""Sampling: pure functions from a logits row to a token, plus the parameters that drive them.

Order follows transformers' processors: penalties, temperature, then the filters top-k,
top-p, min-p and typical-p, then a draw from the sequence's own seeded generator (so a
sequence's tokens never depend on what else is in the batch). ``temperature == 0`` is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from llmx.runtime.params import SAMPLING, check_sampling

if TYPE_CHECKING:
    from llmx.runtime.constraints import CompiledConstraint


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and the top k
    skip_special_tokens: bool = True  # False shows control tokens that carry meaning (Mistral's [TOOL_CALLS])
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit; -100 bans it
    constraint: "CompiledConstraint | None" = None  # output must match it (runtime/constraints.py)

    def validate(self) -> "SamplingParams":
        """Refuse values outside runtime/params.py's ranges (the server's, word for word)."""
        check_sampling({name: getattr(self, name) for name in SAMPLING})
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_penalties(logits: np.ndarray, params: SamplingParams, context_ids: np.ndarray, output_counts: dict[int, int]) -> np.ndarray:
    """Repetition penalty over ``context_ids`` (prompt + output); presence/frequency over output."""
    if params.repetition_penalty != 1.0 and len(context_ids):
        # No np.unique (232 us at 4k tokens, the penalty 12): a repeated id gathers the same
        # unpenalized value and writes the same result, so it is penalized once all the same.
        picked = logits[context_ids]
        logits[context_ids] = np.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_counts:
        ids = np.fromiter(output_counts.keys(), dtype=np.int64)
        counts = np.fromiter(output_counts.values(), dtype=np.float32)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis (one row [V] or rows [n, V])."""
    z = _exp_shifted(logits)
    z /= z.sum(-1, keepdims=True)
    return z


def _exp_shifted(logits: np.ndarray) -> np.ndarray:
    # exp(logits - max) in one new array: a fresh vocabulary-sized temporary per step costs
    # page faults here (a 49k-token softmax took 45 or 190 us depending on malloc's mood).
    z = logits - logits.max(-1, keepdims=True)
    return np.exp(z, out=z)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis; sampling, beam search and the scorers (runtime/evaluate.py) share it."""
    shifted = logits - logits.max(-1, keepdims=True)
    shifted -= np.log(np.exp(shifted).sum(-1, keepdims=True))  # in place: a [tokens, vocab] array is 50 MB a window
    return shifted


# Each filter as the ids it keeps (None: it is off, all kept), so ``sample`` can run the next
# one on the survivors only; ``warp`` (speculative decoding's full distributions) masks the
# vocabulary with the same functions, so both keep the same tokens.

def top_k_keep(logits: np.ndarray, k: int) -> np.ndarray | None:
    if k <= 0 or k >= logits.size:
        return None
    return np.flatnonzero(logits >= np.partition(logits, -k)[-k])


# Tokens at least this fraction of the top one's probability usually hold the whole nucleus:
# then only they are sorted (often a few dozen of 49k), else the whole vocabulary is.
_NUCLEUS_FLOOR = 1e-3


def top_p_keep(logits: np.ndarray, p: float) -> np.ndarray | None:
    """The smallest set of most likely tokens whose probability reaches ``p`` (of equal
    probabilities at the edge, the lowest ids).

    Probabilities are sorted as values (a SIMD sort: 90 us for 49k, where argsort takes 500 us),
    those above _NUCLEUS_FLOOR only when they hold ``p`` (with a margin for rounding), and summed
    only as far as the nucleus reaches (cumsum is sequential); the kept ids are found by value.
    """
    if p >= 1.0:
        return None
    weights = _exp_shifted(logits)  # the top token's weight is 1
    total = weights.sum()
    head = weights[weights >= _NUCLEUS_FLOOR]
    ranked = np.sort(head if head.sum() >= p * total * (1 + 1e-5) else weights)[::-1]
    k = min(64, ranked.size)
    while (cumulative := np.cumsum(ranked[:k] / total))[-1] < p and k < ranked.size:
        k = min(16 * k, ranked.size)
    n = min(int(np.searchsorted(cumulative, p)) + 1, k)
    edge = ranked[n - 1]
    kept = weights > edge
    kept[np.flatnonzero(weights == edge)[: n - np.count_nonzero(kept)]] = True
    return np.flatnonzero(kept)


def min_p_keep(logits: np.ndarray, min_p: float) -> np.ndarray | None:
    if min_p <= 0:
        return None
    weights = _exp_shifted(logits)  # the top token's weight is 1
    return np.flatnonzero(weights >= min_p)


def typical_keep(logits: np.ndarray, mass: float) -> np.ndarray | None:
    """Locally typical sampling (Meister et al. 2022), as transformers' TypicalLogitsWarper: keep
    the tokens whose surprisal is nearest the entropy until they hold ``mass`` (ties kept)."""
    if mass >= 1.0:
        return None
    logp = log_softmax(logits)
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):  # filtered tokens: 0 * -inf, skipped by nansum
        entropy = -np.nansum(p * logp)
    distance = np.abs(-logp - entropy)
    order = np.argsort(distance, kind="stable")
    cumulative = np.cumsum(p[order])
    last = min(int(np.searchsorted(cumulative, mass)), logits.size - 1)
    return np.flatnonzero(distance <= distance[order[last]])


def _masked(logits: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    if keep is None:
        return logits
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def _filters(params: SamplingParams) -> tuple:
    return ((top_k_keep, params.top_k), (top_p_keep, params.top_p), (min_p_keep, params.min_p),
            (typical_keep, params.typical_p))


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature and filters: the distribution a token is drawn from, as logits."""
    logits = logits / params.temperature
    for keep, value in _filters(params):
        logits = _masked(logits, keep(logits, value))
    return logits


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """A token from ``warp(logits, params)``'s distribution, drawn as ``draw`` draws.

    Each filter runs on the survivors of the one before (after top-k, a few dozen entries
    instead of the vocabulary); with 49k tokens a row took 0.2-1.5 ms, most of it in
    vocabulary-sized temporaries and a sequential cumsum.
    """
    if params.greedy:
        return int(np.argmax(logits))
    x, ids = logits / params.temperature, None
    if not x.size or not np.isfinite(x.max()):  # NaN from a broken model, or nothing allowed
        raise ValueError("cannot sample: the logits are NaN or every token is filtered out")
    for keep, value in _filters(params):
        kept = keep(x, value)
        if kept is not None:
            ids, x = (kept if ids is None else ids[kept]), x[kept]
    x -= x.max()
    index = draw(np.exp(x, out=x), rng)
    return index if ids is None else int(ids[index])


def sample_rows(logits: np.ndarray, temperatures: list[float], rngs: list[np.random.Generator]) -> list[int]:
    """``sample`` for rows [n, V] that only have a temperature (no filters), each from its own
    generator: the same tokens as row by row, the generators advanced alike.

    Each step is one numpy call for all rows instead of one per row, where per-call overhead
    dominates a small vocabulary: 8 rows of 4k tokens take 107 us here against 163 us one by
    one (49k tokens: 430 against 500 us).
    """
    x = logits / np.asarray(temperatures, dtype=logits.dtype)[:, None]  # as ``sample``: in the logits' dtype
    top = x.max(axis=1, keepdims=True)
    if not x.shape[1] or not np.isfinite(top).all():
        raise ValueError("cannot sample: the logits are NaN or every token is filtered out")
    x -= top
    return draw_rows(np.exp(x, out=x), rngs)


# A long row is drawn through the running sums of blocks of this many entries: numpy's cumsum
# is sequential (145 us for 49k float32), block sums are vectorized.
_DRAW_BLOCK = 256


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from unnormalized ``weights`` (>= 0, some > 0): the first index whose
    running sum passes one uniform times the total, in index order, so a seed fixes the draw.
    An index of weight 0 is never drawn."""
    u = rng.random()
    if weights.size <= 4 * _DRAW_BLOCK:
        running = np.cumsum(weights)
        return _first_past(weights, running, u * _checked(float(running[-1])))
    starts = np.arange(0, weights.size, _DRAW_BLOCK)
    sums = np.add.reduceat(weights, starts)
    totals = np.cumsum(sums)
    target = u * _checked(float(totals[-1]))
    j = int(np.searchsorted(totals, target, side="right"))  # u < 1: a block with weight
    block = weights[starts[j] : starts[j] + _DRAW_BLOCK]
    before = float(totals[j - 1]) if j else 0.0
    return int(starts[j]) + _first_past(block, before + np.cumsum(block), target)


def draw_rows(weights: np.ndarray, rngs: list[np.random.Generator]) -> list[int]:
    """``draw`` for each row of ``weights`` [n, V], one uniform from each row's generator, with
    no per-row numpy calls: the same running sums bit for bit (each row's segments are added in
    the same order) and the same comparisons (``searchsorted`` compares in float64)."""
    n, size = weights.shape
    u = np.fromiter((rng.random() for rng in rngs), dtype=np.float64, count=n)
    if size <= 4 * _DRAW_BLOCK:
        running = np.cumsum(weights, axis=1)
        return _first_past_rows(weights, running, u * _checked_rows(running[:, -1]), np.full(n, size))
    starts = np.arange(0, size, _DRAW_BLOCK)
    totals = np.cumsum(np.add.reduceat(weights, starts, axis=1), axis=1)
    target = u * _checked_rows(totals[:, -1])
    j = np.minimum(_at_most(totals, target), len(starts) - 1)
    columns = starts[j][:, None] + np.arange(_DRAW_BLOCK)
    # The last block may be short: its columns past the end repeat the last weight, and their
    # running sums, past the block's own, only ever count when the target is past its end.
    block = np.take_along_axis(weights, np.minimum(columns, size - 1), axis=1)
    before = np.where(j > 0, totals[np.arange(n), j - 1], 0).astype(weights.dtype)
    running = before[:, None] + np.cumsum(block, axis=1)
    picks = _first_past_rows(block, running, target, np.minimum(size - starts[j], _DRAW_BLOCK))
    return [int(start) + i for start, i in zip(starts[j], picks)]


def _at_most(running: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per row, how many running sums are <= its target: ``searchsorted(side="right")``, which
    compares in float64 (``running <= target`` would round the target to float32)."""
    return (running.astype(np.float64) <= targets[:, None]).sum(axis=1)


def _checked_rows(totals: np.ndarray) -> np.ndarray:
    for total in totals[~((totals > 0) & (totals < np.inf))]:
        _checked(float(total))
    return totals.astype(np.float64)


def _first_past_rows(weights: np.ndarray, running: np.ndarray, targets: np.ndarray, sizes: np.ndarray) -> list[int]:
    """``_first_past`` per row, whose first ``sizes[r]`` entries are its own."""
    found = _at_most(running, targets).tolist()
    return [i if i < m else int(np.flatnonzero(w[:m])[-1]) for i, m, w in zip(found, sizes.tolist(), weights)]


def _checked(total: float) -> float:
    if not 0 < total < np.inf:  # NaN logits (a broken model), or every token filtered
        raise ValueError(f"cannot sample: the token weights sum to {total}")
    return total


def _first_past(weights: np.ndarray, running: np.ndarray, target: float) -> int:
    i = int(np.searchsorted(running, target, side="right"))
    if i >= weights.size:  # rounding put the target at the very end: the last index with weight
        i = int(np.flatnonzero(weights)[-1])
    return i


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    ids = np.argpartition(logprobs, -k)[-k:]
    ids = ids[np.argsort(-logprobs[ids], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in ids]
