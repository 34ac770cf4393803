"""GGUF blocks as MatMulNBits weights (export/gguf_blocks.py), against the gguf package's dequantization.

For every type llama.cpp's Q*_0/Q*_1/Q*_K mixes write: random valid blocks (crafted bytes with
realistic fp16 scales, some of them 0; and the gguf package's own quantization where it has one)
must dequantize, through the MatMulNBits layout read back here independently, to the file's
values at float32 rounding; one ONNX Runtime session per type (accuracy_level 0) must compute
x @ W.T with those values. ``widen``/``fuse`` are exact, ``requantized`` reports its error.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from llmx.export import gguf_blocks as gb  # noqa: E402
from llmx.quant_blocks import Blocks, offset_nodes, replace_matmuls  # noqa: E402

# Byte offsets of each block's fp16 fields: the scale d first, then dmin / m where there is one.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "Q1_0": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_S": (0,), "IQ3_XXS": (0,), "IQ2_S": (0,),
               "IQ2_XS": (0,), "IQ2_XXS": (0,), "IQ1_S": (0,), "TQ1_0": (52,), "TQ2_0": (64,)}
GGUF_QUANTIZES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "MXFP4")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")
TYPES = (*FP16_FIELDS, "Q8_K", "IQ1_M", "MXFP4", "NVFP4")
ROWS, K = 24, 512


def crafted(qtype: str, rows: int = ROWS, k: int = K, seed: int = 0) -> np.ndarray:
    """Random bytes, with finite fp16 fields of magnitude 1e-3..1e-1 (random signs), one scale in ten 0."""
    rng = np.random.default_rng([seed, *qtype.encode()])
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    data = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    if qtype == "Q8_K":  # float32 d, then 256 int8, then 16 int16 sums the dequantization ignores
        d = rng.uniform(1e-4, 1e-2, size=(rows, k // block)).astype(np.float32)
        data[..., 0:4] = d.view(np.uint8).reshape(rows, -1, 4)
        return data.reshape(rows, -1)
    if qtype == "MXFP4":  # e8m0 scale 2^(e - 128): 2^-10 .. 2^-4
        data[..., 0] = rng.integers(118, 125, size=data.shape[:2])
        return data.reshape(rows, -1)
    if qtype == "NVFP4":  # four unsigned e4m3 scales per 64 (0 and 0x7f both mean 0)
        data[..., 0:4] = rng.choice(np.array([0, 0x7F, *range(0x08, 0x30)], np.uint8), size=(*data.shape[:2], 4))
        return data.reshape(rows, -1)
    if qtype == "IQ1_M":  # fp16 d in the top nibbles of the last 4 uint16
        d = rng.uniform(1e-3, 1e-1, size=data.shape[:2]).astype(np.float16).view(np.uint16)
        sc = np.ascontiguousarray(data[..., 48:56]).view(np.uint16) & np.uint16(0x0FFF)
        sc |= ((d[..., None] >> np.array([0, 4, 8, 12], np.uint16)) & 0xF) << np.uint16(12)
        data[..., 48:56] = sc.view(np.uint8)
        return data.reshape(rows, -1)
    for i, at in enumerate(FP16_FIELDS[qtype]):
        v = rng.uniform(1e-3, 1e-1, size=data.shape[:2]) * rng.choice([-1.0, 1.0], size=data.shape[:2])
        if i == 0:
            v[rng.random(v.shape) < 0.1] = 0.0
        data[..., at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)
    return data.reshape(rows, -1)


def quantized(qtype: str, rows: int = ROWS, k: int = K) -> np.ndarray:
    w = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32) * 0.02
    w[0, :32] = 0.01  # a constant block: Q4_1/Q5_1 store d = 0
    return gguf_quantize(w, GGMLQuantizationType[qtype])


def file_values(data: np.ndarray, qtype: str) -> np.ndarray:
    """The gguf package's dequantization; ggml's for the two types it lacks."""
    if qtype == "Q8_K":  # dequantize_row_q8_K: d * q
        raw = data.reshape(data.shape[0], -1, 292)
        d = np.ascontiguousarray(raw[..., :4]).view(np.float32)
        return (d * raw[..., 4:260].view(np.int8).astype(np.float32)).reshape(data.shape[0], -1)
    if qtype == "Q1_0":  # dequantize_row_q1_0: bit j % 8 of byte j / 8 set: d, else -d
        raw = data.reshape(data.shape[0], -1, 18)
        d = np.ascontiguousarray(raw[..., :2]).view(np.float16).astype(np.float32)
        bits = (raw[..., 2:, None] >> np.arange(8, dtype=np.uint8)) & 1
        return np.where(bits.reshape(*raw.shape[:2], 128) == 1, d, -d).reshape(data.shape[0], -1)
    return gguf_dequantize(data, GGMLQuantizationType[qtype]).astype(np.float32)


def layout_terms(b: Blocks) -> tuple[np.ndarray, np.ndarray]:
    """(codes, zero points) [N, blocks, block] float64 of the MatMulNBits layout, read as the kernel
    reads it: 4 bits: element 2j in byte j's low nibble, 2j + 1 in its high one; zero points absent:
    2^(bits - 1); uint8: packed the same way; float: per block."""
    if b.bits == 8:
        q = b.packed.astype(np.float64)
    else:
        assert b.bits == 4
        q = np.empty((*b.packed.shape[:2], b.block_size))
        q[..., 0::2], q[..., 1::2] = b.packed & 0x0F, b.packed >> 4
    n, blocks = b.scales.shape
    assert b.packed.shape == (n, blocks, b.block_size * b.bits // 8) and b.packed.dtype == np.uint8
    assert b.scales.dtype == np.float32
    if b.zero_points is None:
        z = np.full((n, blocks), 2.0 ** (b.bits - 1))
    elif b.zero_points.dtype == np.uint8:
        zp = b.zero_points
        z = (zp.astype(np.float64) if b.bits == 8 else
             np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float64))
    else:
        assert b.zero_points.dtype == np.float32 and b.zero_points.shape == (n, blocks)
        z = b.zero_points.astype(np.float64)
    return q, np.broadcast_to(z[..., None], q.shape)


def weight(b: Blocks, offsets: np.ndarray | None = None) -> np.ndarray:
    """[N, K] float64: (codes - zero points) * scales (+ offsets [N, blocks], one per block)."""
    q, z = layout_terms(b)
    w = (q - z) * b.scales.astype(np.float64)[..., None]
    if offsets is not None:
        w = w + offsets.astype(np.float64)[..., None]
    return w.reshape(b.n, -1)


def assert_float32_close(b: Blocks, ref: np.ndarray, offsets: np.ndarray | None = None) -> None:
    """Each value within 1e-6 of its block's magnitude, |scale| (|code| + |zero point|) (+ |offset|)."""
    q, z = layout_terms(b)
    mag = np.abs(b.scales.astype(np.float64))[..., None] * (np.abs(q) + np.abs(z))
    if offsets is not None:
        mag = mag + np.abs(offsets.astype(np.float64))[..., None]
    tol = 1e-6 * mag.max(axis=-1, keepdims=True) + 1e-30
    err = np.abs(weight(b, offsets) - ref.astype(np.float64)).reshape(q.shape)
    assert np.all(err <= tol), f"worst error {np.max(err / tol):.2f} x the tolerance"


