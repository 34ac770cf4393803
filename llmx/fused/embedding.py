"""Embedding lookups that read a table stored for the head: MatMulNBits blocks (a GGUF's), or a
tied model's float head.

Blocks: gather, then dequantize.

A quantized GGUF's token table is 4-8 bits per value; stored as float32 it would be the largest
tensor of a small model's artifact (SmolLM2-135M: 113 MB beside 98 MB of blocks). Gathering the
looked-up rows' blocks and computing ``(q - zero_point) * scale`` on them alone, in float32 as
MatMulNBits computes its weights, gives the file's own values at the cost of the tokens looked
up, and a tied head shares the very same initializers with its MatMulNBits (offsets included:
``Blocks.offsets``).
"""

from __future__ import annotations

import numpy as np

from llmx.fused.graph import GraphBuilder
from llmx.quant_blocks import DEFAULT_ZERO_POINT, NBitsWeight


def gather_blocks(g: GraphBuilder, weight: NBitsWeight, ids: str) -> str:
    """[batch, seq, k] float32 rows of ``weight`` (n rows of k values) for the token ``ids``."""
    packed, scales, *zero_points = (g.weight(t) for t in weight.tensors)
    if zero_points and weight.tensors[2].data_type != 1:  # FLOAT; packed integer zero points are not written here
        raise ValueError(f"{weight.tensors[2].name}: only float zero points are gathered")
    codes = g.op1("Cast", [g.op1("Gather", [packed, ids])], to=6)  # [b, s, blocks, bytes] int32
    if weight.bits == 4:
        # MatMulNBits packs element 2j in the low nibble of byte j, 2j + 1 in the high one.
        sixteen = g.const(np.array(16, np.int32))
        low, high = g.op1("Mod", [codes, sixteen]), g.op1("Div", [codes, sixteen])
        axis = g.const(np.array([-1], np.int64))
        codes = g.op1("Concat", [g.op1("Unsqueeze", [low, axis]), g.op1("Unsqueeze", [high, axis])], axis=-1)
        codes = g.op1("Reshape", [codes, g.const(np.array([0, 0, 0, -1], np.int64))])
    values = g.op1("Cast", [codes], to=1)
    last = g.const(np.array([-1], np.int64))
    if zero_points:
        offset = g.op1("Unsqueeze", [g.op1("Gather", [zero_points[0], ids]), last])
    else:
        offset = g.const(np.array(DEFAULT_ZERO_POINT[weight.bits], np.float32))
    scaled = g.op1("Mul", [g.op1("Sub", [values, offset]), g.op1("Unsqueeze", [g.op1("Gather", [scales, ids]), last])])
    if weight.offsets is not None:  # stored [blocks, n] for the head's MatMul: gather columns
        block_offsets = g.op1("Transpose", [g.op1("Gather", [g.weight(weight.offsets), ids], axis=1)], perm=[1, 2, 0])
        scaled = g.op1("Add", [scaled, g.op1("Unsqueeze", [block_offsets, last])])
    rows = g.op1("Reshape", [scaled, g.const(np.array([0, 0, -1], np.int64))])
    blocks = weight.tensors[0].dims[1]
    if blocks * weight.block_size != weight.k:  # the last block padded (K = 576 in blocks of 128)
        rows = g.op1("Slice", [rows, g.const(np.array([0], np.int64)), g.const(np.array([weight.k], np.int64)),
                               g.const(np.array([-1], np.int64))])
    return rows


def gather_from_head(g: GraphBuilder, head: str, ids: str) -> str:
    """[batch, seq, k] rows of a tied model's table, read from the head's [k, n] float weight.

    A tied fp32 table stored once for the lookup and again transposed for the head's MatMul
    would be a second copy of the largest tensor (SmolLM2-135M: 113 MB of 540; Qwen3-4B: 1.6 GB):
    the lookup gathers the head's columns instead.
    """
    columns = g.op1("Gather", [head, ids], axis=1)  # [k, batch, seq]
    return g.op1("Transpose", [columns], perm=[1, 2, 0])


def scaled_lookup(g: GraphBuilder, rows: str, scale: float) -> str:
    """A table read from the head lacks the embedding's factor (Gemma's sqrt(hidden)): one float32
    multiply after the lookup, as the reference does it."""
    return rows if scale == 1.0 else g.op1("Mul", [rows, g.const(np.array(scale, np.float32))])
