"""What a served batch costs per weight layout: fp32 MatMul against MatMulNBits at 4 and 8 bits.

    python benchmarks/batch_kernels.py [--rows 1,8,32,64] [--shapes 576x1536,1536x576,576x49152] [--rounds 5]

A server decodes C rows per graph run, so a weight layout that is fast for one row (the
memory-bound step llmx calibrate times) may not be for 32 (compute-bound). For each weight shape
(K x N: SmolLM-135M's MLP and its 49,152-token LM head by default) a one-node graph per layout
(fp32 MatMul; MatMulNBits 4 and 8 bits, blocks of 32, 64 and 128, ``accuracy_level`` 4 as llmx
writes them) runs x [rows, K] at 2 threads; layouts take turns round by round and the median is
kept. Prints ms per call and GFLOP/s, and each layout's time over fp32's, as a table and JSON
(benchmarks/results/batch_kernels_<date>.json). Weights are random: speed does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

LAYOUTS = {  # name: (bits, block size); bits 32 is the fp32 MatMul
    "fp32": (32, 0), "w8 b32": (8, 32), "w8 b64": (8, 64), "w8 b128": (8, 128),
    "w4 b32": (4, 32), "w4 b64": (4, 64), "w4 b128": (4, 128)}


def session(k: int, n: int, bits: int, block: int, threads: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])
    if bits == 32:
        inits = [numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), "w")]
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
    else:
        blocks = (k + block - 1) // block
        inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8), "q"),
                 numpy_helper.from_array((rng.random(n * blocks) * 0.01).astype(np.float32), "s")]
        node = helper.make_node("MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                block_size=block, accuracy_level=4)
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def time_call(sess: ort.InferenceSession, x: np.ndarray, budget_s: float) -> float:
    sess.run(None, {"x": x})
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < budget_s or len(times) < 5:
        t = time.perf_counter()
        sess.run(None, {"x": x})
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--shapes", default="576x1536,1536x576,576x49152", help="K x N of each weight")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    results = {}
    for k, n in shapes:
        sessions = {name: session(k, n, bits, block, args.threads) for name, (bits, block) in LAYOUTS.items()}
        xs = {m: np.random.default_rng(m).standard_normal((m, k)).astype(np.float32) for m in rows}
        runs = {(name, m): [] for name in LAYOUTS for m in rows}
        for rnd in range(args.rounds):
            order = list(LAYOUTS)[rnd % len(LAYOUTS):] + list(LAYOUTS)[: rnd % len(LAYOUTS)]
            for name in order:
                for m in rows:
                    runs[name, m].append(time_call(sessions[name], xs[m], 0.15))
        shape = f"{k}x{n}"
        results[shape] = {name: {m: statistics.median(runs[name, m]) * 1e3 for m in rows} for name in LAYOUTS}
        print(f"\nweight {shape} ({args.threads} threads): ms per call (GFLOP/s) and time / fp32")
        print(f"{'layout':9s}" + "".join(f"{f'{m} rows':>26s}" for m in rows))
        for name in LAYOUTS:
            cells = []
            for m in rows:
                ms = results[shape][name][m]
                cells.append(f"{ms:8.3f} ({2 * k * n * m / ms / 1e6:5.1f}) {ms / results[shape]['fp32'][m]:5.2f}x")
            print(f"{name:9s}" + "".join(f"{c:>26s}" for c in cells))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"batch_kernels_{time.strftime('%Y-%m-%d_%H%M')}.json"
    meta = {"threads": args.threads, "rounds": args.rounds, "cpus": os.cpu_count(), "onnxruntime": ort.__version__,
            "load_avg_1m": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d %H:%M")}
    path.write_text(json.dumps({"meta": meta, "ms_per_call": results}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
