"""Activation statistics of every weight MatMul's input, collected in one pass over the data.

The search tries many configurations; all of them are derived from these numbers instead of
rerunning the fp32 model:

    absmax[graph][weight]   per-input-channel max |X|   SmoothQuant scales, minmax ranges
    mean_abs[weight]        per-input-channel mean |X|  AWQ's activation-aware scales
    mean_square[weight]     per-input-channel mean X^2  importance-weighted rounding (rounding.py)
    rows[weight]            a sample of X's rows         AWQ's output-error search

Keyed by weight name, the one name prefill and decode share for a MatMul.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from llmx.calibration.on_disk import ArrayMapOnDisk
from llmx.calibration.smoothquant import matmul_inputs

SAMPLE_ROWS = 256  # rows of X kept per MatMul input (AWQ's search: enough to rank a few scales)


@dataclass
class ActivationStats:
    absmax: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # graph -> weight -> [in]
    abs_sum: dict[str, np.ndarray] = field(default_factory=dict)
    square_sum: dict[str, np.ndarray] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    rows: Mapping[str, np.ndarray] = field(default_factory=dict)  # a dict while collected; spill() moves it

    def merged_absmax(self) -> dict[str, np.ndarray]:
        """Max over all graphs: what one set of smoothing scales for both graphs must cover."""
        out: dict[str, np.ndarray] = {}
        for per_graph in self.absmax.values():
            for weight, value in per_graph.items():
                out[weight] = np.maximum(out[weight], value) if weight in out else value
        return out

    def mean_abs(self, weight: str) -> np.ndarray:
        return self.abs_sum[weight] / max(1, self.count[weight])

    def mean_square(self, weight: str) -> np.ndarray:
        return self.square_sum[weight] / max(1, self.count[weight])

    def spill(self, path: Path) -> None:
        """The sampled rows to ``path``, read back per use: they then leave a candidate's session
        the memory they held (an 8B model's: 0.8 GB). No row is added after."""
        self.rows = ArrayMapOnDisk(path, self.rows)

    def add(self, graph: str, weights: list[str], value: np.ndarray, rng: np.random.Generator) -> None:
        flat = value.reshape(-1, value.shape[-1]).astype(np.float32)
        channel_max = np.abs(flat).max(0)
        table = self.absmax.setdefault(graph, {})
        abs_sum, square_sum = np.abs(flat).sum(0, dtype=np.float64), np.square(flat).sum(0, dtype=np.float64)
        for weight in weights:
            table[weight] = np.maximum(table[weight], channel_max) if weight in table else channel_max
            self.abs_sum[weight] = self.abs_sum.get(weight, 0) + abs_sum
            self.square_sum[weight] = self.square_sum.get(weight, 0) + square_sum
            self.count[weight] = self.count.get(weight, 0) + len(flat)
            kept = self.rows.get(weight)
            if kept is None or len(kept) < SAMPLE_ROWS:
                take = flat[rng.choice(len(flat), min(len(flat), SAMPLE_ROWS), replace=False)]
                self.rows[weight] = take if kept is None else np.concatenate([kept, take])[:SAMPLE_ROWS]


def statistics_graphs(paths: dict[str, Path], scheme: str) -> dict[str, Path]:
    """The graphs whose MatMul inputs the statistics watch. w8a8 sets each graph's own ranges; the
    weight-only schemes use them merged (SmoothQuant, AWQ, sensitivity rows), and a decoder's decode
    feeds give its MatMuls the values prefill computes at some of the same positions: prefill alone
    (about half the statistics pass)."""
    if scheme != "w8a8" and "prefill" in paths:
        return {"prefill": paths["prefill"]}
    return paths


def collect_stats(graph_paths: dict[str, Path], feeds: Callable[[str], Iterable[dict]],
                  progress: Callable[[int], None] = lambda n: None, threads: int | None = None,
                  layered: bool = False) -> ActivationStats:
    """Run each fp32 graph once over its feeds (whole, or a layer at a time), watching the inputs
    of its weight MatMuls."""
    stats, rngs = ActivationStats(), {}
    for graph, weights, value in matmul_inputs(graph_paths, feeds, progress, threads, "stats", layered):
        # one generator per input, so the sampled rows do not depend on the order the layers come in
        rng = rngs.setdefault(weights[0], np.random.default_rng(zlib.crc32(weights[0].encode())))
        stats.add(graph, weights, value, rng)
    return stats
