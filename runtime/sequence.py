"""One sequence being generated: its tokens, sampler state, streamed text and finish reason.

The generation loop and the server's scheduler both hold Sequences; a Sequence never touches
the backend. ``choose`` turns a logits row into the next token; ``accept`` appends it and
returns the text that may be shown now (held back while it could still begin a stop string).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np

from llmx.runtime.sampling import SamplingParams, apply_penalties, log_softmax, sample, softmax, top_logprobs, warp
from llmx.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

_ids = itertools.count()


@dataclass
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


class StopStrings:
    """Finds stop strings in streamed text and holds back any tail that could start one.

    Each stop string runs a Knuth-Morris-Pratt matcher over the text as it arrives, so a token
    costs time linear in its own text whatever the stop strings' length (a rescan of every
    prefix was quadratic: two 240 kB stop strings stalled the server's one scheduler thread).
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._tables = [_failure(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # longest prefix of each stop ending the text so far
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += delta
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        start = len(self.pending) - len(delta)
        hit = None  # earliest start of a stop string completed inside this delta
        for j, (stop, table) in enumerate(zip(self.stops, self._tables)):
            k = self._matched[j]
            for i, ch in enumerate(delta, start):
                while k and stop[k] != ch:
                    k = table[k - 1]
                k += stop[k] == ch
                if k == len(stop):
                    hit = i + 1 - k if hit is None else min(hit, i + 1 - k)
                    break
            self._matched[j] = k
        if hit is not None:
            out, self.pending = self.pending[:hit], ""
            return out, True
        cut = len(self.pending) - max(self._matched)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _bias_arrays(bias: dict) -> tuple[np.ndarray, np.ndarray]:
    """logit_bias as (ids, biases) arrays; -100 bans a token outright, as OpenAI's does."""
    ids = np.fromiter((int(k) for k in bias), dtype=np.int64, count=len(bias))
    values = np.fromiter((-np.inf if v <= -100 else v for v in bias.values()), dtype=np.float32, count=len(bias))
    return ids, values


@functools.lru_cache(maxsize=256)
def _failure(pattern: str) -> tuple[int, ...]:
    """KMP failure table: for each prefix, the length of its longest proper border."""
    table, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        k += pattern[i] == pattern[k]
        table[i] = k
    return tuple(table)


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer, max_len: int):
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.tokenizer = tokenizer
        self.max_len = max_len  # prompt + output may not exceed it (the KV capacity)
        self.output_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict[int, int] = {}
        self._context = np.array(self.prompt_ids, dtype=np.int64)
        self._detok = IncrementalDetokenizer(tokenizer, self.prompt_ids, skip_special_tokens=params.skip_special_tokens)
        self._stops = StopStrings(params.stop)
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_token_ids))
        self.drafted = self.accepted = 0  # speculative decoding: tokens proposed / accepted
        self.cached_tokens = 0  # prompt tokens whose KV came from a prefix cache (server)
        # Constrained decoding and logit_bias: None unless asked for, so other rows skip them.
        self.constraint = params.constraint.matcher() if params.constraint is not None else None
        self._bias = _bias_arrays(params.logit_bias) if params.logit_bias else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def plain_greedy(self) -> bool:
        """``choose`` is the argmax of the raw logits: greedy, no penalties, no logprobs. A batch
        takes every such row's argmax in one call; any per-row hook added to ``choose`` (a
        constraint's mask, a logit bias) must make this and ``plain_sampled`` False, or the
        batch would skip it."""
        return self.params.greedy and self._unhooked

    @property
    def plain_sampled(self) -> bool:
        """``choose`` is ``sample`` with a temperature alone (no filters, penalties or logprobs):
        a batch draws every such row in one ``sample_rows`` call, each from its own generator."""
        p = self.params
        return (not p.greedy and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0 and p.typical_p >= 1.0
                and self._unhooked)

    @property
    def _unhooked(self) -> bool:
        p = self.params
        return (p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty and not p.logit_bias and self.constraint is None)

    def choose(self, logits: np.ndarray) -> int:
        """Sample the next token from a logits row [V] (left untouched)."""
        token = sample(self._penalized(logits), self.params, self.rng)
        self.record_logprob(logits, token)
        return token

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution ``choose`` draws from (penalties, temperature, filters) [V], for
        speculative sampling, which must accept or correct drafts against exactly it."""
        return softmax(warp(self._penalized(logits), self.params))

    def _penalized(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        penalties = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        if not penalties and self._bias is None and self.constraint is None and logits.dtype == np.float32:
            return logits  # nothing to change: sample and warp only read it (a copy per row per step is not free)
        work = logits.astype(np.float32, copy=True)
        if penalties:
            work = apply_penalties(work, p, self._context, self.counts)
        if self._bias is not None:
            ids, bias = self._bias
            work[ids] += bias
        if self.constraint is not None:
            self.constraint.mask_logits(work)
            if self._bias is not None and not np.isfinite(work.max()):  # logit_bias banned all the grammar allows
                work = self.constraint.mask_logits(logits.astype(np.float32, copy=True))
        return work

    def record_logprob(self, logits: np.ndarray, token: int) -> None:
        """Logprobs of the model's own distribution (before penalties and temperature), if asked for."""
        if self.params.logprobs is None:
            return
        lp = log_softmax(np.asarray(logits, dtype=np.float32))  # no copy: log_softmax writes its own array
        top = [(i, self.tokenizer.token_text(i), v) for i, v in top_logprobs(lp, self.params.logprobs)]
        self.logprobs.append(TokenLogprob(token, self.tokenizer.token_text(token), float(lp[token]), top))

    def accept(self, token: int) -> str:
        """Append a chosen token; return newly visible text. Sets finish_reason when done."""
        self.output_ids.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.params.repetition_penalty != 1.0:
            self._context = np.append(self._context, token)
        if token in self._stop_ids:
            self.finish_reason = "stop"
            return self._finish_text()
        emitted, hit = self._stops.feed(self._detok.push(token))
        self.text += emitted
        if hit:
            self.finish_reason = "stop"
            return emitted
        if self.constraint is not None and (not self.constraint.advance(token) or self.constraint.finished):
            self.finish_reason = "stop"  # the grammar is complete: nothing else may follow
            return emitted + self._finish_text()
        if len(self.output_ids) >= self.params.max_new_tokens or self.length >= self.max_len:
            self.finish_reason = "length"
            return emitted + self._finish_text()
        return emitted

    def _finish_text(self) -> str:
        emitted, hit = self._stops.feed(self._detok.flush())
        rest = "" if hit else self._stops.flush()
        self.text += emitted + rest
        return emitted + rest

    def cancel(self, reason: str = "cancelled") -> None:
        self.finish_reason = reason
