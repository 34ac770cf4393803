"""SmoothQuant (Xiao et al., 2023) at the ONNX graph level: move activation outliers into weights.

For a MatMul Y = X W (W: [in, out]) and per-input-channel scales s:

    Y = (X diag(1/s)) (diag(s) W),    s_j = max|X_j|^alpha / max|W_j|^(1-alpha)

X / s has flatter channels (easier to quantize per tensor); diag(s) W absorbs them (weights
are quantized per output channel, so a row scale costs them little). 1/s folds into the op
that produced X when that op scales channels by a constant (the Mul of RMSNorm, the scale and
bias of LayerNorm) and only these MatMuls read X; otherwise a Mul by 1/s is inserted. The
transform is exact in real arithmetic: fp32 outputs stay the same before quantization.

ONNX Runtime's own SmoothQuant option needs Intel Neural Compressor; this needs nothing more
than the graphs. Scales are computed once from both graphs' calibration runs and applied
identically to prefill and decode, so the smoothed weights stay byte-identical and are stored
once in weights.bin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from llmx.calibration.matmuls import (
    LOOKUP,
    ROW_SCALES,
    add_initializer,
    consumers,
    drop_unused_initializers,
    initializers,
    producers,
    read_array,
    replace_initializer,
    weight_matmuls,
)
from llmx.runtime.onnx_backend import session_options

# Ops whose output channels are scaled by constant per-channel inputs (index: scale, shift).
# The contrib variants appear in graphs written by the optimize stage.
CHANNEL_SCALING_INPUTS = {
    "LayerNormalization": (1, 2),
    "SimplifiedLayerNormalization": (1,),
    "SkipLayerNormalization": (2, 3),
    "SkipSimplifiedLayerNormalization": (2,),
}
_EPS = 1e-5


@dataclass
class Group:
    """MatMuls that read the same activation: they must share one smoothing scale."""

    activation: str
    weights: list[str]

    @property
    def key(self) -> str:
        return self.weights[0]


def groups(model) -> list[Group]:
    by_activation: dict[str, list[str]] = {}
    for mm in weight_matmuls(model):
        by_activation.setdefault(mm.activation, []).append(mm.weight)
    return [Group(act, sorted(set(ws))) for act, ws in by_activation.items()]


# -- statistics ------------------------------------------------------------------------------

def matmul_inputs(graph_paths: dict[str, Path], feeds: Callable[[str], Iterable[dict]],
                  progress: Callable[[int], None] = lambda n: None, threads: int | None = None, tag: str = "watch",
                  layered: bool = False):
    """Run each fp32 graph over its feeds; yield (graph, weight names, value) for the input of
    every weight MatMul group, as the graph computes it. ``layered``: a layer at a time
    (layered.py; ``progress`` counts stages, and the values come a layer's at a time)."""
    import onnx
    import onnxruntime as ort

    for graph, path in graph_paths.items():
        model = onnx.load_model(str(path), load_external_data=False)
        watched = {g.activation: g.weights for g in groups(model)}
        if layered:
            from llmx.calibration.layered import LayeredGraph

            for _, values in LayeredGraph(path, threads).run_each(list(watched), feeds(graph), progress):
                for name, value in values.items():
                    yield graph, watched[name], value
            continue
        outputs = {o.name for o in model.graph.output}
        model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(a) for a in watched if a not in outputs)
        augmented = path.with_name(f"{path.stem}.{tag}.onnx")  # beside weights.bin, which it references
        onnx.save_model(model, str(augmented))
        try:
            session = ort.InferenceSession(str(augmented), session_options(threads), providers=["CPUExecutionProvider"])
            names = list(watched)
            for feed in feeds(graph):
                for name, value in zip(names, session.run(names, feed)):
                    yield graph, watched[name], value
                progress(1)
            del session
        finally:
            augmented.unlink()


def activation_absmax(graph_paths: dict[str, Path], feeds: Callable[[str], Iterable[dict]],
                      progress: Callable[[int], None] = lambda n: None, threads: int | None = None) -> dict[str, np.ndarray]:
    """Per-input-channel max |X| of every weight MatMul's input, keyed by weight name, over all graphs."""
    stats: dict[str, np.ndarray] = {}
    for _, weights, value in matmul_inputs(graph_paths, feeds, progress, threads, "absmax"):
        channel_max = np.abs(value).reshape(-1, value.shape[-1]).max(0)
        for weight in weights:
            stats[weight] = np.maximum(stats[weight], channel_max) if weight in stats else channel_max
    return stats


