"""What ONNX Runtime's CPU MatMulNBits accepts, computes exactly and computes fast, per weight layout.

The layouts GGUF blocks can become (export/gguf_blocks.py): bits 2/4/8, block size 16/32, zero
points absent (the kernel's default 2^(bits-1)), packed uint8, or float32 per block; and "split":
float zero points re-expressed by ``split_offsets`` as default-zero-point blocks plus the graph's
``blocksum(x) @ offsets.T`` (``offset_nodes``). For each at ``accuracy_level`` 0 (float
activations) and 4 (activations quantized to int8 per block), a one-node model's output is
compared with x @ W.T computed in float64 from the same blocks, for a decode-shaped (1 row) and a
prefill-shaped (7 rows) x, with positive and mixed-sign scales. Then a decode MatMul
(x [1, 2048], W 2048 x 8192) is timed at 2 threads, median of many runs: "hot" one weight (which
can sit in the last-level cache), "cold" enough distinct weights in one graph (>= 96 MiB) that
each is read from memory, as a real model's are.

    python benchmarks/gguf_kernels.py [--threads 2] [--json out.json] [--no-timing]

Errors are rms(y - ref) / rms(ref). At level 0 they should be float32 rounding (~1e-7); at level 4
the int8 activation rounding (~5e-3 here; the 4-bit bs32 no-zero-point layout, Q4_0's, is the
reference for "normal"). Timings on a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAYOUTS = [  # (bits, block_size, zero points: "none" | "uint8" | "float" | "split")
    (4, 32, "none"), (4, 32, "uint8"), (4, 32, "float"), (4, 32, "split"),
    (4, 16, "none"), (4, 16, "uint8"), (4, 16, "float"), (4, 16, "split"),
    (8, 32, "none"), (8, 32, "uint8"), (8, 32, "float"), (8, 32, "split"),
    (8, 16, "none"), (8, 16, "uint8"), (8, 16, "float"), (8, 16, "split"),
    (2, 16, "none"), (2, 16, "uint8"), (2, 16, "float"), (2, 32, "float"),
]
SLOW_MS = 20.0  # a hot time above this is the unpacked (dequantize every call) path: no cold timing
COLD_BYTES = 96 << 20


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack the last axis, element i at bit (i % (8/bits)) * bits of byte i / (8/bits) (LSB first)."""
    per = 8 // bits
    v = values.astype(np.uint8).reshape(*values.shape[:-1], -1, per)
    out = np.zeros(v.shape[:-1], dtype=np.uint8)
    for i in range(per):
        out |= v[..., i] << np.uint8(i * bits)
    return out


def random_layout(rng, n: int, k: int, bits: int, block_size: int, zp: str, signs: bool):
    """{packed, scales, zero_points, offsets} and W [n, k] float64 ((q - zp) * scale (+ offsets))."""
    from llmx.export.gguf_blocks import split_offsets
    from llmx.quant_blocks import Blocks

    blocks = k // block_size
    q = rng.integers(0, 1 << bits, size=(n, blocks, block_size))
    scales = rng.uniform(1e-3, 1e-1, size=(n, blocks)).astype(np.float32)
    if signs:
        scales *= rng.choice([-1, 1], size=scales.shape).astype(np.float32)
    if zp == "none":
        zps, zf = None, np.full((n, blocks), 1 << (bits - 1), dtype=np.float64)
    elif zp == "uint8":
        zi = rng.integers(0, 1 << bits, size=(n, blocks))
        pad = (-blocks) % (8 // bits)
        zps = pack(np.pad(zi, ((0, 0), (0, pad))), bits) if bits < 8 else zi.astype(np.uint8)
        zf = zi.astype(np.float64)
    else:
        zps = rng.uniform(0, (1 << bits) - 1, size=(n, blocks)).astype(np.float32)
        zf = zps.astype(np.float64)
    w = ((q - zf[..., None]) * scales.astype(np.float64)[..., None]).reshape(n, k)
    layout = {"packed": pack(q, bits), "scales": scales, "zero_points": zps, "offsets": None}
    if zp == "split":  # float zero points, run as default-zero-point blocks + offsets
        main, offsets = split_offsets(Blocks(bits, layout["packed"], scales, zps, block_size))
        layout = {"packed": main.packed, "scales": main.scales, "zero_points": None, "offsets": offsets}
    return layout, w


def model_bytes(k: int, n: int, bits: int, block_size: int, level: int, layouts: list[dict]) -> bytes:
    """One MatMulNBits per layout (each its own weight, all on input A), outputs Y0, Y1, ..."""
    from onnx import TensorProto, helper, numpy_helper

    from llmx.export.gguf_blocks import offset_nodes

    nodes, inits, outputs = [], [], []
    for i, lay in enumerate(layouts):
        inits += [numpy_helper.from_array(lay["packed"], f"B{i}"), numpy_helper.from_array(lay["scales"], f"S{i}")]
        inputs = ["A", f"B{i}", f"S{i}"]
        if lay["zero_points"] is not None:
            inits.append(numpy_helper.from_array(lay["zero_points"], f"Z{i}"))
            inputs.append(f"Z{i}")
        attrs = dict(K=k, N=n, bits=bits, block_size=block_size)
        if level:
            attrs["accuracy_level"] = level
        y = f"Y{i}"
        main = y if lay["offsets"] is None else f"Y{i}_main"
        nodes.append(helper.make_node("MatMulNBits", inputs, [main], domain="com.microsoft", **attrs))
        if lay["offsets"] is not None:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(lay["offsets"].T), f"O{i}"))
            more, consts = offset_nodes("A", main, y, f"O{i}", k, block_size, f"off{i}")
            nodes += more
            inits += consts
        outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, ["M", n]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def session(blob: bytes, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    return ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])


