"""The one interface every backend implements (ONNX Runtime CPU, ONNX Runtime CUDA/TensorRT
providers, TensorRT): the generation loop, the server and the benchmarks hold a ``Backend``
and never ask which one it is."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from llmx.artifact.manifest import Manifest


class Cache(Protocol):
    """A KV cache of ``rows`` sequences (host: KVCache, device: DeviceKVCache)."""

    lengths: np.ndarray  # [rows] filled slots per row
    version: int  # bumped when the buffers move

    @property
    def rows(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def ensure_capacity(self, needed: int) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Logits come back in buffers the backend may reuse: valid until its next prefill or decode
    call (copy to keep them; the ONNX Runtime backend returns a view of its bound output)."""

    manifest: Manifest
    vocab_size: int
    prefill_calls: int  # how often prefill ran (tests and metrics)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence this backend takes (model, or the engines' build limit)."""

    def new_cache(self, rows: int, capacity: int) -> Cache:
        """A cache for ``rows`` sequences with room for ``capacity`` tokens each (it grows)."""

    def prefill(self, cache: Cache, rows: list[int], prompts: list[list[int]], padding: str = "right") -> np.ndarray:
        """Run whole prompts; their keys/values land in ``rows``; last-position logits [n, V]."""

    def decode(self, cache: Cache, input_ids: np.ndarray, last_only: bool = False) -> np.ndarray:
        """Append ``input_ids`` [n, T] to rows 0..n-1 of ``cache``; logits [n, T, V]. ``last_only``: the
        caller reads position -1 only, so a backend may return [n, 1, V] (the decode graph's logits_to_keep)."""
