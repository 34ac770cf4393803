"""A batch of sequences decoding together: sequence i owns row i of one KV cache.

New sequences are prefilled into the next free rows (``admit``), or arrive with a prompt
prefilled elsewhere in chunks (``join``, see ``chunked_prefill``); every ``step`` decodes one
token for all of them; finished or cancelled sequences leave and the last row moves into the
hole, so the active rows are always 0..n-1 (a contiguous view the decode graph binds).
Both ``generate`` and the server's continuous-batching scheduler drive this one class.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from llmx.errors import InputError
from llmx.runtime.constraints import prefetch_masks
from llmx.rope import long_context_threshold
from llmx.runtime.sampling import sample_rows
from llmx.runtime.sequence import Sequence

Event = tuple[Sequence, str]  # a sequence and the text it made visible this step
# Grammar masks are computed beside the model step only when a step takes at least this long:
# on the 4.9M demo model (2-5 ms steps) the thread hand-off cost more than the masks it hid
# (benchmarks/constraint_cost.py), while a 135M model's 10-30 ms steps hide them whole.
OVERLAP_MIN_STEP_S = 0.008


def long_rope_threshold(backend) -> int | None:
    """Where LongRoPE switches to its long factors for this backend's model (None: no switch)."""
    manifest = getattr(backend, "manifest", None)
    return long_context_threshold(manifest.model.rope or {}) if manifest else None


def refuse_long_rope_crossing(backend, prompt_len: int, max_new_tokens: int, what: str) -> None:
    """For loops that cannot recompute a sequence at LongRoPE's switch (see ``Batch._recompute``):
    refuse one that would cross it rather than answer differently from transformers."""
    threshold = long_rope_threshold(backend)
    if threshold is not None and prompt_len <= threshold < prompt_len + max_new_tokens:
        raise InputError(f"{what} cannot cross LongRoPE's original_max_position_embeddings ({threshold} tokens) yet; "
                         f"use plain decoding, or keep prompt + new tokens within {threshold}")


