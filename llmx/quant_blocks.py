"""Block-quantized MatMul weights in ONNX Runtime's MatMulNBits layout, and the swap of a MatMul for one.

Shared by every writer of w8/w4 graphs: ``llmx calibrate`` (calibration/weight_only.py, through
ONNX Runtime's MatMulNBitsQuantizer), ``llmx export --precision`` (each weight quantized as it
streams past) and GGUF export (the file's own Q8_0/Q4_0/Q4_1 blocks). The rounding is ONNX
Runtime's own (``DefaultWeightOnlyQuantizer.qbits_block_quant``, the C++ kernels the quantizer
calls), and tensor names, shapes and node attributes are the ones the quantizer writes
(``<weight>_Q4``, ``<weight>_scales``, ``<weight>_zero_points``), so a weight quantized here
is byte for byte what ``calibrate --no-search`` stores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmx.artifact.sections import Precision
from llmx.errors import InputError

BITS = {"w8": 8, "w4": 4}
CPU_ACCURACY_LEVEL = 4  # MatMulNBits: compute in INT8 on CPU (genai's CPU default too)
UNSEARCHED_BLOCK_SIZE = 32  # no quality gate without calibrate's search: the known-safe size (genai's default too)
DEFAULT_ZERO_POINT = {8: 128, 4: 8}  # MatMulNBits' zero point when none is given


def check_block_size(block_size: int) -> None:
    # MatMulNBits kernels take power-of-two blocks of at least 16 input channels.
    if block_size < 16 or block_size & (block_size - 1):
        raise InputError(f"--block-size must be a power of two, at least 16; got {block_size}")


@dataclass
class Blocks:
    """One [K, N] weight in MatMulNBits layout; rows are output channels.

    ``offsets`` (a GGUF's asymmetric blocks, export/gguf_blocks.py ``split_offsets``): a float
    added to every value of a block, W[n, k] = (q - z) * s + offsets[n, k // block_size]; the
    graph adds it as ``blocksum(x) @ offsets.T`` beside MatMulNBits, whose kernels are slow or
    refuse float zero points.
    """

    bits: int
    packed: np.ndarray  # [N, K / block_size, block_size * bits / 8] uint8
    scales: np.ndarray  # [N, K / block_size] float32
    zero_points: np.ndarray | None = None  # uint8 packed or float32 per block; None: the kernel's default
    block_size: int = 32
    offsets: np.ndarray | None = None  # [N, K / block_size] float32
    # (units [N, K / block_size / group] float32, group): a K-quant's scales are an fp16 d per
    # super-block of ``group`` blocks times a small integer per block, stored as such
    # (llmx/compact_blocks.py). Only a hint: whatever changes the scales drops it.
    scale_units: tuple[np.ndarray, int] | None = None
    # [K] int64: the input channel each of the K positions of the blocks reads (GPTQ desc_act,
    # whose groups are scattered over the inputs: sorted by group, they are whole blocks); the
    # graph gathers x in this order first. None: in order.
    input_order: np.ndarray | None = None

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    def rows(self, order: np.ndarray) -> "Blocks":
        zp = None if self.zero_points is None else self.zero_points[order]
        offsets = None if self.offsets is None else self.offsets[order]
        units = None if self.scale_units is None else (self.scale_units[0][order], self.scale_units[1])
        return Blocks(self.bits, self.packed[order], self.scales[order], zp, self.block_size, offsets, units,
                      self.input_order)

    def float_zero_points(self) -> np.ndarray:
        if self.zero_points is not None:
            return self.zero_points
        return np.full(self.scales.shape, DEFAULT_ZERO_POINT[self.bits], dtype=np.float32)

    def scaled(self, scale) -> "Blocks":
        """The weight times a scalar: ``scale`` (a function of a float32 array) applied to the
        scales and offsets, the one float32 operation per block a float weight gets per value."""
        return dataclasses.replace(self, scales=scale(self.scales).astype(np.float32), scale_units=None,
                                   offsets=None if self.offsets is None else scale(self.offsets).astype(np.float32))

    def arrays(self, weight: str) -> list[tuple[str, np.ndarray]]:
        """(initializer name, values) of the tensors MatMulNBits reads, named as MatMulNBitsQuantizer
        names them, then the offsets ([K / block_size, N], the MatMul beside it), if any."""
        arrays = [(f"{weight}_Q{self.bits}", self.packed), (f"{weight}_scales", self.scales)]
        if self.zero_points is not None:
            arrays.append((f"{weight}_zero_points", self.zero_points))
        if self.offsets is not None:
            arrays.append((f"{weight}_offsets", np.ascontiguousarray(self.offsets.T)))
        if self.input_order is not None:
            arrays.append((f"{weight}_input_order", self.input_order.astype(np.int64)))
        return arrays

    def initializers(self, weight: str, k: int | None = None) -> "NBitsWeight":
        """The weight [K, N] ``weight`` as MatMulNBits reads it, its tensors inline."""
        from onnx import numpy_helper

        tensors = [numpy_helper.from_array(np.ascontiguousarray(a), name) for name, a in self.arrays(weight)]
        return NBitsWeight.of(self, k or self.packed.shape[1] * self.block_size, tensors)


@dataclass
class StackedBlocks:
    """Weights stacked along the output axis (q|k|v, gate|up) whose blocks differ in bits or block
    size (llama.cpp's Q4_K_M gives v more bits than q and k): one MatMulNBits each, outputs
    concatenated, so each keeps its own compact layout."""

    parts: list[Blocks]

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)


@dataclass
class NBitsWeight:
    """A quantized weight as the graph holds it: its layout and its initializers (values inline,
    or references into weights.bin, so a streamed export keeps none of them in memory)."""

    bits: int
    block_size: int
    k: int
    n: int
    tensors: list  # onnx.TensorProto: packed blocks, scales (, zero points)
    offsets: Any = None  # onnx.TensorProto [K / block_size, N]: Blocks.offsets, added beside MatMulNBits
    parts: list["NBitsWeight"] | None = None  # StackedBlocks: one MatMulNBits per part, concatenated
    input_order: Any = None  # onnx.TensorProto [K] int64: Blocks.input_order, x gathered by it first

    @classmethod
    def of(cls, blocks: Blocks, k: int, tensors: list) -> "NBitsWeight":
        """``tensors``: the stored ``blocks.arrays()``, in that order."""
        tensors = list(tensors)
        order = tensors.pop() if blocks.input_order is not None else None
        offsets = tensors.pop() if blocks.offsets is not None else None
        return cls(blocks.bits, blocks.block_size, k, blocks.n, tensors, offsets, input_order=order)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[N, blocks, block] integer codes -> MatMulNBits bytes (4 bits: element 2j low nibble, 2j+1 high)."""
    if bits == 8:
        return np.ascontiguousarray(codes.astype(np.uint8))
    codes = codes.astype(np.uint8, copy=False)  # the nibbles below are new arrays: no copy of the codes first
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def quantize_blocks(weight: np.ndarray, bits: int, block_size: int, symmetric: bool) -> Blocks:
    """Round-to-nearest blocks of ``weight`` ([K, N] float32) with ONNX Runtime's own kernels."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits)
    packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
        np.ascontiguousarray(weight, dtype=np.float32))
    return Blocks(bits, packed, scales, None if symmetric else zero_points, block_size)


def concat_rows(parts: list[Blocks]) -> Blocks:
    """Stack weights of one layout along the output axis (llmx's fused qkv and gate|up matmuls)."""
    if len(parts) == 1:
        return parts[0]
    orders = [p.input_order for p in parts]
    if any(o is not None for o in orders) and not all(o is not None and np.array_equal(o, orders[0]) for o in orders):
        raise ValueError("blocks reading their inputs in different orders cannot share one MatMulNBits")
    zps = offsets = None
    if any(p.zero_points is not None for p in parts):
        zps = np.concatenate([p.float_zero_points() for p in parts])
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    units = None
    if all(p.scale_units is not None for p in parts) and len({p.scale_units[1] for p in parts}) == 1:
        units = np.concatenate([p.scale_units[0] for p in parts]), parts[0].scale_units[1]
    return Blocks(parts[0].bits, np.concatenate([p.packed for p in parts]), np.concatenate([p.scales for p in parts]),
                  zps, parts[0].block_size, offsets, units, orders[0])


def replace_matmuls(model, weights: dict[str, NBitsWeight], accuracy_level: int) -> list[str]:
    """Swap each MatMul whose weight is in ``weights`` for MatMulNBits, as MatMulNBitsQuantizer does
    (same node name, inputs and attributes), plus the offsets' MatMul beside it and one node per
    part of stacked blocks; returns the weights swapped. Initializers no node reads any more are
    dropped."""
    import onnx

    inits = {i.name: i for i in model.graph.initializer}

    def add(tensor) -> str:
        if tensor.name not in inits:
            model.graph.initializer.append(tensor)
            inits[tensor.name] = tensor
        return tensor.name

    swapped, nodes = [], []
    for node in model.graph.node:
        name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        quantized = weights.get(name) if name in inits else None
        if quantized is None:
            nodes.append(node)
            continue
        if tuple(inits[name].dims) != (quantized.k, quantized.n):
            raise ValueError(f"{name}: graph weight is {'x'.join(map(str, inits[name].dims))}, "
                             f"its blocks are for {quantized.k}x{quantized.n}")
        nodes.extend(nbits_nodes(node.input[0], node.output[0], quantized, node.name or name, accuracy_level, add))
        swapped.append(name)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {i for node in model.graph.node for i in node.input}
    for init in [i for i in model.graph.initializer if i.name not in used]:
        model.graph.initializer.remove(init)
    if swapped and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return swapped


def nbits_nodes(x: str, y: str, w: NBitsWeight, name: str, accuracy_level: int, add) -> list:
    """The nodes computing ``y = x @ w``; ``add(tensor)`` registers an initializer and returns its name."""
    from onnx import helper

    if w.parts:
        outputs = [f"{y}_part{j}" for j in range(len(w.parts))]
        nodes = [n for j, (part, out) in enumerate(zip(w.parts, outputs))
                 for n in nbits_nodes(x, out, part, f"{name}_part{j}", accuracy_level, add)]
        return [*nodes, helper.make_node("Concat", outputs, [y], name=f"{name}_concat", axis=-1)]
    if w.input_order is not None:  # the blocks' order of the inputs (Blocks.input_order)
        ordered = f"{name}_x_ordered"
        nodes = [helper.make_node("Gather", [x, add(w.input_order)], [ordered], name=f"{name}_input_order", axis=-1)]
        return nodes + nbits_nodes(ordered, y, dataclasses.replace(w, input_order=None), name, accuracy_level, add)
    attrs = dict(K=w.k, N=w.n, bits=w.bits, block_size=w.block_size)
    if accuracy_level:  # the quantizer leaves the optional attribute out at 0
        attrs["accuracy_level"] = accuracy_level
    main = y if w.offsets is None else f"{y}_blocks"
    nodes = [helper.make_node("MatMulNBits", [x, *(add(t) for t in w.tensors)], [main],
                              name=f"{name}_Q{w.bits}", domain="com.microsoft", **attrs)]
    if w.offsets is not None:
        more, consts = offset_nodes(x, main, y, add(w.offsets), w.k, w.block_size, f"{name}_offsets")
        for const in consts:
            add(const)
        nodes.extend(more)
    return nodes


def offset_nodes(x: str, y_main: str, y: str, offsets: str, k: int, block_size: int, prefix: str):
    """(nodes, initializers) computing ``y = y_main + blocksum(x) @ offsets``, the term of
    ``Blocks.offsets`` MatMulNBits leaves out; ``offsets`` names a [K / block_size, N] float32
    initializer; x has any rank."""
    from onnx import helper, numpy_helper

    shape = numpy_helper.from_array(np.array([-1, k // block_size, block_size], np.int64), f"{prefix}_block_shape")
    axes = numpy_helper.from_array(np.array([2], np.int64), f"{prefix}_block_axis")
    nodes = [
        helper.make_node("Reshape", [x, shape.name], [f"{prefix}_x_blocks"], name=f"{prefix}_reshape"),
        helper.make_node("ReduceSum", [f"{prefix}_x_blocks", axes.name], [f"{prefix}_x_sums"], keepdims=0,
                         name=f"{prefix}_blocksum"),
        helper.make_node("MatMul", [f"{prefix}_x_sums", offsets], [f"{prefix}_offset_flat"], name=f"{prefix}_matmul"),
        helper.make_node("Shape", [y_main], [f"{prefix}_y_shape"], name=f"{prefix}_shape"),
        helper.make_node("Reshape", [f"{prefix}_offset_flat", f"{prefix}_y_shape"], [f"{prefix}_offset"],
                         name=f"{prefix}_reshape_back"),
        helper.make_node("Add", [y_main, f"{prefix}_offset"], [y], name=f"{prefix}_add"),
    ]
    return nodes, [shape, axes]


def weight_only_precision(scheme: str, block_size: int, symmetric: bool, awq: bool = False,
                          fallback: list[str] | tuple[str, ...] = (), smoothquant: float | None = None):
    """The manifest's ``precision`` section of a w8/w4 (MatMulNBits) artifact."""
    return Precision(weights="int8" if scheme == "w8" else "int4", activations="float32", scheme=scheme,
                     block_size=block_size, symmetric=symmetric, awq=awq, fallback=list(fallback),
                     smoothquant=smoothquant)


def stored_precision(quantized: dict[str, NBitsWeight]) -> Precision:
    """The precision section of fused graphs holding a source's own blocks (a GGUF's, a GPTQ
    checkpoint's: ``StreamedWeights.quantized``): w4 if any block is 4-bit, the commonest block size."""
    from collections import Counter

    weights = [part for w in quantized.values() for part in (w.parts or [w])]
    bits = {w.bits for w in weights}
    sizes = Counter(w.block_size for w in weights)
    symmetric = all(len(w.tensors) == 2 and w.offsets is None for w in weights)  # no zero points, no offsets
    return Precision(weights="int4" if 4 in bits else "int8", scheme="w4" if 4 in bits else "w8",
                     block_size=sizes.most_common(1)[0][0], symmetric=symmetric, accuracy_level=CPU_ACCURACY_LEVEL)
