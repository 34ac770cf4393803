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

from dataclasses import dataclass

import numpy as np

from llmx.artifact.sections import Precision
from llmx.errors import InputError

BITS = {"w8": 8, "w4": 4}
CPU_ACCURACY_LEVEL = 4  # MatMulNBits: compute in INT8 on CPU (genai's CPU default too)
UNSEARCHED_BLOCK_SIZE = 32  # no quality gate without calibrate's search: the known-safe size (genai's default too)
_DEFAULT_ZERO_POINT = {8: 128.0, 4: 8.0}


def check_block_size(block_size: int) -> None:
    # MatMulNBits kernels take power-of-two blocks of at least 16 input channels.
    if block_size < 16 or block_size & (block_size - 1):
        raise InputError(f"--block-size must be a power of two, at least 16; got {block_size}")


@dataclass
class Blocks:
    """One [K, N] weight in MatMulNBits layout; rows are output channels."""

    bits: int
    packed: np.ndarray  # [N, K / block_size, block_size * bits / 8] uint8
    scales: np.ndarray  # [N, K / block_size] float32
    zero_points: np.ndarray | None = None  # uint8 packed or float32 per block; None: the kernel's default
    block_size: int = 32

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    def rows(self, order: np.ndarray) -> "Blocks":
        zp = None if self.zero_points is None else self.zero_points[order]
        return Blocks(self.bits, self.packed[order], self.scales[order], zp, self.block_size)

    def float_zero_points(self) -> np.ndarray:
        if self.zero_points is not None:
            return self.zero_points
        return np.full(self.scales.shape, _DEFAULT_ZERO_POINT[self.bits], dtype=np.float32)

    def arrays(self, weight: str) -> list[tuple[str, np.ndarray]]:
        """(initializer name, values) of the tensors MatMulNBits reads, named as MatMulNBitsQuantizer names them."""
        arrays = [(f"{weight}_Q{self.bits}", self.packed), (f"{weight}_scales", self.scales)]
        if self.zero_points is not None:
            arrays.append((f"{weight}_zero_points", self.zero_points))
        return arrays

    def initializers(self, weight: str, k: int | None = None) -> "NBitsWeight":
        """The weight [K, N] ``weight`` as MatMulNBits reads it, its tensors inline."""
        from onnx import numpy_helper

        tensors = [numpy_helper.from_array(np.ascontiguousarray(a), name) for name, a in self.arrays(weight)]
        return NBitsWeight(self.bits, self.block_size, k or self.packed.shape[1] * self.block_size, self.n, tensors)


@dataclass
class NBitsWeight:
    """A quantized weight as the graph holds it: its layout and its initializers (values inline,
    or references into weights.bin, so a streamed export keeps none of them in memory)."""

    bits: int
    block_size: int
    k: int
    n: int
    tensors: list  # onnx.TensorProto: packed blocks, scales (, zero points)


def quantize_blocks(weight: np.ndarray, bits: int, block_size: int, symmetric: bool) -> Blocks:
    """Round-to-nearest blocks of ``weight`` ([K, N] float32) with ONNX Runtime's own kernels."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits)
    packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
        np.ascontiguousarray(weight, dtype=np.float32))
    return Blocks(bits, packed, scales, None if symmetric else zero_points, block_size)


def concat_rows(parts: list[Blocks]) -> Blocks:
    """Stack weights along the output axis (llmx's fused qkv and gate|up matmuls)."""
    if len(parts) == 1:
        return parts[0]
    zps = None
    if any(p.zero_points is not None for p in parts):
        zps = np.concatenate([p.float_zero_points() for p in parts])
    return Blocks(parts[0].bits, np.concatenate([p.packed for p in parts]), np.concatenate([p.scales for p in parts]),
                  zps, parts[0].block_size)


def replace_matmuls(model, weights: dict[str, NBitsWeight], accuracy_level: int) -> list[str]:
    """Swap each MatMul whose weight is in ``weights`` for MatMulNBits, as MatMulNBitsQuantizer does
    (same node name, inputs and attributes); returns the weights swapped. Initializers no node
    reads any more are dropped."""
    import onnx
    from onnx import helper

    inits = {i.name: i for i in model.graph.initializer}
    swapped = []
    for index, node in enumerate(model.graph.node):
        name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        quantized = weights.get(name) if name in inits else None
        if quantized is None:
            continue
        if tuple(inits[name].dims) != (quantized.k, quantized.n):
            raise ValueError(f"{name}: graph weight is {'x'.join(map(str, inits[name].dims))}, "
                             f"its blocks are for {quantized.k}x{quantized.n}")
        for tensor in quantized.tensors:
            if tensor.name not in inits:
                model.graph.initializer.append(tensor)
                inits[tensor.name] = tensor
        attrs = dict(K=quantized.k, N=quantized.n, bits=quantized.bits, block_size=quantized.block_size)
        if accuracy_level:  # the quantizer leaves the optional attribute out at 0
            attrs["accuracy_level"] = accuracy_level
        new = helper.make_node("MatMulNBits", [node.input[0], *(t.name for t in quantized.tensors)], list(node.output),
                               name=f"{node.name or name}_Q{quantized.bits}", domain="com.microsoft", **attrs)
        model.graph.node[index].CopyFrom(new)
        swapped.append(name)
    used = {i for node in model.graph.node for i in node.input}
    for init in [i for i in model.graph.initializer if i.name not in used]:
        model.graph.initializer.remove(init)
    if swapped and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return swapped


def weight_only_precision(scheme: str, block_size: int, symmetric: bool, awq: bool = False,
                          fallback: list[str] | tuple[str, ...] = ()):
    """The manifest's ``precision`` section of a w8/w4 (MatMulNBits) artifact."""
    return Precision(weights="int8" if scheme == "w8" else "int4", activations="float32", scheme=scheme,
                     block_size=block_size, symmetric=symmetric, awq=awq, fallback=list(fallback))