class Batch:
    def __init__(self, backend, rows: int, capacity: int):
        self.backend = backend
        self.cache = backend.new_cache(rows, capacity)
        self.active: list[Sequence] = []
        self.next_ids: list[int] = []  # sampled, not yet in the cache
        # Called with (sequence, cache, row) as a finished sequence leaves, before its row is
        # reused: the server's prefix cache keeps the KV of what it generated.
        self.on_leave: Callable[[Sequence, object, int], None] | None = None
        self.long_rope_at = long_rope_threshold(backend)
        self.constrained = 0  # active sequences with a grammar: the only ones that pay for masks
        self.step_s = 0.0  # the last decode step's time, measured only while a row is constrained

    @property
    def free_rows(self) -> int:
        return self.cache.rows - len(self.active)

    def admit(self, seqs: list[Sequence], padding: str = "right") -> list[Event]:
        """Prefill ``seqs`` into free rows and sample each one's first token."""
        if not seqs:
            return []
        if len(seqs) > self.free_rows:
            raise InputError(f"batch has {self.free_rows} free rows, {len(seqs)} sequences asked to join")
        start = len(self.active)
        rows = list(range(start, start + len(seqs)))
        logits = self.backend.prefill(self.cache, rows, [s.prompt_ids for s in seqs], padding)
        self.active.extend(seqs)
        self.next_ids.extend(0 for _ in seqs)
        self.constrained += sum(s.constraint is not None for s in seqs)
        return self._sample(logits, start)

    def join(self, seq: Sequence, entries: list[np.ndarray], logits: np.ndarray) -> list[Event]:
        """Add a sequence whose prompt was prefilled elsewhere: copy its KV ``entries`` (one
        [kv_heads, prompt_len, head_dim] array per cache buffer) into the next free row and
        sample its first token from ``logits`` [V]."""
        if not self.free_rows:
            raise InputError("batch has no free row for a prefilled sequence")
        row = len(self.active)
        self.cache.write(row, entries)
        self.active.append(seq)
        self.next_ids.append(0)
        self.constrained += seq.constraint is not None
        return self._sample(logits[None], row)

    def step(self) -> list[Event]:
        """Decode one token for every active sequence."""
        self.compact()
        if not self.active:
            return []
        if self._long_rope_starts():
            return self._recompute()
        ids = np.asarray(self.next_ids, dtype=np.int64)[:, None]
        if not self.constrained:
            return self._sample(self.backend.decode(self.cache, ids)[:, 0], 0)
        # Grammar masks for this step's tokens are computed in llguidance's threads meanwhile
        # (or, for fast steps, on demand as each row samples).
        start = time.perf_counter()
        masks = (prefetch_masks(s.constraint for s in self.active if s.constraint is not None)
                 if self.step_s >= OVERLAP_MIN_STEP_S else None)
        logits = self.backend.decode(self.cache, ids)[:, 0]
        self.step_s = time.perf_counter() - start
        if masks is not None:
            masks.result()
        return self._sample(logits, 0)

    def _long_rope_starts(self) -> bool:
        """LongRoPE: this step takes the batch past original_max_position_embeddings, so the graphs
        switch to the long factors, and every cached key was rotated with the short ones."""
        if self.long_rope_at is None:
            return False
        return int(self.cache.lengths[: len(self.active)].max()) == self.long_rope_at

    def _recompute(self) -> list[Event]:
        """Run every sequence again from its first token with the long factors, as transformers'
        Phi-3 drops its cache at this step; the logits are those of the step's new tokens."""
        tokens = [s.prompt_ids + s.output_ids for s in self.active]  # the last output is the step's new token
        logits = self.backend.prefill(self.cache, list(range(len(self.active))), tokens)
        return self._sample(logits, 0)

    def _sample(self, logits: np.ndarray, start: int) -> list[Event]:
        events = []
        rows = self.active[start : start + len(logits)]
        # Plain greedy rows (the common server case) take one argmax over the whole batch, and rows
        # sampled with a temperature alone one vectorized draw, instead of a copy and several numpy
        # calls per row; rows with per-row work (filters, penalties, logprobs, constraints) still go
        # through their own ``choose``.
        argmax = logits.argmax(axis=-1).tolist() if any(s.plain_greedy for s in rows) else None
        drawn = self._draw_plain(logits, rows)
        for i, row_logits in enumerate(logits):
            seq = rows[i]
            if i in drawn:
                token = drawn[i]
            elif argmax is not None and seq.plain_greedy:
                token = argmax[i]
            else:
                token = seq.choose(row_logits)
            events.append((seq, seq.accept(token)))
            self.next_ids[start + i] = token
        self.compact()
        return events

    @staticmethod
    def _draw_plain(logits: np.ndarray, rows: list[Sequence]) -> dict[int, int]:
        """Tokens of the ``plain_sampled`` rows, by row index (what their ``choose`` would give)."""
        picked = [i for i, s in enumerate(rows) if s.plain_sampled]
        if not picked:
            return {}
        block = logits if len(picked) == len(rows) else logits[picked]
        tokens = sample_rows(block.astype(np.float32, copy=False), [rows[i].params.temperature for i in picked],
                             [rows[i].rng for i in picked])
        return dict(zip(picked, tokens))

    def compact(self) -> None:
        """Drop finished or cancelled sequences, moving the last row into each hole."""
        i = 0
        while i < len(self.active):
            if not self.active[i].finished:
                i += 1
                continue
            if self.on_leave is not None:
                self.on_leave(self.active[i], self.cache, i)
            self.constrained -= self.active[i].constraint is not None
            last = len(self.active) - 1
            self._move_row(last, i)
            self.active[i], self.next_ids[i] = self.active[last], self.next_ids[last]
            self.active.pop()
            self.next_ids.pop()

    def _move_row(self, src: int, dst: int) -> None:
        """Move row ``src`` into the hole at ``dst`` (subclasses move their own per-row state too)."""
        self.cache.move_row(src, dst)
        self.cache.lengths[src] = 0
