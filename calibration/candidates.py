"""The configurations the search tries, and how each becomes a quantized graph to score.

A ``Candidate`` is one recipe: the activation-range method and SmoothQuant alpha (w8a8) or
AWQ on/off and the block size (w8/w4), plus the MatMuls (by weight name) kept in higher
precision: fp32 under w8a8, accuracy level 0 under w8, 8-bit weights under w4. Builders turn
a candidate into the searched graph only (decode, or an encoder's embed), reusing the
activation statistics and caching each smoothed graph and range set, so trying a candidate
costs one quantization and one scoring pass, never another fp32 calibration run for minmax
ranges.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmx.artifact.onnx_files import load_graph, save_graphs
from llmx.calibration.activations import ActivationStats
from llmx.calibration.awq import awq_scales
from llmx.calibration.matmuls import add_initializer, initializers, read_array, replace_initializer, weight_matmuls
from llmx.calibration.smoothquant import apply_smoothing, smoothing_scales
from llmx.calibration.static import collect_ranges, minmax_ranges, quantize_qdq
from llmx.calibration.weight_only import BITS, quantize_weights


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
            parts = [f"{'awq' if self.awq else 'rtn'} b{self.block_size}"]
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
        self._loaded: dict[Path, object] = {}

    def weights(self) -> list[str]:
        return [mm.weight for mm in weight_matmuls(load_graph(self.fp32))]

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

    def only(self, candidate: Candidate, weight: str) -> tuple[object, int]:
        """The fp32 graph with only ``weight``'s MatMul quantized (sensitivity), built in memory.

        Fake-quantized: a QuantizeLinear/DequantizeLinear pair on its input at the candidate's
        range, its weight rounded to INT8 per output channel; numerically what the Q/DQ graph
        computes, without a quantizer run per MatMul.
        """
        import onnx

        path, _ = self.smoothed(candidate.alpha)
        if path not in self._loaded:
            self._loaded[path] = onnx.load_model(str(path))
        model = _copy(self._loaded[path])
        mm = next(m for m in weight_matmuls(model) if m.weight == weight)
        top = float(np.asarray(self.ranges(candidate.method, candidate.alpha)[mm.activation].range_value[1]))
        _fake_quantize_input(model, mm, top / 127)
        w = read_array(initializers(model)[weight], path.parent)
        step = np.maximum(np.abs(w).max(0, keepdims=True), 1e-12) / 127
        replace_initializer(model, weight, (np.clip(np.round(w / step), -127, 127) * step).astype(np.float32))
        return model, graph_bytes(model)

    def build(self, candidate: Candidate, skip: Collection[str] = ()) -> tuple[Path, int]:
        """(the quantized graph's path, its tensor bytes); MatMuls of ``skip`` stay fp32 too."""
        import onnx

        path, _ = self.smoothed(candidate.alpha)
        self.built += 1
        out = self.work / f"qdq-{self.built}" / f"{self.graph}.onnx"
        out.parent.mkdir(parents=True)
        quantize_qdq(path, out, self.ranges(candidate.method, candidate.alpha), candidate.method, self.per_channel,
                     skip=set(skip) | set(candidate.fallback))
        return out, graph_bytes(onnx.load_model(str(out), load_external_data=False))


class WeightOnlyBuilder:
    """w8/w4 MatMulNBits graphs of one graph at each candidate's block size, built in memory from its
    fp32 weights."""

    def __init__(self, fp32: Path, graph: str, stats: ActivationStats | None, scheme: str, symmetric: bool):
        import onnx

        self.graph, self.stats, self.scheme, self.symmetric = graph, stats, scheme, symmetric
        self.fp32 = onnx.load_model(str(fp32))
        self._awq: dict[int, object] = {}  # AWQ scales are fitted to the blocks they round in

    def weights(self) -> list[str]:
        return [mm.weight for mm in weight_matmuls(self.fp32)]

    def source(self, candidate: Candidate):
        if not candidate.awq:
            return self.fp32
        block = candidate.block_size
        if block not in self._awq:
            model = _copy(self.fp32)
            apply_smoothing(model, Path("."), awq_scales(model, Path("."), self.stats, block, BITS[self.scheme]))
            self._awq[block] = model
        return self._awq[block]

    def only(self, candidate: Candidate, weight: str) -> tuple[object, int]:
        """The fp32 graph with only ``weight``'s MatMul quantized (sensitivity)."""
        return self.build(candidate, skip=[w for w in self.weights() if w != weight])

    def build(self, candidate: Candidate, skip: Collection[str] = ()) -> tuple[object, int]:
        model = quantize_weights(_copy(self.source(candidate)), self.scheme, candidate.block_size, self.symmetric,
                                 fallback=set(candidate.fallback), skip=set(skip))
        return model, graph_bytes(model)


def _fake_quantize_input(model, mm, scale: float) -> None:
    import onnx

    prefix = f"sensitivity.{mm.weight}"
    add_initializer(model, f"{prefix}.scale", np.asarray(scale, np.float32))
    add_initializer(model, f"{prefix}.zero", np.asarray(0, np.int8))
    q = onnx.helper.make_node("QuantizeLinear", [mm.activation, f"{prefix}.scale", f"{prefix}.zero"], [f"{prefix}.q"])
    dq = onnx.helper.make_node("DequantizeLinear", [f"{prefix}.q", f"{prefix}.scale", f"{prefix}.zero"],
                               [f"{prefix}.dq"])
    position = list(model.graph.node).index(mm.node)
    model.graph.node.insert(position, dq)
    model.graph.node.insert(position, q)
    mm.node.input[0] = f"{prefix}.dq"


def _copy(model):
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def by_sensitivity(weights: list[str], sensitivity: dict[str, float]) -> list[str]:
    """Weights from most to least sensitive (ties by graph order)."""
    return [w for _, w in sorted(((-sensitivity[w], i), w) for i, w in enumerate(weights))]


