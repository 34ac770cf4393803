"""Speculative decoding: draft k tokens cheaply, verify them in one decode call of the target.

    a row holds L cached tokens; x0 was sampled last step and is not cached yet
    decode([x0, d1..dk]) -> logits 0..k            (logits i predicts what follows d_i; d_0 = x0)
    certain drafts (prompt lookup, a greedy draft model): at each position the target chooses
              its own token from logits i exactly as plain decoding would (the same penalties,
              bias, grammar mask and, when sampling, the same single uniform draw); the draft
              token is accepted while it equals that choice, and the first mismatch is replaced
              by it; if all k pass, logits k gives one more. Output is token-identical to plain
              decoding, sampled rows included (same seed, same tokens), and a sampled row accepts
              a draft with probability p(d), as the rejection rule would with q = 1 at d.
    sampled drafts (a draft model sampling with distribution q): d is accepted with probability
              min(1, p(d) / q(d)), else the token is drawn from max(0, p - q), renormalized
              (Leviathan et al. 2023, Chen et al. 2023), so every emitted token is distributed
              exactly as p; a seed draws differently than without speculation.
    rollback: the row's length becomes L + 1 + accepted; the rejected drafts' slots are simply
              overwritten later (attention reads only the first ``length`` slots).

So one target call emits 1..k+1 tokens. Constraints and logit_bias combine: p is the row's own
masked, biased distribution, and the grammar advances one accepted token at a time.

``SpeculativeBatch`` is a ``Batch`` whose step does this for all rows in one call: drafts of
different lengths are padded to the longest (the padding's slots are rolled back too). A step
where no row has a draft is a plain ``Batch`` step. An optional drafter (``auto``) drafts only
where it pays and never refuses a request (runtime/drafters.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from llmx.errors import InputError
from llmx.runtime.batch import Batch, Event, refuse_long_rope_crossing
from llmx.runtime.sampling import draw
from llmx.runtime.sequence import Sequence

MAX_DRAFT_TOKENS = 32


@dataclass
class Draft:
    tokens: list[int]
    # q for each token (a draft model sampling); None: proposed with certainty (lookup, greedy)
    probs: list[np.ndarray] | None = None


@dataclass
class SpecStats:
    steps: int = 0  # target decode calls
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target kept
    emitted: int = 0  # tokens those calls produced (accepted + one correction or bonus each)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> dict:
        return {**asdict(self), "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_step": round(self.emitted / self.steps, 4) if self.steps else 0.0}


def check_num_draft_tokens(k: int) -> int:
    if not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise InputError(f"the number of draft tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
    return k


def ragged_decode(backend, cache, tokens: list[list[int]]) -> list[np.ndarray]:
    """Feed row i of rows 0..n-1 its own ``tokens[i]`` in one decode call (padded to the
    longest); returns each row's logits [len(tokens[i]), V] and grows each row by its own count."""
    n, width = len(tokens), max(len(t) for t in tokens)
    start = cache.lengths[:n].copy()
    ids = np.zeros((n, width), dtype=np.int64)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = t
    logits = backend.decode(cache, ids)
    cache.lengths[:n] = start + np.array([len(t) for t in tokens])
    return [logits[i, : len(t)].copy() for i, t in enumerate(tokens)]  # the backend reuses its buffer


def judge(seq: Sequence, logits: np.ndarray, drafted: int, q: np.ndarray | None) -> tuple[int, bool]:
    """The token the target emits at this position, and whether it is the drafted one."""
    if q is None or seq.params.greedy:
        token = seq.choose(logits)  # plain decoding's own choice: identical output
        return token, token == drafted
    p = seq.probs(logits)
    if seq.rng.random() * float(q[drafted]) < p[drafted]:  # probability min(1, p(d) / q(d))
        seq.record_logprob(logits, drafted)
        return drafted, True
    residual = np.maximum(p - q, 0.0)
    token = draw(residual if residual.sum() > 0 else p, seq.rng)
    seq.record_logprob(logits, token)
    return token, False


