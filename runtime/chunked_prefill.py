"""Chunked prefill: run a long prompt a chunk at a time, so decode steps can run in between.

A server that prefills a 2,000-token prompt in one call stalls every running stream for that
long. Instead the prompt goes through its own one-row KV cache: the first chunk runs the
prefill graph, later chunks run the decode graph with T = chunk tokens (the decode graph is
causal within its T new tokens, so this is the same computation as one long prefill). When the
prompt is done, ``Batch.join`` copies the row into the shared cache, as ``admit`` copies a
prefill's output. The batch's other rows are never touched, so no backend change is needed.

With a ``prefix`` (cached tokens and their KV, from the server's prefix cache) the row starts
with those slots filled and only the rest of the prompt is computed, on the decode graph.
"""

from __future__ import annotations

import numpy as np

from llmx.runtime.sequence import Sequence


class ChunkedPrefill:
    def __init__(self, backend, seq: Sequence, chunk: int, prefix: tuple[int, list[np.ndarray]] | None = None):
        if chunk < 1:
            raise ValueError("chunk must be >= 1")
        self.backend, self.seq, self.chunk = backend, seq, chunk
        self.cache = backend.new_cache(1, len(seq.prompt_ids))
        self.done = 0  # prompt tokens already in the cache
        if prefix is not None:
            self.done, entries = prefix
            self.cache.write(0, entries)
        self.logits: np.ndarray | None = None  # last position's logits [V], once finished

    @property
    def finished(self) -> bool:
        return self.done == len(self.seq.prompt_ids)

    @property
    def remaining(self) -> int:
        return len(self.seq.prompt_ids) - self.done

    def step(self) -> int:
        """Prefill the next chunk; returns how many prompt tokens it covered."""
        ids = self.seq.prompt_ids[self.done : self.done + self.chunk]
        if not ids:
            return 0
        if self.done == 0:
            logits = self.backend.prefill(self.cache, [0], [ids])[0]
        else:
            logits = self.backend.decode(self.cache, np.asarray([ids], dtype=np.int64), last_only=True)[0, -1]
        self.done += len(ids)
        if self.finished:
            self.logits = logits.copy()  # the backend reuses its logits buffer
        return len(ids)

    def entries(self) -> list[np.ndarray]:
        """The prompt's KV, one [kv_heads, prompt_len, head_dim] array per cache buffer, on the
        host: read through the cache (a device cache's buffers are addresses)."""
        return self.cache.read(0, 0, self.done)
