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
        ids = np.unique(context_ids)
        picked = logits[ids]
        logits[ids] = np.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_counts:
        ids = np.fromiter(output_counts.keys(), dtype=np.int64)
        counts = np.fromiter(output_counts.values(), dtype=np.float32)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis (one row [V] or rows [n, V])."""
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis; sampling, beam search and the scorers (runtime/evaluate.py) share it."""
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.size:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, -np.inf, logits)


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``.

    Sorting the whole vocabulary each step is slow (50k entries), so candidates come from
    argpartition, doubling until they hold enough mass; the kept set is exact.
    """
    if p >= 1.0:
        return logits
    probs = softmax(logits)
    k = min(64, probs.size)
    while True:
        candidates = np.argpartition(probs, -k)[-k:] if k < probs.size else np.arange(probs.size)
        order = candidates[np.argsort(-probs[candidates], kind="stable")]
        cumulative = np.cumsum(probs[order])
        if cumulative[-1] >= p or k == probs.size:
            keep = order[: int(np.searchsorted(cumulative, p)) + 1]
            break
        k = min(2 * k, probs.size)
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def min_p_mask(logits: np.ndarray, min_p: float) -> np.ndarray:
    if min_p <= 0:
        return logits
    probs = softmax(logits)
    return np.where(probs < min_p * probs.max(), -np.inf, logits)


def typical_mask(logits: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling (Meister et al. 2022), as transformers' TypicalLogitsWarper: keep
    the tokens whose surprisal is nearest the entropy until they hold ``mass`` (ties kept)."""
    if mass >= 1.0:
        return logits
    logp = log_softmax(logits)
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):  # filtered tokens: 0 * -inf, skipped by nansum
        entropy = -np.nansum(p * logp)
    distance = np.abs(-logp - entropy)
    order = np.argsort(distance, kind="stable")
    cumulative = np.cumsum(p[order])
    last = min(int(np.searchsorted(cumulative, mass)), logits.size - 1)
    return np.where(distance <= distance[order[last]], logits, -np.inf)


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature and filters: the distribution a token is drawn from, as logits."""
    logits = logits / params.temperature
    logits = top_k_mask(logits, params.top_k)
    logits = top_p_mask(logits, params.top_p)
    logits = min_p_mask(logits, params.min_p)
    return typical_mask(logits, params.typical_p)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    probs = softmax(warp(logits, params))
    # Inverse-CDF draw: one uniform per token, so a seed fixes the whole sequence.
    index = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return min(index, probs.size - 1)


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    ids = np.argpartition(logprobs, -k)[-k:]
    ids = ids[np.argsort(-logprobs[ids], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in ids]
