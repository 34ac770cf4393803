"""The KV cache in device memory, for the GPU backends: KVCache's contract, no host round trips.

One allocation per layer for k and for v, [rows, kv_heads, capacity, head_dim], allocated
once and zeroed (attention multiplies masked slots' values by exactly 0, and 0 * NaN from
uninitialized memory would be NaN). ``lengths`` stays on the host: the runtime needs it to
build masks and positions. Every move is a strided device copy (cudaMemcpy2DAsync): one call
per buffer to grow the capacity, to move a row, or to take a prefill's keys into a row.

Capacity is rounded up to a multiple of ``SLOT_MULTIPLE`` so every row starts 256-byte aligned
(TensorRT wants aligned tensor addresses; the shared layout binds rows at an offset).
"""

from __future__ import annotations

import weakref

import numpy as np

from llmx.cuda import ALIGN, D2H, H2D
from llmx.errors import InputError
from llmx.runtime.kv_cache import round_up

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SLOT_MULTIPLE = 64


def host_dtype(name: str) -> np.dtype:
    """numpy dtype for a KV dtype name (bfloat16 through ml_dtypes, which onnx installs)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _free_all(device, ptrs: list[int]) -> None:
    for ptr in ptrs:
        device.free(ptr)
    ptrs.clear()


class DeviceKVCache:
    def __init__(self, device, num_layers: int, kv_heads: int, head_dim: int, rows: int, capacity: int,
                 max_capacity: int, dtype: str = "float32"):
        if capacity > max_capacity:
            raise InputError(f"{capacity} tokens exceed the maximum sequence length {max_capacity}")
        if dtype not in ITEMSIZE:
            raise InputError(f"KV cache dtype {dtype!r} is not one of {', '.join(ITEMSIZE)}")
        self.device, self.dtype = device, dtype
        self.kv_heads, self.head_dim, self.max_capacity = kv_heads, head_dim, max_capacity
        self.slot_bytes = head_dim * ITEMSIZE[dtype]
        self._rows, self._capacity = rows, self._rounded(capacity)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.buffers: list[int] = []
        self._finalizer = weakref.finalize(self, _free_all, device, self.buffers)
        self.buffers.extend(device.alloc(self._bytes(self._capacity)) for _ in range(2 * num_layers))
        self.version = 0  # bumped when buffers move; backends key bindings and CUDA graphs on it

    def _rounded(self, capacity: int) -> int:
        return min(round_up(max(capacity, 1), SLOT_MULTIPLE), self.max_capacity)

    def _bytes(self, capacity: int) -> int:
        return self._rows * self.kv_heads * capacity * self.slot_bytes

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def row_bytes(self) -> int:
        return self.kv_heads * self._capacity * self.slot_bytes

    def row_ptr(self, buffer: int, row: int) -> int:
        return self.buffers[buffer] + row * self.row_bytes

    def nbytes(self) -> int:
        return len(self.buffers) * self._bytes(self._capacity)

    def close(self) -> None:
        self._finalizer()

    def ensure_capacity(self, needed: int) -> None:
        """Room for ``needed`` slots per row: new buffers (doubling), old slots copied over."""
        if needed <= self._capacity:
            return
        if needed > self.max_capacity:
            raise InputError(f"sequence of {needed} tokens exceeds the maximum length {self.max_capacity}")
        new_cap = self._rounded(max(needed, 2 * self._capacity))
        old_pitch, new_pitch = self._capacity * self.slot_bytes, new_cap * self.slot_bytes
        for i, old in enumerate(list(self.buffers)):
            new = self.device.alloc(self._bytes(new_cap))
            # [rows * heads] rows of old_pitch bytes each, into rows of new_pitch bytes
            self.device.copy_2d(new, new_pitch, old, old_pitch, old_pitch, self._rows * self.kv_heads)
            self.buffers[i] = new
            self.device.synchronize()
            self.device.free(old)
        self._capacity = new_cap
        self.version += 1

    def take(self, row: int, sources: list[int], src_head_pitch: int, src_offset: int, n: int) -> None:
        """Copy ``n`` slots per head from device ``sources`` (one per buffer, laid out
        [heads, *, head_dim] with ``src_head_pitch`` bytes between heads, starting ``src_offset``
        bytes in) into slots 0..n of ``row``: a prefill's keys/values entering the cache."""
        self.ensure_capacity(n)
        for b, src in enumerate(sources):
            self.device.copy_2d(self.row_ptr(b, row), self._capacity * self.slot_bytes, src + src_offset,
                                src_head_pitch, n * self.slot_bytes, self.kv_heads)
        self.lengths[row] = n

    def write(self, row: int, layer_entries: list[np.ndarray], start: int = 0) -> None:
        """Host entries [kv_heads, n, head_dim] per buffer into slots start..start+n."""
        n = layer_entries[0].shape[1]
        self.ensure_capacity(start + n)
        for b, entries in enumerate(layer_entries):
            host = np.ascontiguousarray(entries, dtype=host_dtype(self.dtype))
            self.device.copy_2d(self.row_ptr(b, row) + start * self.slot_bytes, self._capacity * self.slot_bytes,
                                host.ctypes.data, n * self.slot_bytes, n * self.slot_bytes, self.kv_heads, H2D)
        self.device.synchronize()
        self.lengths[row] = start + n

    def read(self, row: int, start: int = 0, end: int | None = None) -> list[np.ndarray]:
        end = int(self.lengths[row]) if end is None else end
        n, out = end - start, []
        for b in range(len(self.buffers)):
            host = np.empty((self.kv_heads, n, self.head_dim), host_dtype(self.dtype))
            self.device.copy_2d(host.ctypes.data, n * self.slot_bytes, self.row_ptr(b, row) + start * self.slot_bytes,
                                self._capacity * self.slot_bytes, n * self.slot_bytes, self.kv_heads, D2H)
            out.append(host)
        self.device.synchronize()
        return out

    def move_row(self, src: int, dst: int) -> None:
        """Move a sequence to another row (compacting a batch after one finishes)."""
        if src == dst:
            return
        n = int(self.lengths[src])
        pitch = self._capacity * self.slot_bytes
        for b in range(len(self.buffers)):
            self.device.copy_2d(self.row_ptr(b, dst), pitch, self.row_ptr(b, src), pitch, n * self.slot_bytes, self.kv_heads)
        self.lengths[dst], self.lengths[src] = n, 0

    def copy_span(self, src: int, dst: int, start: int, end: int) -> None:
        """Slots start..end of row ``src`` into row ``dst`` (beam search forks; see KVCache)."""
        pitch, offset = self._capacity * self.slot_bytes, start * self.slot_bytes
        for b in range(len(self.buffers)):
            self.device.copy_2d(self.row_ptr(b, dst) + offset, pitch, self.row_ptr(b, src) + offset, pitch,
                                (end - start) * self.slot_bytes, self.kv_heads)
        self.lengths[dst] = end

    def reorder(self, order: np.ndarray) -> None:
        """rows[i] <- rows[order[i]] for the first len(order) rows (beam search), via a scratch copy."""
        n, size = len(order), self.row_bytes
        for b in range(len(self.buffers)):
            scratch = self.device.alloc(n * size, zero=False)
            for i, src in enumerate(order):
                self.device.copy(scratch + i * size, self.row_ptr(b, int(src)), size)
            self.device.copy(self.buffers[b], scratch, n * size)
            self.device.synchronize()
            self.device.free(scratch)
        self.lengths[:n] = self.lengths[np.asarray(order)]


