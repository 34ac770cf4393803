"""The configurations the search tries, and how each becomes a quantized graph to score.

A ``Candidate`` is one recipe: the activation-range method and SmoothQuant alpha (w8a8) or
the block size and the channel scaling, SmoothQuant alpha or AWQ (w8/w4), plus the MatMuls
(by weight name) kept in higher precision: fp32 under w8a8 and w8, 8-bit weights under w4.
Builders turn a candidate into the searched graph only (decode, or an encoder's embed), reusing the
activation statistics and caching each smoothed graph and range set, so trying a candidate
costs one quantization and one scoring pass, never another fp32 calibration run for minmax
ranges. This module's ``StaticBuilder`` makes w8a8's Q/DQ graphs; weight_only_builder.py makes
w8/w4's from blocks quantized once.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmx.artifact.onnx_files import load_graph, save_graphs
from llmx.calibration.activations import ActivationStats
from llmx.calibration.matmuls import initializers, read_array, weight_matmuls
from llmx.calibration.sensitivity import PROBE_INPUT, group_keys, probe_model, quantized_product, relative_error
from llmx.calibration.smoothquant import apply_smoothing, smoothing_scales
from llmx.calibration.static import collect_ranges, minmax_ranges, quantize_qdq


@dataclass(frozen=True)
class Candidate:
    method: str | None = None  # w8a8 activation ranges
    alpha: float | None = None  # w8a8 SmoothQuant alpha
    awq: bool = False  # w8/w4
    fallback: tuple[str, ...] = ()  # weight names, most sensitive first
    block_size: int | None = None  # w8/w4: input channels per scale

    def label(self) -> str:
        if self.method is not None:
            parts = [self.method, f"sq{self.alpha:g}" if self.alpha is not None else "no-sq"]
        else:
            scaling = "awq" if self.awq else f"sq{self.alpha:g}" if self.alpha is not None else "rtn"
            parts = [f"{scaling} b{self.block_size}"]
        return "+".join(parts + ([f"fallback {len(self.fallback)}"] if self.fallback else []))


def graph_bytes(model, base_dir: Path | None = None) -> int:
    """Bytes of a graph's tensors: external lengths where stored outside, else the inline bytes."""
    total = 0
    for init in model.graph.initializer:
        info = {e.key: e.value for e in init.external_data}
        total += int(info["length"]) if "length" in info else len(init.raw_data) or init.ByteSize()
    return total


class StaticBuilder:
    """w8a8 Q/DQ graphs of one graph (via ``static.quantize_qdq``), written under ``work``."""

    def __init__(self, fp32: Path, graph: str, stats: ActivationStats, feeds, per_channel: bool, work: Path):
        self.fp32, self.graph, self.stats, self.feeds, self.per_channel = fp32, graph, stats, feeds, per_channel
        self.work, self.built = work, 0
        self._smoothed: dict[float | None, tuple[Path, dict | None]] = {}
        self._ranges: dict[tuple[str, float | None], object] = {}
        self._weights = [mm.weight for mm in weight_matmuls(load_graph(fp32))]

    def weights(self) -> list[str]:
        return list(self._weights)

    def smoothed(self, alpha: float | None) -> tuple[Path, dict | None]:
        if alpha not in self._smoothed:
            self._smoothed[alpha] = (self.fp32, None) if alpha is None else self._smooth(alpha)
        return self._smoothed[alpha]

    def _smooth(self, alpha: float) -> tuple[Path, dict]:
        model, base = load_graph(self.fp32), self.fp32.parent
        scales = smoothing_scales(model, base, self.stats.merged_absmax(), alpha)
        apply_smoothing(model, base, scales)
        out = self.work / f"smooth-{alpha:g}"
        out.mkdir(parents=True)
        save_graphs({self.graph: model}, out, sources={self.graph: base})
        return out / f"{self.graph}.onnx", scales

    def ranges(self, method: str, alpha: float | None):
        if (method, alpha) not in self._ranges:
            path, scales = self.smoothed(alpha)
            if method == "minmax":  # straight from the statistics: no model run
                ranges = minmax_ranges(load_graph(path), self.stats.absmax[self.graph], scales)
            else:
                ranges = collect_ranges(path, self.feeds(self.graph), method)
            self._ranges[(method, alpha)] = ranges
        return self._ranges[(method, alpha)]

    def local_errors(self, candidate: Candidate, rows: dict[str, np.ndarray], threads: int | None = None,
                     progress: Callable[[int], None] = lambda n: None) -> dict[str, float]:
        """Each MatMul's relative output error on its calibration ``rows`` under ``candidate``'s
        smoothing and ranges, run as a one-MatMul Q/DQ graph (sensitivity.py)."""
        import onnx
        from onnxruntime.quantization.calibrate import TensorsData

        path, scales = self.smoothed(candidate.alpha)
        model = load_graph(path, with_weights=True)
        ranges, keys, inits = self.ranges(candidate.method, candidate.alpha), group_keys(model), initializers(model)
        probe = self.work / "probe"
        probe.mkdir(parents=True, exist_ok=True)
        found = {}
        for mm in weight_matmuls(model):
            s = (scales or {}).get(keys[mm.weight])
            x = rows[mm.weight] if s is None else rows[mm.weight] / s
            w = read_array(inits[mm.weight], path.parent)
            onnx.save_model(probe_model(w), str(probe / "fp32.onnx"))
            data = TensorsData(ranges.calibration_method, {PROBE_INPUT: ranges[mm.activation]})
            quantize_qdq(probe / "fp32.onnx", probe / "qdq.onnx", data, candidate.method, self.per_channel)
            found[mm.weight] = relative_error(x @ w, quantized_product(x, probe / "qdq.onnx", threads))
            progress(1)
        shutil.rmtree(probe)
        return found

    def only(self, candidate: Candidate, weights: list[str]) -> Path:
        """The graph with only ``weights``' MatMuls quantized as ``candidate`` (the rest fp32)."""
        return self._qdq(candidate, skip=set(self._weights) - set(weights))

    def build(self, candidate: Candidate) -> tuple[Path, int]:
        """(the quantized graph's path, its tensor bytes)."""
        import onnx

        out = self._qdq(candidate, skip=set(candidate.fallback))
        return out, graph_bytes(onnx.load_model(str(out), load_external_data=False))

    def discard(self, graph: Path) -> None:
        """A candidate graph's session holds its weights now: its directory goes."""
        shutil.rmtree(graph.parent)

    def _qdq(self, candidate: Candidate, skip: set[str]) -> Path:
        """A new Q/DQ graph under ``work`` for ``candidate``; MatMuls of ``skip`` stay fp32."""
        path, _ = self.smoothed(candidate.alpha)
        self.built += 1
        out = self.work / f"qdq-{self.built}" / f"{self.graph}.onnx"
        out.parent.mkdir(parents=True)
        quantize_qdq(path, out, self.ranges(candidate.method, candidate.alpha), candidate.method, self.per_channel,
                     skip=skip)
        return out


def by_sensitivity(weights: list[str], sensitivity: dict[str, float]) -> list[str]:
    """Weights from most to least sensitive (ties by graph order)."""
    return [w for _, w in sorted(((-sensitivity[w], i), w) for i, w in enumerate(weights))]


