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

from llmx.artifact.onnx_files import load_graph, save_graphs, stored_bytes
from llmx.calibration.activations import ActivationStats
from llmx.calibration.matmuls import drop_unused_initializers, initializers, read_array, weight_matmuls
from llmx.calibration.sensitivity import PROBE_INPUT, group_keys, probe_model, quantized_product, relative_error
from llmx.calibration.smoothquant import apply_smoothing, smoothing_scales
from llmx.calibration.static import collect_ranges, quantize_qdq, ranges_from_stats


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
    return sum(stored_bytes(init) for init in model.graph.initializer)


class StaticBuilder:
    """w8a8 Q/DQ graphs of one graph, written under ``work``.

    ONNX Runtime's quantizer (``static.quantize_qdq``) runs once per recipe (range method and
    SmoothQuant alpha): its weight rounding, per channel in numpy, was 40 % of a w8a8 search
    when it ran for every candidate. Every other graph of that recipe (fallbacks, one layer's
    MatMuls alone) is derived from that one: the MatMuls left out read their activation and their
    fp32 weight again (``fp32_matmuls``), referencing the recipe graph's files beside it.
    """

    def __init__(self, fp32: Path, graph: str, stats: ActivationStats, feeds, per_channel: bool, work: Path):
        self.fp32, self.graph, self.stats, self.feeds, self.per_channel = fp32, graph, stats, feeds, per_channel
        self.work, self.built = work, 0
        self._smoothed: dict[float | None, tuple[Path, dict | None]] = {}
        self._ranges: dict[tuple[str, float | None], object] = {}
        self._recipes: dict[tuple[str, float | None], Path] = {}
        self._matmuls = {mm.node.name: mm.weight for mm in weight_matmuls(load_graph(fp32))}
        self._weights = list(self._matmuls.values())

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
            ranges = ranges_from_stats(method, load_graph(path), self.stats, self.graph, scales)  # no model run
            if ranges is None:
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
        """A candidate graph's session holds its weights now: the graph goes (its recipe's files stay)."""
        graph.unlink()

    def recipe(self, candidate: Candidate) -> Path:
        """Every MatMul quantized as ``candidate``'s recipe: written once, beside its source graph."""
        key = (candidate.method, candidate.alpha)
        if key not in self._recipes:
            path, _ = self.smoothed(candidate.alpha)
            out = path.with_name(f"qdq-{candidate.method}.onnx")
            quantize_qdq(path, out, self.ranges(*key), candidate.method, self.per_channel)
            self._recipes[key] = out
        return self._recipes[key]

    def _qdq(self, candidate: Candidate, skip: set[str]) -> Path:
        """A new Q/DQ graph for ``candidate``; MatMuls of ``skip`` stay fp32."""
        import onnx

        recipe = self.recipe(candidate)
        model = load_graph(recipe)
        source = load_graph(self.smoothed(candidate.alpha)[0])
        fp32_matmuls(model, {node: w for node, w in self._matmuls.items() if w in skip}, initializers(source))
        self.built += 1
        out = recipe.with_name(f"candidate-{self.built}.onnx")
        onnx.save_model(model, str(out))  # its initializers all reference files beside it
        return out


def fp32_matmuls(model, weights: dict[str, str], fp32: dict) -> None:
    """In a Q/DQ graph, the MatMuls named in ``weights`` (node name -> weight name) read their
    activation unquantized and their fp32 initializer from ``fp32`` (same directory) again; the
    Q/DQ nodes and tensors no longer read are removed."""
    producer = {o: n for n in model.graph.node for o in n.output}
    present = {i.name for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.name not in weights:
            continue
        dq = producer.get(node.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear":
            node.input[0] = q.input[0]
        node.input[1] = weights[node.name]
        if node.input[1] not in present:
            model.graph.initializer.append(fp32[node.input[1]])
            present.add(node.input[1])
    _prune(model)


def _prune(model) -> None:
    """Remove nodes none of whose outputs is read, then initializers nothing reads."""
    outputs = {o.name for o in model.graph.output}
    while True:
        read = {i for n in model.graph.node for i in n.input} | outputs
        dead = [n for n in model.graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            model.graph.node.remove(n)
    drop_unused_initializers(model)


def by_sensitivity(weights: list[str], sensitivity: dict[str, float]) -> list[str]:
    """Weights from most to least sensitive (ties by graph order)."""
    return [w for _, w in sorted(((-sensitivity[w], i), w) for i, w in enumerate(weights))]


