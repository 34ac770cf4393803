"""GGUF's quantized blocks as ONNX Runtime MatMulNBits weights, without a second rounding.

What ONNX Runtime 1.31.1's CPU MatMulNBits does (benchmarks/gguf_kernels.py; x[1, 2048] @
W[2048, 8192], 2 threads, "cold" = weights read from memory, as a model's are; fp32 MatMul 6.8 ms):

- 4 or 8 bits, block 16 or 32, no zero-point input (the default 2^(bits-1)) or packed uint8 zero
  points: exact at accuracy_level 0 (float32 rounding), at level 4 (llmx's CPU level: int8
  activations) the same ~5e-3 relative error as Q4_0's layout, positive and negative scales alike.
  Cold at level 4: 4-bit/32 2.3 ms, 8-bit/32 2.7, 8-bit/16 3.6, 4-bit/16 4.0; uint8 zero points
  cost +0.3 ms. (Level 0 is 8 ms at 4 bits and ~150-200 ms at 8 bits.)
- float32 zero points: exact, but only through the "unpacked" path, which dequantizes the whole
  weight on every call and multiplies in float32 (~90-110 ms hot, level 4 or 0); at 8 bits they
  are refused when run ("Only 2b and 4b quantization is supported for unpacked compute").
- 2 bits: exact, but always the unpacked path (70-200 ms).

So every type maps onto 4 or 8 bits, block 16 or 32, integer codes. ``from_gguf`` gives the
file's exact values as (q - z) * scale (bpw: bits per weight as MatMulNBits reads them, float32
scales and offsets included, against the file's; the artifact stores codes, fp16 scales and
K-quant scales in fewer bits and rebuilds them at load, llmx/compact_blocks.py):

=========  ========================  ==================================================  ====  ====
type       MatMulNBits               codes / scale / zero point                          bpw   file
=========  ========================  ==================================================  ====  ====
Q8_0       8-bit, block 32           q + 128, d, default zero point                         9   8.5
Q4_0       4-bit, block 32           q (0..15), d, default (ggml: byte j = j, j + 16)       5   4.5
Q5_0       8-bit, block 32           q + 112 (x = d (q - 16)), d, default                   9   5.5
Q3_K       4-bit, block 16           q + 8 (q -4..3), d (sc - 32) (6-bit sc), default       6   3.4
Q6_K       8-bit, block 16           q + 96 (x = d sc (q - 32)), d sc (int8 sc), default   10   6.6
Q8_K       8-bit, block 32           q + 128, the float32 d (llama.cpp never writes it:     9   9.1
                                     activations only; mapped anyway)
Q1_0       4-bit, block 32           8 +- 1, d                                              5   1.1
Q4_1       4-bit, block 32, float z  q, d, z = -m / d (x = d q + m)                        6*   5.0
Q5_1       8-bit, block 32, float z  q (0..31), d, z = -m / d                             10*   6.0
Q4_K       4-bit, block 32, float z  q, d sc, z = dmin m / (d sc) (x = d sc q - dmin m)    6*   4.5
Q5_K       8-bit, block 32, float z  q (0..31), d sc, z = dmin m / (d sc)                 10*   5.5
Q2_K       4-bit, block 16, float z  q (0..3), d sc, z = dmin m / (d sc) (4-bit sc, m)     8*   2.6
IQ4_NL     8-bit, block 32           kvalue + 128 (-127..113), d                            9   4.5
IQ4_XS     8-bit, block 32           kvalue + 128, d (ls - 32)                              9   4.25
IQ3_XXS    8-bit, block 32           +-grid (4..62) + 128, d (1/2 + ls) / 2                 9   3.1
IQ3_S      8-bit, block 32           +-grid (1..15) + 128, d (1 + 2 ls)                     9   3.4
IQ2_XXS    8-bit, block 32           +-grid (8, 25, 43) + 128, d (1/2 + ls) / 4             9   2.1
IQ2_XS/S   8-bit, block 16           +-grid + 128, d (1/2 + ls) / 4                        10   2.3/2.6
IQ1_S      8-bit, block 32           8 (grid +- 1/8) + 128 (-9..9), d (2 ls + 1) / 8        9   1.6
IQ1_M      8-bit, block 16           the same, its scattered fp16 d                        10   1.75
MXFP4      8-bit, block 32           2 e2m1 + 128 (-12..12), 2^(e - 128)                    9   4.25
NVFP4      8-bit, block 16           2 e2m1 + 128, e4m3 / 2                                10   4.5
TQ1_0/2_0  4-bit, block 32           8 + (-1, 0, 1), d                                      5   1.7/2.1
=========  ========================  ==================================================  ====  ====

(* with ``split_offsets``'s offsets, as they should run.) Scales are exact in float32 (fp16 x
an integer of at most 8 bits, or a power of two). For the codebook types (IQ*, MXFP4, NVFP4, TQ*)
the codes are the gguf package's dequantized values divided by the block's unit (``_units``),
checked to be integers that give back exactly those values, else refused. The float zero
point is the one rounding, at its float32 ulp: the weight is off by at most ulp(z) / 2 x scale,
the order of the float32 rounding llama.cpp's own dequantization makes. A block whose scale is 0
has every value equal to -dmin m (or m): codes 0, scale 1, z = that value's negation.

The asymmetric types (float zero points) are exact in one MatMulNBits but slow (4 bits) or refused
(8 bits: Q5_1, Q5_K). ``split_offsets`` re-expresses them fast and still exact: integer codes
with the default zero point, recentred per block by t = round(z), plus a per-block offset
c = (t - z) * scale (one float32 rounding) that the graph adds as ``blocksum(x) @ offsets.T``
(``llmx.quant_blocks.offset_nodes``: Reshape, ReduceSum, a [K / block, N] float32 MatMul, Add; 1 bit per weight at
block 32, 2 at block 16). Cold at level 4: 4-bit/32 2.7 ms (vs 2.3 without offsets), 8-bit/32 3.2,
4-bit/16 4.0, and, the offsets being float, a smaller level-4 error than the plain layouts':

    x @ W.T = MatMulNBits(x; codes, scales) + sum over blocks b of (sum of x over b) * c[:, b]

2 bits (Q2_K's natural width) and float zero points were ruled out by speed, not exactness; the
codebook types' 8 bits by their codes' range (none is affine in 4 bits but TQ*'s). Where size
matters more than exactness (IQ2/IQ1 at 8 bits are 4-6x their file), ``requantized`` rounds the
file's dequantized values again to symmetric 4-bit blocks of 32 and reports the error.

A fused matmul (q|k|v, gate|up) needs one bits and block size: ``widen`` re-expresses blocks at
more bits and/or a smaller block exactly (codes shifted or kept, scales and zero points
repeated), ``fuse`` widens every part to the widest layout and stacks them.

Tensor names follow ``calibrate``'s (``<weight>_Q4``, ``<weight>_scales``, ``<weight>_zero_points``)
so prefill and decode share each tensor in weights.bin.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmx.quant_blocks import DEFAULT_ZERO_POINT, Blocks, concat_rows, pack_codes, quantize_blocks

QK = 256  # a K-quant super-block
BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q5_1": 8,
        "Q2_K": 4, "Q3_K": 4, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8, "Q8_K": 8, "Q1_0": 4,
        # codes = the file's values / the block's scale (see _units):
        "IQ4_NL": 8, "IQ4_XS": 8, "IQ3_S": 8, "IQ3_XXS": 8, "IQ2_S": 8, "IQ2_XS": 8, "IQ2_XXS": 8,
        "IQ1_M": 8, "IQ1_S": 8, "MXFP4": 8, "NVFP4": 8, "TQ2_0": 4, "TQ1_0": 4}
BLOCK_SIZE = {t: 16 if t in ("Q2_K", "Q3_K", "Q6_K", "IQ2_S", "IQ2_XS", "IQ1_M", "NVFP4") else 32 for t in BITS}
EXACT: frozenset[str] = frozenset(BITS)
ASYMMETRIC: frozenset[str] = frozenset({"Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"})  # float zero points
REQUANTIZED_BITS, REQUANTIZED_BLOCK_SIZE = 4, 32  # ``requantized``'s layout


# ---- reading GGUF blocks ---------------------------------------------------------------------

def _half(raw: np.ndarray) -> np.ndarray:
    """fp16 fields [..., 2] uint8 -> float32 [...] (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _ggml_nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-wide nibble blocks: byte j holds element j (low nibble) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(raw: np.ndarray, count: int) -> np.ndarray:
    """Bit i of little-endian bytes ``raw`` [..., count / 8], as [..., count] uint8 0/1."""
    return np.unpackbits(np.ascontiguousarray(raw), axis=-1, count=count, bitorder="little")


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _codes(data: np.ndarray, qtype: str):
    """(codes [rows, blocks, block] int16, scales [rows, blocks] float32, offsets or None):
    the file's values are scales * codes - offsets (offsets [rows, blocks] float32, exact).
    The K-quants' scales are d [rows, supers] times an integer per block: ``_units_of`` reads d."""
    rows = data.shape[0]

    def split(size: int, *widths: int) -> list[np.ndarray]:
        raw = data.reshape(rows, -1, size)
        assert sum(widths) == size, (qtype, widths, size)
        return np.split(raw, np.cumsum(widths)[:-1], axis=-1)

    if qtype == "Q8_0":
        d, qs = split(34, 2, 32)
        return qs.view(np.int8).astype(np.int16), _half(d), None
    if qtype == "Q4_0":
        d, qs = split(18, 2, 16)
        return _ggml_nibbles(qs).astype(np.int16) - 8, _half(d), None
    if qtype == "Q4_1":
        d, m, qs = split(20, 2, 2, 16)
        return _ggml_nibbles(qs).astype(np.int16), _half(d), -_half(m)
    if qtype in ("Q5_0", "Q5_1"):
        head = 2 if qtype == "Q5_0" else 4
        parts = split(head + 20, *([2] * (head // 2)), 4, 16)
        q = _ggml_nibbles(parts[-1]).astype(np.int16) | (_bits(parts[-2], 32).astype(np.int16) << 4)
        if qtype == "Q5_0":
            return q - 16, _half(parts[0]), None
        return q, _half(parts[0]), -_half(parts[1])
    if qtype == "Q8_K":
        d, qs, _ = split(292, 4, 256, 32)
        d = np.ascontiguousarray(d).view(np.float32)  # [rows, supers, 1]
        return (qs.view(np.int8).astype(np.int16).reshape(rows, -1, 32),
                np.repeat(d[..., 0], QK // 32, axis=1), None)
    if qtype == "Q1_0":  # 128 values: bit set d, clear -d
        d, qs = split(18, 2, 16)
        q = _bits(qs, 128).astype(np.int16) * 2 - 1
        return q.reshape(rows, -1, 32), np.repeat(_half(d), 4, axis=1), None
    if qtype in _UNIT_TYPES:
        return _divided(data, qtype)
    if qtype == "Q2_K":
        scales, qs, d, dmin = split(84, 16, 64, 2, 2)
        # 2 halves of 128: byte l of half h holds elements h*128 + s*32 + l at bits 2s (s = 0..3).
        q = (qs.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = q.reshape(rows, -1, 16).astype(np.int16)  # [rows, supers * 16, 16]
        sc, mn = (scales & 0x0F).astype(np.float32), (scales >> 4).astype(np.float32)
        return (q, (_half(d)[..., None] * sc).reshape(rows, -1), (_half(dmin)[..., None] * mn).reshape(rows, -1))
    if qtype == "Q3_K":
        hmask, qs, scales, d = split(110, 32, 64, 12, 2)
        low, high = scales[..., :8], scales[..., 8:]
        sc = ((low[..., None, :] >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(rows, -1, 16)
        sh = ((high[..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03).reshape(rows, -1, 16)
        sc = (sc | (sh << 4)).astype(np.float32) - 32
        ql = (qs.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        qh = (hmask.reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        q = ql.reshape(rows, -1, 16).astype(np.int16) - 4 * (1 - qh.reshape(rows, -1, 16).astype(np.int16))
        return q, (_half(d)[..., None] * sc).reshape(rows, -1), None
    if qtype in ("Q4_K", "Q5_K"):
        size, high = (144, 0) if qtype == "Q4_K" else (176, 32)
        d, dmin, scales, *rest = split(size, 2, 2, 12, *([high] if high else []), 128)
        q = (rest[-1].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F
        q = q.reshape(rows, -1, 32).astype(np.int16)  # sub-block 2i: low nibbles of bytes 32i.., 2i+1: high
        if high:
            qh = (rest[0].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q |= qh.reshape(rows, -1, 32).astype(np.int16) << 4
        sc, mn = _k_scale_min(scales)
        return (q, (_half(d)[..., None] * sc.astype(np.float32)).reshape(rows, -1),
                (_half(dmin)[..., None] * mn.astype(np.float32)).reshape(rows, -1))
    if qtype == "Q6_K":
        ql, qh, scales, d = split(210, 128, 64, 16, 2)
        lo = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # [.., half, 2, 64]
        hi = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # [.., half, 4, 32]
        q = lo.reshape(rows, -1, 2, 4, 32).astype(np.int16) | (hi.astype(np.int16) << 4)
        sc = scales.view(np.int8).astype(np.float32)
        return q.reshape(rows, -1, 16) - 32, (_half(d)[..., None] * sc).reshape(rows, -1), None
    raise ValueError(f"no exact MatMulNBits layout for GGUF type {qtype}")


_D_AT = {"Q2_K": (84, 80), "Q3_K": (110, 108), "Q4_K": (144, 0), "Q5_K": (176, 0), "Q6_K": (210, 208)}


def _units_of(data: np.ndarray, qtype: str) -> tuple[np.ndarray, int] | None:
    """A K-quant's super-block d [rows, supers] float32 and how many blocks share it: its scales
    are d times a 4-8 bit integer per block (``Blocks.scale_units``)."""
    if qtype not in _D_AT:
        return None
    size, at = _D_AT[qtype]
    raw = data.reshape(data.shape[0], -1, size)[..., at:at + 2]
    return _half(raw), QK // BLOCK_SIZE[qtype]


def _units(b: np.ndarray, qtype: str) -> np.ndarray:
    """Per-block scales [blocks, sub-blocks] float32 of GGUF blocks ``b`` [blocks, type size] of the
    codebook types: each value is unit x a small integer (as the gguf package dequantizes them)."""
    quants = _quants()
    MXFP4, NVFP4 = quants.MXFP4, quants.NVFP4  # noqa: N806

    def half(raw):
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)  # [B, n]

    def nibbles(raw):
        return np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(len(raw), -1).astype(np.float32)

    if qtype == "IQ4_NL":
        return half(b[:, :2])
    if qtype == "IQ4_XS":
        high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))
        return half(b[:, :2]) * (nibbles(b[:, 4:8]) + 16 * (high & 3).astype(np.float32) - 32)
    if qtype in ("TQ1_0", "TQ2_0"):
        return half(b[:, -2:])
    if qtype == "MXFP4":
        return MXFP4.e8m0_to_fp32_half(b[:, :1]).astype(np.float32)
    if qtype == "NVFP4":
        return NVFP4.ue4m3_to_fp32(b[:, :4]).astype(np.float32)
    if qtype in ("IQ2_XXS", "IQ3_XXS"):  # 4 bits atop each sub-block's second uint32 / its uint32
        tail = b[:, 2:].copy().view(np.uint32).reshape(len(b), 8, -1)[..., -1] if qtype == "IQ2_XXS" \
            else b[:, 66:98].copy().view(np.uint32)
        step = np.float32(0.25 if qtype == "IQ2_XXS" else 0.5)
        return half(b[:, :2]) * (np.float32(0.5) + (tail >> 28).astype(np.float32)) * step
    if qtype in ("IQ2_XS", "IQ2_S"):
        return half(b[:, :2]) * (np.float32(0.5) + nibbles(b[:, -8:])) * np.float32(0.25)
    if qtype == "IQ3_S":
        return half(b[:, :2]) * (1 + 2 * nibbles(b[:, -4:]))
    if qtype == "IQ1_S":  # values d (2 s + 1) (grid +- 1/8): codes 8 (grid +- 1/8)
        qh = np.ascontiguousarray(b[:, 34:50]).view(np.uint16)
        return half(b[:, :2]) * (2 * ((qh >> 12) & 7).astype(np.float32) + 1) / 8
    if qtype == "IQ1_M":  # the fp16 d is spread over the top nibbles of 4 uint16
        sc = np.ascontiguousarray(b[:, 48:56]).view(np.uint16)
        d = (sc & 0xF000) >> np.array([12, 8, 4, 0], np.uint16)
        d = (d[:, 0] | d[:, 1] | d[:, 2] | d[:, 3]).view(np.float16).astype(np.float32)[:, None]
        s = ((sc[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(len(b), -1)
        return d * (2 * s.astype(np.float32) + 1) / 8
    raise ValueError(qtype)


_UNIT_TYPES = frozenset({"IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS",
                         "IQ1_M", "IQ1_S", "MXFP4", "NVFP4", "TQ2_0", "TQ1_0"})


def _divided(data: np.ndarray, qtype: str):
    """Codes = the gguf package's values / the block's unit; refused unless that is exact."""
    quants = _quants()
    kind = quants.GGMLQuantizationType[qtype]
    rows = data.shape[0]
    type_size = quants.GGML_QUANT_SIZES[kind][1]
    units = _units(data.reshape(-1, type_size), qtype).reshape(rows, -1)
    values = quants.dequantize(data, kind).astype(np.float32)
    block = BLOCK_SIZE[qtype]
    units = np.repeat(units, max(1, values.shape[1] // units.shape[1] // block), axis=1)
    values = values.reshape(rows, units.shape[1], -1)
    safe = np.where(units == 0, np.float32(1), units)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        codes = np.where(units[..., None] == 0, np.float32(0), values / safe)
    top = (1 << (BITS[qtype] - 1))
    if not (np.all(np.abs(codes) < top) and np.array_equal(np.round(codes) * units[..., None], values)):
        raise ValueError(f"{qtype}: these blocks are not integer multiples of their scales")
    return codes.astype(np.int16), units.astype(np.float32), None


def from_gguf(data: np.ndarray, qtype: str) -> Blocks:
    """``data``: a GGUF tensor's bytes, [rows, bytes per row] uint8 (``GGUFReader``'s ``.data``;
    leading axes, e.g. experts, are folded into rows). The blocks compute exactly the file's values;
    for the types in ``ASYMMETRIC`` they carry float zero points (see ``split_offsets``)."""
    if qtype not in BITS:
        raise ValueError(f"no exact MatMulNBits layout for GGUF type {qtype}")
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, data.shape[-1])
    q, scales, offsets = _codes(data, qtype)
    units = _units_of(data, qtype)
    bits, block = BITS[qtype], BLOCK_SIZE[qtype]
    q = q.reshape(data.shape[0], -1, block)
    if offsets is None:
        return Blocks(bits, pack_codes(q + DEFAULT_ZERO_POINT[bits], bits), scales.astype(np.float32), None, block,
                      scale_units=units)
    # values = scales * q - offsets = (q - offsets / scales) * scales
    dead = scales == 0  # every value is -offset: codes 0, any scale, z = offset
    q = np.where(dead[..., None], 0, q)
    if units is None:
        fill = np.float32(1)
    else:  # the super-block's d (1 where d is 0): the scale stays d times an integer (1)
        units = np.where(units[0] == 0, np.float32(1), units[0]), units[1]
        fill = np.repeat(units[0], units[1], axis=1)
    scales = np.where(dead, fill, scales).astype(np.float32)
    return Blocks(bits, pack_codes(q, bits), scales, (offsets / scales).astype(np.float32), block, scale_units=units)


# ---- the MatMulNBits layout ------------------------------------------------------------------

def unpack(blocks: Blocks) -> np.ndarray:
    """The codes of ``blocks``, [N, K / block_size, block_size] int16."""
    if blocks.bits == 8:
        return blocks.packed.astype(np.int16)
    if blocks.bits != 4:
        raise ValueError(f"{blocks.bits}-bit blocks are not handled here")
    p = blocks.packed.astype(np.int16)
    return np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)


def zero_points(blocks: Blocks) -> np.ndarray:
    """Per-block zero points [N, K / block_size]: int16 for none (the default) or uint8, float32 for float."""
    n, nb = blocks.scales.shape
    zp = blocks.zero_points
    if zp is None:
        return np.full((n, nb), DEFAULT_ZERO_POINT[blocks.bits], np.int16)
    if zp.dtype != np.uint8:
        return zp.astype(np.float32)
    if blocks.bits == 8:
        return zp.astype(np.int16)
    z = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)  # packed like the codes, two per byte
    return z[:, :nb].astype(np.int16)


def dequantize(blocks: Blocks) -> np.ndarray:
    """(codes - zero points) * scales in float64, [N, K]."""
    q, zp = unpack(blocks).astype(np.float64), zero_points(blocks).astype(np.float64)
    return ((q - zp[..., None]) * blocks.scales.astype(np.float64)[..., None]).reshape(blocks.n, -1)


def widen(blocks: Blocks, bits: int, block_size: int) -> Blocks:
    """The same weight at ``bits`` >= its bits and ``block_size`` dividing its block size, exactly:
    4 -> 8 bits keeps each code's distance to its zero point (no zero points: code + 120; float ones
    are kept as they are, the codes too); a smaller block repeats scales and zero points. Integer
    (uint8) zero points are folded into the codes, leaving the default one."""
    if bits < blocks.bits or bits not in DEFAULT_ZERO_POINT:
        raise ValueError(f"cannot re-express {blocks.bits}-bit blocks exactly at {bits} bits")
    if block_size > blocks.block_size or blocks.block_size % block_size:
        raise ValueError(f"cannot re-express blocks of {blocks.block_size} exactly as blocks of {block_size}")
    if bits == blocks.bits and block_size == blocks.block_size and (
            blocks.zero_points is None or blocks.zero_points.dtype != np.uint8):
        return blocks
    q, zp = unpack(blocks), zero_points(blocks)
    if zp.dtype == np.int16:  # integer zero points: move them into the codes where they fit
        folded = q - zp[..., None] + DEFAULT_ZERO_POINT[bits]
        if folded.min() >= 0 and folded.max() < 1 << bits:
            q, zp = folded, None
    split = blocks.block_size // block_size
    q = q.reshape(blocks.n, -1, block_size)
    scales = np.repeat(blocks.scales, split, axis=1)
    zp = None if zp is None else np.repeat(zp, split, axis=1)
    if zp is not None and zp.dtype == np.int16:  # uint8 zero points, packed like the codes
        zp = zp.astype(np.uint8) if bits == 8 else pack_codes(np.pad(zp, ((0, 0), (0, zp.shape[1] % 2)))[:, None], 4)[:, 0]
    units = None if blocks.scale_units is None else (blocks.scale_units[0], blocks.scale_units[1] * split)
    return Blocks(bits, pack_codes(q, bits), scales, zp, block_size, scale_units=units, input_order=blocks.input_order)


def widest(parts: list[Blocks]) -> tuple[int, int]:
    """(bits, block size) every part can be widened to: the most bits, the smallest block."""
    return max(p.bits for p in parts), min(p.block_size for p in parts)


def fuse(parts: list[Blocks]) -> Blocks:
    """Stack weights along the output axis (q|k|v, gate|up), widening them to one layout first."""
    bits, block = widest(parts)
    return concat_rows([widen(p, bits, block) for p in parts])


def split_offsets(blocks: Blocks) -> tuple[Blocks, np.ndarray | None]:
    """Blocks without a zero-point input (the fast kernels) and per-block offsets [N, K / block]
    float32 (None when all are 0) such that the weight is dequantize(result) + offsets per block:

        W[n, k] = (codes'[n, k] - default) * scale[n, b] + offsets[n, b],  b = k // block_size

    Float zero points z become integer t = round(z) (clipped so the codes fit; a constant block's
    code), codes' = codes - t + default, and offsets = (t - z) * scale (the only rounding, at
    float32's ulp). Integer zero points need no offset."""
    q, zp = unpack(blocks), zero_points(blocks)
    top, default = (1 << blocks.bits) - 1, DEFAULT_ZERO_POINT[blocks.bits]
    if zp.dtype == np.int16:
        return widen(blocks, blocks.bits, blocks.block_size), None
    lo, hi = q.max(axis=-1) - (top - default), q.min(axis=-1) + default
    if np.any(lo > hi):
        raise ValueError("codes span more than the bit width")
    lowest = q.min(axis=-1)
    # A constant block (e.g. from_gguf's scale-0 ones) goes wholly into its offset, so MatMulNBits
    # (int8 activations at level 4) sees a zero weight there rather than one of any size.
    t = np.where(lowest == q.max(axis=-1), lowest, np.clip(np.round(zp), lo, hi))
    offsets = ((t - zp.astype(np.float64)) * blocks.scales).astype(np.float32)
    # replace(): the hints (scale_units, input_order) stay with the blocks they describe
    main = dataclasses.replace(blocks, packed=pack_codes(q - t[..., None].astype(np.int16) + default, blocks.bits),
                               zero_points=None, offsets=None)
    return main, (offsets if np.any(offsets) else None)


# ---- everything else -------------------------------------------------------------------------

def requantized(data: np.ndarray, qtype: str, shape) -> tuple[Blocks, float]:
    """Types with no exact layout (IQ*, TQ*, MXFP4, ...): the gguf package's dequantization,
    rounded again by ONNX Runtime's quantizer to symmetric 4-bit blocks of 32. ``shape``: the
    tensor's numpy shape, [..., out, in]. Returns the blocks and the relative RMS error of that
    second rounding against the file's values."""
    quants = _quants()

    k = int(shape[-1])
    if k % REQUANTIZED_BLOCK_SIZE:
        raise ValueError(f"input size {k} is not a multiple of {REQUANTIZED_BLOCK_SIZE}")
    w = np.asarray(quants.dequantize(np.asarray(data), quants.GGMLQuantizationType[qtype]), dtype=np.float32).reshape(-1, k)
    blocks = quantize_blocks(np.ascontiguousarray(w.T), REQUANTIZED_BITS, REQUANTIZED_BLOCK_SIZE, symmetric=True)
    err = dequantize(blocks) - w
    norm = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
    return blocks, float(np.sqrt(np.mean(err ** 2)) / norm) if norm else 0.0


def _quants():
    from llmx.errors import require

    return require("gguf.quants", "reading GGUF files", "gguf")