def take_prompts(cache: DeviceKVCache, rows: list[int], lengths: list[int], width: int, padding: str,
                 presents: list[int]) -> None:
    """Copy each prompt's keys/values from prefill outputs [b, heads, width, head_dim] (device
    pointers ``presents``, one per cache buffer) into slots 0..n of its cache row."""
    head_pitch = width * cache.slot_bytes
    for i, (row, n) in enumerate(zip(rows, lengths)):
        start = width - n if padding == "left" else 0
        sources = [p + i * cache.kv_heads * head_pitch for p in presents]
        cache.take(row, sources, head_pitch, start * cache.slot_bytes, n)


def scratch_presents(buffers: "DeviceBuffers", cache: DeviceKVCache, batch: int, width: int) -> list[int]:
    """Device scratch for a prefill's present outputs, one aligned [batch, heads, width, head_dim] each."""
    per_buffer = round_up(batch * cache.kv_heads * width * cache.slot_bytes, ALIGN)
    base = buffers.get("prefill_presents", per_buffer * len(cache.buffers))
    return [base + i * per_buffer for i in range(len(cache.buffers))]


class DeviceBuffers:
    """Named grow-only device buffers: steady-state calls reuse the same addresses."""

    def __init__(self, device):
        self.device, self.ptrs, self.sizes = device, {}, {}

    def get(self, name: str, nbytes: int) -> int:
        if self.sizes.get(name, -1) < nbytes:
            if name in self.ptrs:
                self.device.synchronize()
                self.device.free(self.ptrs[name])
            self.ptrs[name], self.sizes[name] = self.device.alloc(round_up(max(nbytes, 1), ALIGN), zero=False), nbytes
        return self.ptrs[name]

    def upload(self, name: str, arrays: dict[str, np.ndarray]) -> dict[str, int]:
        """Pack int64 ``arrays`` 256-byte aligned into one buffer with one copy; their addresses."""
        offsets, end = {}, 0
        for key, a in arrays.items():
            offsets[key], end = end, round_up(end + a.nbytes, ALIGN)
        host = np.zeros(end, np.uint8)
        for key, a in arrays.items():
            host[offsets[key]: offsets[key] + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
        base = self.get(name, end)
        self.device.upload(base, host)
        return {key: base + off for key, off in offsets.items()}

    def close(self) -> None:
        for ptr in self.ptrs.values():
            self.device.free(ptr)
        self.ptrs.clear()