def cases():
    for qtype in TYPES:
        yield pytest.param(qtype, "crafted", id=f"{qtype}-crafted")
        if qtype in GGUF_QUANTIZES:
            yield pytest.param(qtype, "quantized", id=f"{qtype}-quantized")


def data_for(qtype: str, source: str) -> np.ndarray:
    return crafted(qtype) if source == "crafted" else quantized(qtype)


@pytest.mark.parametrize("qtype,source", list(cases()))
def test_blocks_hold_the_files_values(qtype, source):
    data = data_for(qtype, source)
    ref = file_values(data, qtype)
    b = gb.from_gguf(data, qtype)
    assert (b.bits, b.block_size, b.n) == (gb.BITS[qtype], gb.BLOCK_SIZE[qtype], ROWS)
    assert qtype in gb.EXACT
    assert (b.zero_points is not None) == (qtype in gb.ASYMMETRIC)
    assert_float32_close(b, ref)
    # The fast form: no zero-point input, offsets only for the asymmetric types.
    main, offsets = gb.split_offsets(b)
    assert main.zero_points is None and (main.bits, main.block_size) == (b.bits, b.block_size)
    assert (offsets is not None) == (qtype in gb.ASYMMETRIC)
    assert_float32_close(main, ref, offsets)


def test_leading_axes_fold_into_rows():
    data = crafted("Q4_K", rows=6)
    experts = gb.from_gguf(data.reshape(2, 3, -1), "Q4_K")
    assert experts.n == 6
    np.testing.assert_array_equal(weight(experts), weight(gb.from_gguf(data, "Q4_K")))


