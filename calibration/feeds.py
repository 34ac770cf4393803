"""Calibration inputs for both graphs, built from token windows.

Prefill sees each window as one prompt. Decode must see what it sees in service: a real KV
cache, not zeros. Each window is prefilled once on the fp32 graph; its keys/values up to a
split point become the past, and the next token(s) the new input. Split points cover early,
middle and late positions with single-token steps (generation) plus one multi-token chunk
(chunked prefill, speculative verification and ``llmx eval``, which all feed T > 1).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.artifact.manifest import Manifest
from llmx.runtime.onnx_backend import session_options


def prefill_feed(window: list[int]) -> dict[str, np.ndarray]:
    ids = np.asarray([window], dtype=np.int64)
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
    }


def decode_splits(length: int) -> list[tuple[int, int]]:
    """(past length, new tokens) pairs taken from one window of ``length`` tokens."""
    quarter, half = max(1, length // 4), max(1, length // 2)
    steps = sorted({(quarter, 1), (half, 1), (length - 1, 1)})
    return [*steps, (half, length - half)]


def decode_feed(manifest: Manifest, window: list[int], presents: list[np.ndarray], start: int, count: int) -> dict:
    """Inputs for one decode call: ``count`` tokens after a past of ``start`` real entries."""
    total = start + count
    feed = {
        "input_ids": np.asarray([window[start:total]], dtype=np.int64),
        "attention_mask": np.ones((1, total), dtype=np.int64),
        "position_ids": np.arange(start, total, dtype=np.int64)[None],
    }
    for name, present in zip(manifest.kv.past_names(), presents):
        past = np.zeros((1, present.shape[1], total, present.shape[3]), present.dtype)
        past[:, :, :start] = present[:, :, :start]
        feed[name] = past
    return feed


class Feeds:
    """Calibration inputs of one artifact's graphs; iterable any number of times."""

    def __init__(self, artifact: Artifact, windows: list[list[int]], threads: int | None = None):
        self.artifact, self.windows, self.threads = artifact, windows, threads

    def count(self, graph: str) -> int:
        per_window = 1 if graph == "prefill" else len(decode_splits(len(self.windows[0])))
        return per_window * len(self.windows)

    def __call__(self, graph: str) -> Iterator[dict[str, np.ndarray]]:
        if graph == "prefill":
            yield from (prefill_feed(w) for w in self.windows)
            return
        # KV comes from the fp32 source graph: what a quantized decode graph meets in service
        # is the cache written by its own prefill, which calibration keeps close to fp32. The
        # session lives for one pass: kept for the whole calibration, its packed fp32 weights
        # were a fifth of a w8a8 search's peak (SmolLM2-135M: 0.6 of 2.4 GB).
        import onnxruntime as ort

        path = self.artifact.graph_path("prefill")
        prefill = ort.InferenceSession(str(path), session_options(self.threads, prepack=False),
                                       providers=["CPUExecutionProvider"])
        for window in self.windows:
            presents = prefill.run(None, prefill_feed(window))[1:]
            for start, count in decode_splits(len(window)):
                yield decode_feed(self.artifact.manifest, window, presents, start, count)
