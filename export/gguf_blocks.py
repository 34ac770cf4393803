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

import numpy as np

from llmx.quant_blocks import Blocks

BLOCK = 32
BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}


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
