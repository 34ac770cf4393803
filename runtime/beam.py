"""Beam search on the prefill/decode graphs, step for step as transformers' ``generate(num_beams=B)``.

    prefill(prompt) into row 0, then each step:
      scores = beam's sum of logprobs + log_softmax(logits)      over B beams x V tokens
      the best K = 2B candidates (more with several end tokens), best first
      -> those among the first B that end (end token, or the length limit) join the finished
         pool, scored sum(logprob) / generated_length ** length_penalty; the pool keeps the best B
      -> the best B that do not end continue: fork their KV rows, decode B rows one token each

The B running beams live in rows 0..B-1 of one KV cache. After a selection, a beam continuing
its parent stays in the parent's row (nothing moves); a parent's second, third... child takes
the row of a beam that left no child, and only the slots where the two beams' tokens differ
are copied (from their longest common prefix on; the prompt never moves after the first step).
So a step is one decode call plus copies proportional to how recently beams diverged, not a
gather of B whole rows by beam index (``KVCache.reorder``). ``copied_slots`` counts them.

Stopping follows transformers' ``early_stopping``: True stops once B hypotheses are finished;
False once the best running beam, scored at its current length, cannot beat the worst finished
one; "never" scores it at the longest possible length when length_penalty > 0. Beam search is
deterministic and scores with the model's own log-probabilities: no sampling filters or penalties.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from llmx.errors import InputError
from llmx.runtime.batch import refuse_long_rope_crossing
from llmx.runtime.sampling import log_softmax

MAX_BEAMS = 64


@dataclass
class BeamParams:
    num_beams: int = 4
    max_new_tokens: int = 64
    length_penalty: float = 1.0  # > 0 favours longer hypotheses, < 0 shorter
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    num_return_sequences: int | None = None  # None: all num_beams hypotheses
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "BeamParams":
        if not isinstance(self.num_beams, int) or not 1 <= self.num_beams <= MAX_BEAMS:
            raise InputError(f"num_beams must be an integer in [1, {MAX_BEAMS}], got {self.num_beams!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise InputError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise InputError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        returned = self.num_return_sequences
        if returned is not None and (not isinstance(returned, int) or not 1 <= returned <= self.num_beams):
            raise InputError(f"num_return_sequences must be an integer in [1, num_beams={self.num_beams}], got {returned!r}")
        return self


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens (the end token included when it ended one)
    score: float  # logprob / len(token_ids) ** length_penalty: transformers' sequences_scores
    logprob: float  # sum of the tokens' log-probabilities
    finish_reason: str  # "stop": an end token; "length": max_new_tokens or the context


@dataclass
class _Beam:
    row: int
    tokens: list[int]  # generated so far; the last one is not in the cache yet
    logprob: float


class BeamSearch:
    """One prompt's beam search; ``step()`` until ``done``, then ``results()``."""

    def __init__(self, backend, prompt_ids: list[int], params: BeamParams, end_ids: list[int]):
        self.params = params.validate()
        if not prompt_ids:
            raise InputError("prompt is empty")
        if len(prompt_ids) >= backend.max_seq_len:
            raise InputError(f"prompt has {len(prompt_ids)} tokens; the model's maximum sequence length is {backend.max_seq_len}")
        self.backend, self.prompt = backend, list(prompt_ids)
        self.max_new = min(params.max_new_tokens, backend.max_seq_len - len(self.prompt))
        refuse_long_rope_crossing(backend, len(self.prompt), self.max_new, "beam search")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(end_ids))
        self.stop_ids = np.array(sorted(stops), dtype=np.int64)
        self.candidates = max(2, 1 + len(stops)) * params.num_beams  # always >= B that do not end
        self.cache = backend.new_cache(params.num_beams, len(self.prompt) + self.max_new)
        self.beams: list[_Beam] = []
        self.pool: list[Hypothesis] = []  # finished, best first, at most num_beams
        self.generated = 0  # tokens each running beam has generated
        self.done = False
        self.copied_slots = 0  # KV slots (per buffer) copied by forks
        self.gather_slots = 0  # what gathering every row by beam index would have copied

    def step(self) -> None:
        """One token for every beam: the prompt's prefill on the first call, then a decode call."""
        if self.done:
            return
        if not self.beams:
            logits = self.backend.prefill(self.cache, [0], [self.prompt])
            self._select(logits, [_Beam(0, [], 0.0)])
            return
        ids = np.zeros((len(self.beams), 1), dtype=np.int64)
        for b in self.beams:
            ids[b.row, 0] = b.tokens[-1]
        logits = self.backend.decode(self.cache, ids)[:, 0]
        self._select(logits[[b.row for b in self.beams]], self.beams)

    def run(self) -> list[Hypothesis]:
        while not self.done:
            self.step()
        return self.results()

    def results(self) -> list[Hypothesis]:
        return self.pool[: self.params.num_return_sequences or self.params.num_beams]

    # -- one selection ---------------------------------------------------------------------

    def _select(self, logits: np.ndarray, beams: list[_Beam]) -> None:
        """Pick the next beams from ``logits`` [len(beams), V] (row i continues beams[i])."""
        p, vocab = self.params, logits.shape[-1]
        scores = log_softmax(logits.astype(np.float32)) + np.array([b.logprob for b in beams], np.float32)[:, None]
        flat = scores.ravel()
        k = min(self.candidates, flat.size)
        top = np.sort(np.argpartition(-flat, k - 1)[:k])
        top = top[np.argsort(-flat[top], kind="stable")]  # best first; ties by beam, then token id
        length = self.generated + 1
        ends = np.isin(top % vocab, self.stop_ids) | (length >= self.max_new)
        for i in np.flatnonzero(ends[: p.num_beams]):
            parent, token = beams[top[i] // vocab], int(top[i] % vocab)
            reason = "stop" if token in self.stop_ids else "length"
            self.pool.append(Hypothesis(parent.tokens + [token], float(flat[top[i]]) / length**p.length_penalty,
                                        float(flat[top[i]]), reason))
        self.pool = sorted(self.pool, key=lambda h: -h.score)[: p.num_beams]
        self.generated = length
        survivors = top[~ends][: p.num_beams]
        if len(survivors) < p.num_beams or self._can_stop(flat[survivors[0]] if len(survivors) else -np.inf):
            self.done = True
            return
        children = [(beams[i // vocab], int(i % vocab), float(flat[i])) for i in survivors]
        self.beams = self._fork(children, beams)

    def _can_stop(self, best_running: float) -> bool:
        p = self.params
        if len(self.pool) < p.num_beams:
            return False
        if p.early_stopping is True:
            return True
        best_length = self.max_new if p.early_stopping == "never" and p.length_penalty > 0 else self.generated
        return best_running / best_length**p.length_penalty <= self.pool[-1].score

    def _fork(self, children: list[tuple[_Beam, int, float]], parents: list[_Beam]) -> list[_Beam]:
        """Rows for the new beams: a parent's first child keeps its row, the others take rows of
        beams that left no child and copy only the slots past the common prefix."""
        held = {b.row: b.tokens for b in parents}  # every parent's tokens are all in its row now
        kept = {parent.row for parent, _, _ in children}
        free = [r for r in range(self.params.num_beams) if r not in kept]
        claimed, beams = set(), []
        length = len(self.prompt) + self.generated - 1  # slots each parent row holds
        for parent, token, logprob in children:
            row = parent.row
            if row in claimed:
                row = free.pop()
                start = self._shared_prefix(held.get(row), parent.tokens)
                self.cache.copy_span(parent.row, row, start, length)
                self.copied_slots += length - start
            claimed.add(row)
            beams.append(_Beam(row, parent.tokens + [token], logprob))
        self.gather_slots += self.params.num_beams * length
        return beams

    def _shared_prefix(self, held: list[int] | None, tokens: list[int]) -> int:
        """Leading slots of a row holding prompt + ``held`` that equal those of prompt + ``tokens``
        (the KV of a slot depends only on the tokens up to it). None: the row was never filled."""
        if held is None:
            return 0
        same = 0
        for a, b in zip(held, tokens):
            if a != b:
                break
            same += 1
        return len(self.prompt) + same


def beam_search(backend, tokenizer, prompt_ids: list[int], params: BeamParams) -> list[Hypothesis]:
    """The best hypotheses for one prompt, best first (``num_return_sequences`` of them)."""
    return BeamSearch(backend, prompt_ids, params, tokenizer.eos_token_ids).run()