def test_unmapped_types_are_refused():
    with pytest.raises(ValueError, match="BF16"):
        gb.from_gguf(crafted("Q4_0"), "BF16")


def test_codebook_types_are_refused_unless_the_division_is_exact(monkeypatch):
    """IQ*/TQ*/MXFP4/NVFP4 codes are the file's values over the block's unit: checked, not assumed."""
    units = gb._units
    monkeypatch.setattr(gb, "_units", lambda b, qtype: units(b, qtype) * np.float32(3))
    with pytest.raises(ValueError, match="not integer multiples"):
        gb.from_gguf(crafted("IQ4_XS"), "IQ4_XS")


def test_gguf_reader_gives_rows_of_bytes(tmp_path):
    """GGUFReader's .data for a quantized tensor is [rows, bytes per row] uint8, what from_gguf takes."""
    data = crafted("Q5_K", rows=8)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("w", data, raw_dtype=GGMLQuantizationType.Q5_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors
    assert tensor.data.shape == data.shape and tensor.data.dtype == np.uint8
    assert tensor.tensor_type.name == "Q5_K" and list(tensor.shape) == [K, 8]  # ggml order: in, out
    np.testing.assert_array_equal(weight(gb.from_gguf(tensor.data, tensor.tensor_type.name)),
                                  weight(gb.from_gguf(data, "Q5_K")))


# ---- ONNX Runtime ----------------------------------------------------------------------------

def run_matmul(b: Blocks, offsets: np.ndarray | None, x: np.ndarray, level: int) -> np.ndarray:
    """x @ W through the exporter's own swap (replace_matmuls), plus offset_nodes when there are offsets."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = x.shape[-1], b.n
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y_main" if offsets is not None else "y"], name="mm")]
    inits = [numpy_helper.from_array(np.zeros((k, n), np.float32), "w")]
    if offsets is not None:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(offsets.T), "w_offsets"))
        more, consts = offset_nodes("x", "y_main", "y", "w_offsets", k, b.block_size, "w_off")
        nodes += more
        inits += consts
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    assert replace_matmuls(model, {"w": b.initializers("w")}, level) == ["w"]
    onnx.checker.check_model(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def check_session(b: Blocks, offsets, ref: np.ndarray, level: int = 0) -> float:
    x = np.random.default_rng(2).standard_normal((2, 3, ref.shape[1])).astype(np.float32)
    y = run_matmul(b, offsets, x, level).astype(np.float64)
    xd = x.astype(np.float64)
    exact = xd @ ref.astype(np.float64).T
    if level == 0:
        bound = np.abs(xd) @ np.abs(ref.astype(np.float64)).T
        assert np.all(np.abs(y - exact) <= 1e-5 * bound + 1e-12)
    return float(np.sqrt(np.mean((y - exact) ** 2) / np.mean(exact ** 2)))


@pytest.mark.parametrize("qtype", TYPES)
def test_onnxruntime_computes_the_files_values(qtype):
    data = crafted(qtype)
    ref = file_values(data, qtype)
    b = gb.from_gguf(data, qtype)
    main, offsets = gb.split_offsets(b)
    check_session(main, offsets, ref)  # the fast form: what the exporter should write
    # accuracy_level 4 (int8 activations): the usual activation-rounding error, not more.
    assert check_session(main, offsets, ref, level=gb_level()) < 2e-2
    if b.zero_points is not None and b.bits == 4:  # float zero points: exact too (slow kernel)
        check_session(b, None, ref)


def gb_level() -> int:
    from llmx.quant_blocks import CPU_ACCURACY_LEVEL

    return CPU_ACCURACY_LEVEL


def test_eight_bit_float_zero_points_are_refused_by_onnxruntime():
    """Why Q5_1/Q5_K need split_offsets: ORT 1.31's CPU kernel runs float zero points only by
    dequantizing, which it does for 2 and 4 bits. If this starts passing, 8-bit float zero points
    run: time them with benchmarks/gguf_kernels.py before relying on them."""
    data = crafted("Q5_K")
    with pytest.raises(Exception, match="(?i)2b and 4b|not supported|bits"):
        check_session(gb.from_gguf(data, "Q5_K"), None, file_values(data, "Q5_K"))


# ---- widen / fuse ----------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("bits,block", [(8, 16), (8, 32), (4, 16)])
def test_widen_is_exact(qtype, bits, block):
    b = gb.from_gguf(crafted(qtype), qtype)
    if bits < b.bits or block > b.block_size:
        with pytest.raises(ValueError):
            gb.widen(b, bits, block)
        return
    w = gb.widen(b, bits, block)
    assert (w.bits, w.block_size, w.n) == (bits, block, b.n)
    np.testing.assert_array_equal(weight(w), weight(b))


def test_widen_folds_integer_zero_points():
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, size=(4, 8, 32))
    zp = rng.integers(4, 12, size=(4, 8))
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    b = Blocks(4, packed, rng.uniform(0.01, 0.1, size=(4, 8)).astype(np.float32),
               (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8), 32)
    for bits, block in ((8, 16), (8, 32)):
        w = gb.widen(b, bits, block)
        assert w.zero_points is None
        np.testing.assert_array_equal(weight(w), weight(b))
    narrow = gb.widen(b, 4, 16)  # codes - zp + 8 need not fit 4 bits: uint8 zero points kept, repacked
    np.testing.assert_array_equal(weight(narrow), weight(b))


def test_a_q4_k_m_layer_fuses_exactly():
    """llama.cpp's Q4_K_M: attn_q/k Q4_K, attn_v Q6_K -> one 8-bit block-16 weight + offsets."""
    parts = {name: crafted(t, rows=r, seed=i) for i, (name, t, r) in
             enumerate([("q", "Q4_K", 32), ("k", "Q4_K", 16), ("v", "Q6_K", 16)])}
    types = {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}
    blocks = [gb.from_gguf(parts[p], types[p]) for p in "qkv"]
    assert gb.widest(blocks) == (8, 16)
    fused = gb.fuse(blocks)
    ref = np.concatenate([file_values(parts[p], types[p]) for p in "qkv"])
    assert (fused.bits, fused.block_size, fused.n) == (8, 16, 64)
    np.testing.assert_array_equal(weight(fused), np.concatenate([weight(b) for b in blocks]))
    main, offsets = gb.split_offsets(fused)
    assert main.zero_points is None and not offsets[32 + 16:].any()  # Q6_K rows: no offsets
    assert_float32_close(main, ref, offsets)
    check_session(main, offsets, ref)


# ---- requantized -----------------------------------------------------------------------------

def iq4_nl(rows: int = ROWS, k: int = K) -> np.ndarray:
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, size=(rows, k // 32, 18), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, size=data.shape[:2]).astype(np.float16)
    data[..., 0:2] = d.view(np.uint8).reshape(*d.shape, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["IQ4_NL", "TQ2_0", "IQ2_XXS"])
def test_requantized_reports_its_second_rounding(qtype):
    """For a type from_gguf refuses, or where 4 bits matter more than exactness (IQ* map exactly
    only at 8 bits)."""
    if qtype == "IQ4_NL":
        data = iq4_nl()
    elif qtype == "TQ2_0":
        data = gguf_quantize(np.random.default_rng(5).standard_normal((ROWS, K)).astype(np.float32) * 0.02,
                             GGMLQuantizationType[qtype])
    else:
        data = crafted(qtype)
    ref = gguf_dequantize(data, GGMLQuantizationType[qtype]).astype(np.float64)
    b, err = gb.requantized(data, qtype, (ROWS, K))
    assert (b.bits, b.block_size, b.zero_points) == (gb.REQUANTIZED_BITS, gb.REQUANTIZED_BLOCK_SIZE, None)
    assert b.packed.shape == (ROWS, K // 32, 16)
    expected = np.sqrt(np.mean((weight(b) - ref) ** 2) / np.mean(ref ** 2))
    assert np.isfinite(err) and 0 < err < 0.2 and err == pytest.approx(expected, rel=1e-6)
    assert check_session(b, None, weight(b)) < 1e-6  # and ORT runs the requantized blocks


def test_constant_blocks_go_wholly_into_their_offsets():
    """from_gguf's scale-0 blocks (every value -dmin m): MatMulNBits sees a zero weight there."""
    b = gb.from_gguf(crafted("Q4_K"), "Q4_K")
    dead = b.scales == 1  # from_gguf's scale-0 blocks (random 6-bit scales: some are 0)
    assert dead.any()
    main, offsets = gb.split_offsets(b)
    q, z = layout_terms(main)
    assert np.all(q[dead] == z[dead])
    np.testing.assert_array_equal(offsets[dead], -b.zero_points[dead])
