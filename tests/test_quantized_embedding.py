"""The embedding looked up from MatMulNBits blocks (llmx/fused/embedding.py) gives the blocks' own values."""

from __future__ import annotations

import numpy as np
import pytest

from llmx.quant_blocks import Blocks


def _blocks(bits: int, zero_points: str, rows: int = 7, k: int = 64, block: int = 32, seed: int = 0) -> Blocks:
    rng = np.random.default_rng(seed)
    per_byte = 8 // bits
    packed = rng.integers(0, 256, (rows, k // block, block // per_byte), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-1, (rows, k // block)).astype(np.float32)
    zps = rng.uniform(-3, 18, (rows, k // block)).astype(np.float32) if zero_points == "float" else None
    offsets = rng.uniform(-0.5, 0.5, (rows, k // block)).astype(np.float32) if zero_points == "offsets" else None
    return Blocks(bits, packed, scales, zps, block, offsets)


def _values(b: Blocks) -> np.ndarray:
    """(q - z) * s per element, MatMulNBits' order (4 bits: element 2j in byte j's low nibble)."""
    q = b.packed.astype(np.float32)
    if b.bits == 4:
        q = np.stack([b.packed & 15, b.packed >> 4], axis=-1).reshape(*b.packed.shape[:2], -1).astype(np.float32)
    values = (q - b.float_zero_points()[..., None]) * b.scales[..., None]
    if b.offsets is not None:
        values = values + b.offsets[..., None]
    return values.reshape(b.n, -1)


@pytest.mark.parametrize("bits,zero_points", [(4, "float"), (4, "default"), (8, "default"), (8, "float"),
                                              (4, "offsets"), (8, "offsets")])
def test_gathered_rows_are_the_blocks_values(bits, zero_points):
    import onnxruntime as ort

    from llmx.fused.embedding import gather_blocks
    from llmx.fused.graph import GraphBuilder

    blocks = _blocks(bits, zero_points)
    g = GraphBuilder("embed")
    g.input("input_ids", "int64", ["batch", "sequence"])
    g.output("rows", "float32", ["batch", "sequence", 64])
    weight = blocks.initializers("table")
    for tensor in weight.tensors:
        g.weight(tensor)
    g.op("Identity", [gather_blocks(g, weight, "input_ids")], ["rows"])
    sess = ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 0, 6], [1, 1, 5]])
    rows = sess.run(["rows"], {"input_ids": ids})[0]
    np.testing.assert_array_equal(rows, _values(blocks)[ids])


def test_a_padded_last_block_is_cut_to_the_rows_width():
    """A head of K = 48 inputs in blocks of 32 (ONNX Runtime's quantizer pads the last block with
    zeros, as K = 576 in blocks of 128): the looked-up rows are the K values, not the padding."""
    import onnxruntime as ort

    from llmx.fused.embedding import gather_blocks
    from llmx.fused.graph import GraphBuilder
    from llmx.quant_blocks import quantize_blocks

    table = np.random.default_rng(3).standard_normal((7, 48)).astype(np.float32)
    blocks = quantize_blocks(np.ascontiguousarray(table.T), 8, 32, symmetric=True)  # a [K, N] head
    assert blocks.packed.shape[1] * 32 == 64
    g = GraphBuilder("embed")
    g.input("input_ids", "int64", ["batch", "sequence"])
    g.output("rows", "float32", ["batch", "sequence", 48])
    weight = blocks.initializers("table", k=48)
    for tensor in weight.tensors:
        g.weight(tensor)
    g.op("Identity", [gather_blocks(g, weight, "input_ids")], ["rows"])
    sess = ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 0, 6]])
    rows = sess.run(["rows"], {"input_ids": ids})[0]
    assert rows.shape == (1, 3, 48)
    np.testing.assert_array_equal(rows, _values(blocks)[:, :48][ids])
    np.testing.assert_allclose(rows, table[ids], atol=np.abs(table).max() / 127)
