"""Activation statistics of every weight MatMul's input, collected in one pass over the data.

The search tries many configurations; all of them are derived from these numbers instead of
rerunning the fp32 model:

    absmax[graph][weight]   per-input-channel max |X|   SmoothQuant scales, minmax ranges
    mean_abs[weight]        per-input-channel mean |X|  AWQ's activation-aware scales
    mean_square[weight]     per-input-channel mean X^2  importance-weighted rounding (rounding.py)
    rows[weight]            a sample of X's rows         AWQ's output-error search
    tops[graph][weight]     per-channel largest |X|      percentile ranges (w8a8; static.percentile_ranges)

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
# w8a8's percentile ranges clip the top 0.001 % of |X / s| (s: a SmoothQuant scaling, known only
# after this pass). Those values are among each channel's largest few whatever s is: keeping
# these decides the range of every scaling without a calibrator rerunning the model (SmolLM2-135M,
# 32 calibration windows: the search's percentile tier took 42 s, now 7). 128 rows of 576-1536
# channels: 0.3-0.8 MB a MatMul input; the top 0.001 % of 4192 x 1536 decode values is 65 of them.
# Kept for the graph the search scores (decode): about 6 s of SmolLM2's 40 s statistics pass;
# prefill's would be as much again, for the artifact of the rare search that picks percentile
# (prefill's calibrator runs then).
TOP_ROWS = 128


@dataclass
class ActivationStats:
    absmax: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # graph -> weight -> [in]
    abs_sum: dict[str, np.ndarray] = field(default_factory=dict)
    square_sum: dict[str, np.ndarray] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    rows: Mapping[str, np.ndarray] = field(default_factory=dict)  # a dict while collected; spill() moves it
    top_rows: int = 0  # rows of largest |X| kept per channel (0: none)
    top_graphs: tuple[str, ...] = ()  # the graphs they are kept for
    tops: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # graph -> weight -> [in, <= top_rows]
    seen: dict[str, dict[str, int]] = field(default_factory=dict)  # graph -> weight -> rows of X seen

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
        magnitude = np.abs(flat)
        channel_max = magnitude.max(0)
        table = self.absmax.setdefault(graph, {})
        abs_sum, square_sum = magnitude.sum(0, dtype=np.float64), np.square(flat).sum(0, dtype=np.float64)
        if self.top_rows and graph in self.top_graphs:
            self._keep_top(graph, weights, magnitude)
        for weight in weights:
            table[weight] = np.maximum(table[weight], channel_max) if weight in table else channel_max
            self.abs_sum[weight] = self.abs_sum.get(weight, 0) + abs_sum
            self.square_sum[weight] = self.square_sum.get(weight, 0) + square_sum
            self.count[weight] = self.count.get(weight, 0) + len(flat)
            kept = self.rows.get(weight)
            if kept is None or len(kept) < SAMPLE_ROWS:
                take = flat[rng.choice(len(flat), min(len(flat), SAMPLE_ROWS), replace=False)]
                self.rows[weight] = take if kept is None else np.concatenate([kept, take])[:SAMPLE_ROWS]

    def _keep_top(self, graph: str, weights: list[str], magnitude: np.ndarray) -> None:
        # channel-major ([in, kept]): a channel's values contiguous for np.partition (2-3x faster)
        tops, seen = self.tops.setdefault(graph, {}), self.seen.setdefault(graph, {})
        kept = tops.get(weights[0])
        if kept is None or kept.shape[1] < self.top_rows:
            both = magnitude.T if kept is None else np.concatenate([kept, magnitude.T], axis=1)
            kept = np.ascontiguousarray(both if both.shape[1] <= self.top_rows else top_columns(both, self.top_rows))
        else:  # only channels where a new value beats the smallest kept one change (later feeds: fewer)
            hit = np.flatnonzero(magnitude.max(0) > kept.min(1))
            if len(hit):
                kept[hit] = top_columns(np.concatenate([kept[hit], magnitude[:, hit].T], axis=1), self.top_rows)
        for weight in weights:
            tops[weight] = kept
            seen[weight] = seen.get(weight, 0) + len(magnitude)


def top_columns(values: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` largest of each row of ``values``, in no order."""
    return np.partition(values, -n, axis=1)[:, -n:]


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
                  layered: bool = False, top_rows: int = 0, top_graphs: tuple[str, ...] = ()) -> ActivationStats:
    """Run each fp32 graph once over its feeds (whole, or a layer at a time), watching the inputs
    of its weight MatMuls; ``top_rows``: keep that many largest |X| per channel (``tops``) of
    ``top_graphs``."""
    stats, rngs = ActivationStats(top_rows=top_rows, top_graphs=top_graphs), {}
    for graph, weights, value in matmul_inputs(graph_paths, feeds, progress, threads, "stats", layered):
        # one generator per input, so the sampled rows do not depend on the order the layers come in
        rng = rngs.setdefault(weights[0], np.random.default_rng(zlib.crc32(weights[0].encode())))
        stats.add(graph, weights, value, rng)
    return stats
