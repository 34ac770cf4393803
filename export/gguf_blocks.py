"""GGUF's Q8_0, Q4_0 and Q4_1 blocks as ONNX Runtime MatMulNBits weights, without requantizing.

All three store 32 consecutive input channels of one output row per block, the layout
MatMulNBits reads with ``block_size`` 32, so only the bytes are rearranged:

- Q8_0: x = d * q, q int8. MatMulNBits 8-bit stores uint8 with default zero point 128: q + 128.
- Q4_0: x = d * (q - 8), q in 0..15. MatMulNBits 4-bit's default zero point is 8; ggml packs
  elements j and j + 16 into byte j, MatMulNBits elements 2j and 2j + 1.
- Q4_1: x = d * q + m. MatMulNBits with float zero points computes (q - z) * d: z = -m / d
  (the one place a rounding happens, at the float32 ulp of m).

Scales are GGUF's fp16 values widened to float32, exactly. The names follow ``calibrate``'s
(``<weight>_Q4``, ``<weight>_scales``, ``<weight>_zero_points``) so prefill and decode share
each tensor in weights.bin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
_DEFAULT_ZERO_POINT = {8: 128.0, 4: 8.0}


@dataclass
class Blocks:
    """One [in, out] weight in MatMulNBits layout; rows are output channels."""

    bits: int
    packed: np.ndarray  # [N, K / 32, 32 * bits / 8] uint8
    scales: np.ndarray  # [N, K / 32] float32
    zero_points: np.ndarray | None = None  # [N, K / 32] float32; None: the kernel's default

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * BLOCK

    def rows(self, order: np.ndarray) -> "Blocks":
        zp = None if self.zero_points is None else self.zero_points[order]
        return Blocks(self.bits, self.packed[order], self.scales[order], zp)

    def float_zero_points(self) -> np.ndarray:
        if self.zero_points is not None:
            return self.zero_points
        return np.full(self.scales.shape, _DEFAULT_ZERO_POINT[self.bits], dtype=np.float32)


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def _ggml_nibbles(qs: np.ndarray) -> np.ndarray:
    # ggml: byte j holds element j (low nibble) and element j + 16 (high nibble).
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _half(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def from_gguf(data: np.ndarray, qtype: str) -> Blocks:
    """``data``: a GGUF tensor's bytes, [rows, bytes per row] uint8."""
    rows = data.shape[0]
    if qtype == "Q8_0":
        raw = data.reshape(rows, -1, 2 + BLOCK)
        q = raw[..., 2:].view(np.int8).astype(np.int16) + 128
        return Blocks(8, q.astype(np.uint8), _half(raw[..., :2]))
    if qtype == "Q4_0":
        raw = data.reshape(rows, -1, 2 + BLOCK // 2)
        return Blocks(4, _pack_nibbles(_ggml_nibbles(raw[..., 2:])), _half(raw[..., :2]))
    if qtype == "Q4_1":
        raw = data.reshape(rows, -1, 4 + BLOCK // 2)
        d, m = _half(raw[..., :2]), _half(raw[..., 2:4])
        # A constant block has d = 0 and every q = 0: scale 1 and z = -m give m exactly.
        safe = np.where(d == 0, np.float32(1), d)
        return Blocks(4, _pack_nibbles(_ggml_nibbles(raw[..., 4:])), safe, (-m / safe).astype(np.float32))
    raise ValueError(f"no MatMulNBits layout for {qtype}")


def concat_rows(parts: list[Blocks]) -> Blocks:
    """Stack weights along the output axis (llmx's fused qkv and gate|up matmuls)."""
    if len(parts) == 1:
        return parts[0]
    zps = None
    if any(p.zero_points is not None for p in parts):
        zps = np.concatenate([p.float_zero_points() for p in parts])
    return Blocks(parts[0].bits, np.concatenate([p.packed for p in parts]), np.concatenate([p.scales for p in parts]), zps)


def replace_matmuls(model, weights: dict[str, Blocks], accuracy_level: int) -> list[str]:
    """Swap each MatMul whose weight is in ``weights`` for MatMulNBits; returns the weights swapped."""
    import onnx
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    swapped = []
    for index, node in enumerate(model.graph.node):
        name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        blocks = weights.get(name) if name in inits else None
        if blocks is None:
            continue
        k, n = inits[name].dims
        if (k, n) != (blocks.k, blocks.n):
            raise ValueError(f"{name}: graph weight is {k}x{n}, GGUF blocks give {blocks.k}x{blocks.n}")
        stored = [(f"{name}_Q{blocks.bits}", blocks.packed), (f"{name}_scales", blocks.scales.reshape(-1))]
        if blocks.zero_points is not None:
            stored.append((f"{name}_zero_points", blocks.zero_points.reshape(-1)))
        for tensor_name, array in stored:
            if tensor_name not in inits:
                inits[tensor_name] = numpy_helper.from_array(np.ascontiguousarray(array), tensor_name)
                model.graph.initializer.append(inits[tensor_name])
        new = helper.make_node("MatMulNBits", [node.input[0], *(t for t, _ in stored)], list(node.output),
                               name=f"{node.name or name}_Q{blocks.bits}", domain="com.microsoft",
                               K=k, N=n, bits=blocks.bits, block_size=BLOCK, accuracy_level=accuracy_level)
        model.graph.node[index].CopyFrom(new)
        swapped.append(name)
    used = {i for node in model.graph.node for i in node.input}
    for init in [i for i in model.graph.initializer if i.name not in used]:
        model.graph.initializer.remove(init)
    if swapped and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return swapped