def smoothing_scales(model, base_dir: Path, absmax: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """s per group (keyed by the group's first weight name)."""
    inits = initializers(model)
    scales = {}
    for group in groups(model):
        if not all(w in absmax for w in group.weights):
            continue
        act = np.max([absmax[w] for w in group.weights], axis=0).astype(np.float64)
        wmax = np.max([np.abs(read_array(inits[w], base_dir)).max(1) for w in group.weights], axis=0).astype(np.float64)
        s = np.power(np.maximum(act, _EPS), alpha) / np.power(np.maximum(wmax, _EPS), 1 - alpha)
        s[(act == 0) | (wmax == 0)] = 1.0  # dead channels: nothing to migrate
        scales[group.key] = np.clip(s, 1e-4, 1e4).astype(np.float32)
    return scales


# -- the transform ---------------------------------------------------------------------------

def apply_smoothing(model, base_dir: Path, scales: dict[str, np.ndarray], scale_weights: bool = True) -> dict[str, int]:
    """Scale weights by s (kept inline) and their inputs by 1/s, in place. Returns counts of
    folded/inserted. ``scale_weights=False``: the inputs' side only, the weights left as they are
    for a caller that multiplies them by s as it reads them (weight_only_builder: an 8B model's
    scaled weights would be another 30 GB)."""
    inits = initializers(model)
    users, makers = consumers(model), producers(model)
    counts = {"folded": 0, "inserted": 0}
    row_scales = {}
    for group in groups(model):
        s = scales.get(group.key)
        if s is None:
            continue
        for w in group.weights:
            if scale_weights:
                replace_initializer(model, w, read_array(inits[w], base_dir) * s[:, None])
            if w + LOOKUP in inits:  # a tied head: its lookup, if it reads the head's blocks, divides by s
                row_scales[w + ROW_SCALES] = s
        group_nodes = {id(n) for n in users.get(group.activation, []) if n.op_type == "MatMul"}
        only_these = all(id(n) in group_nodes for n in users.get(group.activation, []))
        producer = makers.get(group.activation)
        if only_these and producer is not None and _fold(model, producer, group, s, inits, base_dir):
            counts["folded"] += 1
        else:
            _insert_mul(model, group, s, users)
            counts["inserted"] += 1
    drop_unused_initializers(model)  # norm weights replaced by their smoothed copies
    for name, s in row_scales.items():  # read by no node until calibration/weight_only.py lookups_from_blocks
        add_initializer(model, name, s)
    return counts


def _fold(model, producer, group: Group, s: np.ndarray, inits: dict, base_dir: Path) -> bool:
    """Divide the producer's constant per-channel inputs by s (as new initializers)."""
    if producer.op_type == "Mul":
        indices = tuple(i for i, name in enumerate(producer.input) if _is_channel_vector(inits.get(name), len(s)))[:1]
    elif producer.op_type in CHANNEL_SCALING_INPUTS and producer.output[0] == group.activation:
        indices = tuple(i for i in CHANNEL_SCALING_INPUTS[producer.op_type] if i < len(producer.input) and producer.input[i])
        if not all(_is_channel_vector(inits.get(producer.input[i]), len(s)) for i in indices):
            return False
    else:
        return False
    if not indices:
        return False
    for i in indices:
        # A new name: exporters merge identical constants, so the original may feed other nodes.
        name = f"smoothquant.{group.key}.{producer.op_type}.{i}"
        add_initializer(model, name, (read_array(inits[producer.input[i]], base_dir) / s).astype(np.float32))
        producer.input[i] = name
    return True


def _is_channel_vector(init, n: int) -> bool:
    return init is not None and list(init.dims) == [n]


def _insert_mul(model, group: Group, s: np.ndarray, users: dict) -> None:
    import onnx

    scale = f"smoothquant.{group.key}.inv_scale"
    smoothed = f"{group.activation}.smoothed"
    add_initializer(model, scale, (1.0 / s).astype(np.float32))
    mul = onnx.helper.make_node("Mul", [group.activation, scale], [smoothed], name=f"smoothquant.{group.key}.mul")
    for node in users.get(group.activation, []):
        if node.op_type == "MatMul" and node.input[1] in group.weights:
            node.input[0] = smoothed
    # Insert right before the first consumer so the node list stays topologically sorted.
    position = min(i for i, n in enumerate(model.graph.node) if smoothed in n.input)
    model.graph.node.insert(position, mul)
