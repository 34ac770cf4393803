"""The KV cache: one preallocated buffer per layer for k and for v, shared by a batch of rows.

Buffers are [rows, kv_heads, capacity, head_dim]. A sequence owns one row; its token at
position p sits in slot p, and ``lengths[row]`` says how many slots are filled. Decode binds
the first ``n`` rows (a contiguous view, no copy) as both past and present, so the graph
writes new entries in place. Capacity starts at what the caller needs and grows by doubling.
"""

from __future__ import annotations

import itertools

import numpy as np

from llmx.errors import InputError

# Every cache gets its own number, so a backend can tell a new cache from the last one it bound
# without keeping the last one (and its buffers) alive after its batch has ended.
_SERIALS = itertools.count()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, rows: int, capacity: int, max_capacity: int, dtype=np.float32):
        if capacity > max_capacity:
            raise InputError(f"{capacity} tokens exceed the model's maximum sequence length {max_capacity}")
        self.shape_tail = (kv_heads, head_dim)
        self.max_capacity = max_capacity
        self.dtype = np.dtype(dtype)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.buffers = [np.zeros((rows, kv_heads, capacity, head_dim), self.dtype) for _ in range(2 * num_layers)]
        self.version = 0  # bumped whenever buffers are reallocated; backends cache views by it
        self.serial = next(_SERIALS)

    @property
    def rows(self) -> int:
        return self.buffers[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def ensure_capacity(self, needed: int) -> None:
        """Make room for ``needed`` slots per row (doubling, capped at the model's maximum)."""
        if needed <= self.capacity:
            return
        if needed > self.max_capacity:
            raise InputError(f"sequence of {needed} tokens exceeds the model's maximum length {self.max_capacity}")
        new_cap = min(max(needed, 2 * self.capacity), self.max_capacity)
        # Only filled slots are copied (attention reads no others): growing mid-request stalls
        # every stream, and copying the whole old buffer (all rows, all slots) into fresh pages
        # took 45-620 ms for 8 rows of a 135M model, most of it for rows nobody used.
        filled = [(int(row), int(n)) for row, n in enumerate(self.lengths) if n]
        grown = []
        for buf in self.buffers:
            bigger = np.zeros((buf.shape[0], buf.shape[1], new_cap, buf.shape[3]), self.dtype)
            for row, n in filled:
                bigger[row, :, :n] = buf[row, :, :n]
            grown.append(bigger)
        self.buffers = grown
        self.version += 1

    def write(self, row: int, layer_entries: list[np.ndarray], start: int = 0) -> None:
        """Copy one sequence's entries ([kv_heads, n, head_dim] per buffer) into slots start..start+n."""
        n = layer_entries[0].shape[1]
        self.ensure_capacity(start + n)
        for buf, entries in zip(self.buffers, layer_entries):
            buf[row, :, start : start + n] = entries
        self.lengths[row] = start + n

    def read(self, row: int, start: int = 0, end: int | None = None) -> list[np.ndarray]:
        end = self.lengths[row] if end is None else end
        return [buf[row, :, start:end].copy() for buf in self.buffers]

    def move_row(self, src: int, dst: int) -> None:
        """Move a sequence to another row (compacting a batch after one finishes)."""
        if src == dst:
            return
        n = int(self.lengths[src])
        for buf in self.buffers:
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    def copy_span(self, src: int, dst: int, start: int, end: int) -> None:
        """Slots start..end of row ``src`` into row ``dst``, whose length becomes ``end``.

        Beam search forks a beam this way: slots before ``start`` already hold the same
        tokens' keys/values in ``dst``, so only the part where the two beams differ moves."""
        for buf in self.buffers:
            buf[dst, :, start:end] = buf[src, :, start:end]
        self.lengths[dst] = end

    def reorder(self, order: np.ndarray) -> None:
        """rows[i] <- rows[order[i]] for the first len(order) rows (beam search)."""
        n = len(order)
        for buf in self.buffers:
            buf[:n] = buf[order]
        self.lengths[:n] = self.lengths[order]