def verify(seq: Sequence, logits: np.ndarray, draft: Draft) -> tuple[int, int, str]:
    """Accept a prefix of ``draft`` given the target's ``logits`` [1 + len(draft), V]; returns
    (draft tokens kept in the cache, the last emitted token (not cached yet), the new text)."""
    text, kept, token = "", 0, -1
    seq.drafted += len(draft.tokens)
    for i, drafted in enumerate(draft.tokens):
        token, ok = judge(seq, logits[i], drafted, None if draft.probs is None else draft.probs[i])
        text += seq.accept(token)
        if not ok:
            break
        kept += 1
        if seq.finished:
            break
    else:
        token = seq.choose(logits[len(draft.tokens)])
        text += seq.accept(token)
    seq.accepted += kept
    return kept, token, text


class SpeculativeBatch(Batch):
    """A Batch whose step drafts with ``drafter`` and verifies every row's draft in one call."""

    def __init__(self, backend, rows: int, capacity: int, drafter):
        super().__init__(backend, rows, capacity)
        self.drafter = drafter
        drafter.reset(rows)
        self.stats: SpecStats = drafter.stats  # the drafter's owner reads them after generation

    def admit(self, seqs: list[Sequence], padding: str = "right") -> list[Event]:
        if not self.drafter.optional:
            for seq in seqs:
                refuse_long_rope_crossing(self.backend, len(seq.prompt_ids), seq.params.max_new_tokens, "speculative decoding")
        events = super().admit(seqs, padding)
        self._start(seqs)
        return events

    def join(self, seq: Sequence, entries: list[np.ndarray], logits: np.ndarray) -> list[Event]:
        events = super().join(seq, entries, logits)
        self._start([seq])
        return events

    def _start(self, seqs: list[Sequence]) -> None:
        live = [s for s in seqs if not s.finished]  # rows are known once admission compacted
        self.drafter.start([self.active.index(s) for s in live], live)

    def _move_row(self, src: int, dst: int) -> None:
        super()._move_row(src, dst)
        self.drafter.move(src, dst)

    def step(self) -> list[Event]:
        self.compact()
        if not self.active:
            return []
        n = len(self.active)
        lengths = self.cache.lengths[:n].copy()
        room = self.cache.max_capacity - int(lengths.max()) - 1  # the padded call must fit every row
        limits = [max(0, min(self.drafter.num_tokens, s.params.max_new_tokens - len(s.output_ids) - 1, room))
                  for s in self.active]
        if self.drafter.optional and self.long_rope_at is not None:
            limits = [0] * n  # LongRoPE's switch recomputes the batch: left to the plain step
        drafts = self.drafter.propose(self.active, limits) if any(limits) else [Draft([]) for _ in self.active]
        started = time.perf_counter()
        if not any(d.tokens for d in drafts):
            events = super().step()
            self.drafter.observe(n, 1, time.perf_counter() - started)
            self.stats.steps += 1
            self.stats.emitted += n
            return events
        logits = ragged_decode(self.backend, self.cache, [[x] + d.tokens for x, d in zip(self.next_ids, drafts)])
        events = []
        for i, (seq, draft, rows) in enumerate(zip(self.active, drafts, logits)):
            before = len(seq.output_ids)
            kept, self.next_ids[i], text = verify(seq, rows, draft)
            self.cache.lengths[i] = lengths[i] + 1 + kept  # x0 and the accepted drafts stay
            self.drafter.sync(i, int(self.cache.lengths[i]))
            self.stats.drafted += len(draft.tokens)
            self.stats.accepted += kept
            self.stats.emitted += len(seq.output_ids) - before
            events.append((seq, text))
            self.drafter.verified(seq, len(draft.tokens), kept)
        self.stats.steps += 1
        self.drafter.observe(n, 1 + max(len(d.tokens) for d in drafts), time.perf_counter() - started)
        self.compact()
        return events