def _why(e: Exception) -> str:
    text = str(e).splitlines()[0]
    return text[text.rfind("] ") + 2:][:200] if "] " in text else text[:200]


def rel_rms(y, ref) -> float:
    return float(np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref ** 2)))


def accuracy(bits, bs, zp, level, threads, k=512, n=96) -> dict:
    """Errors for decode (M=1) and prefill (M=7) x, positive and mixed-sign scales; or the refusal."""
    rng = np.random.default_rng(bits * 1000 + bs + level)
    out = {}
    for signs in (False, True):
        layout, w = random_layout(rng, n, k, bits, bs, zp, signs)
        try:
            sess = session(model_bytes(k, n, bits, bs, level, [layout]), threads)
        except Exception as e:  # noqa: BLE001 - a refusal is a result here
            return {"refused": _why(e)}
        for m in (1, 7):
            x = rng.standard_normal((m, k)).astype(np.float32)
            try:
                y = sess.run(None, {"A": x})[0].astype(np.float64)
            except Exception as e:  # noqa: BLE001 - some layouts are refused only when run
                return {"refused": _why(e)}
            out[f"{'mixed' if signs else 'pos'}_m{m}"] = rel_rms(y, x.astype(np.float64) @ w.T)
    return out


def _median_ms(sess, x, seconds=2.0, max_runs=400, min_runs=15) -> tuple[float, int]:
    for _ in range(3):
        sess.run(None, {"A": x})
    times, start = [], time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < seconds):
        t = time.perf_counter()
        sess.run(None, {"A": x})
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, len(times)


def timing(bits, bs, zp, level, threads, k=2048, n=8192) -> dict:
    """Median ms per x[1, k] @ W[k, n]: hot (one weight) and cold (weights >= COLD_BYTES in all)."""
    rng = np.random.default_rng(0)
    layout, _ = random_layout(rng, n, k, bits, bs, zp, False)
    x = rng.standard_normal((1, k)).astype(np.float32)
    try:
        sess = session(model_bytes(k, n, bits, bs, level, [layout]), threads)
        hot, runs = _median_ms(sess, x)
    except Exception as e:  # noqa: BLE001
        return {"refused": _why(e)}
    del sess
    out = {"hot_ms": hot, "hot_runs": runs}
    if hot > SLOW_MS:
        return out
    size = sum(a.nbytes for a in layout.values() if a is not None)
    copies = -(-COLD_BYTES // size)
    layouts = [random_layout(rng, n, k, bits, bs, zp, False)[0] for _ in range(copies)]
    sess = session(model_bytes(k, n, bits, bs, level, layouts), threads)
    total, runs = _median_ms(sess, x, seconds=3.0, max_runs=100, min_runs=8)
    out.update(cold_ms=total / copies, cold_copies=copies, cold_runs=runs, bytes=size)
    return out


def fp32_timing(threads, k=2048, n=8192) -> dict:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    out = {}
    for name, copies in (("hot_ms", 1), ("cold_ms", -(-COLD_BYTES // (k * n * 4)))):
        ws = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), f"W{i}") for i in range(copies)]
        nodes = [helper.make_node("MatMul", ["A", f"W{i}"], [f"Y{i}"]) for i in range(copies)]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
                                  [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, [1, n])
                                   for i in range(copies)], ws)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
        m.ir_version = 10
        ms, _ = _median_ms(session(m.SerializeToString(), threads), np.ones((1, k), np.float32),
                           seconds=2.0, max_runs=100)
        out[name] = ms / copies
    return out


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()

    rows = []
    print(f"onnxruntime {ort.__version__}, {args.threads} threads; errors rms(y - ref) / rms(ref) "
          "for positive|mixed-sign scales x M=1|M=7; ms per x[1,2048] @ W[2048,8192]")
    heads = " ".join(f"{h:>7}" for h in ("pos m1", "pos m7", "mix m1", "mix m7"))
    print(f"{'layout':<22} {'level':>5}  {heads}  {'hot ms':>8} {'cold ms':>8}")
    for bits, bs, zp in LAYOUTS:
        for level in (4, 0):
            row = {"bits": bits, "block_size": bs, "zero_points": zp, "accuracy_level": level,
                   "accuracy": accuracy(bits, bs, zp, level, args.threads)}
            if not args.no_timing and "refused" not in row["accuracy"]:
                row["timing"] = timing(bits, bs, zp, level, args.threads)
            rows.append(row)
            acc, tim = row["accuracy"], row.get("timing", {})
            name = f"{bits}-bit bs{bs} zp={zp}"
            if "refused" in acc:
                print(f"{name:<22} {level:>5}  REFUSED: {acc['refused']}", flush=True)
                continue
            errs = " ".join(f"{v:7.1e}" for v in acc.values())
            hot = f"{tim['hot_ms']:8.3f}" if "hot_ms" in tim else ""
            cold = f"{tim['cold_ms']:8.3f}" if "cold_ms" in tim else ("    slow" if tim else "")
            print(f"{name:<22} {level:>5}  {errs}  {hot} {cold}", flush=True)
    result = {"onnxruntime": ort.__version__, "threads": args.threads, "shape": "x[1,2048] @ W[2048,8192]",
              "rows": rows}
    if not args.no_timing:
        result["fp32_matmul"] = fp32_timing(args.threads)
        print(f"{'fp32 MatMul':<22} {'':>5}  {'':>31}  {result['fp32_matmul']['hot_ms']:8.3f} "
              f"{result['fp32_matmul']['cold_ms']:8.3f}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
