"""How close a decode step is to the memory roofline: the bytes it must read, over the speed this
host streams weights through ONNX Runtime's own GEMV kernel.

    python benchmarks/roofline.py ART [ART ...] [--context 192] [--threads 1,2]

A batch-1 decode step reads every weight once (the embedding table only for one row) and the KV
cache up to the current length. Divided by the bandwidth a chain of fp32 MatMuls [1, K] x [K, N]
reaches (``stream_gb_s``: the same MLAS kernel both llmx and onnxruntime-genai run, a working set
well past this process's share of the last-level cache), that gives the fastest step any engine
on this ONNX Runtime can take. An engine near 100 % of it is memory-bound and no graph or loop
rewrite moves it; one far below it is compute- or overhead-bound (quantized kernels, which
unpack as they go, usually are). benchmarks/fast_default.py puts both engines against it.
benchmarks/mem_read.c measures the raw load ceiling the MatMul's speed is a fraction of.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def _nbytes(init) -> int:
    """Stored size of an initializer: onnx's element type, 4-bit types packed two to a byte."""
    import onnx

    count = int(np.prod(init.dims, dtype=np.int64))
    packed = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4, getattr(onnx.TensorProto, "FLOAT4E2M1", None)}
    if init.data_type in packed:
        return (count + 1) // 2
    return count * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize


def weight_bytes(graph: str | Path) -> int:
    """Bytes of a graph's initializers that a decode step reads: all of them but those only a
    Gather consumes (embedding tables: one row per token)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    consumers: dict[str, set[str]] = defaultdict(set)
    nodes = list(model.graph.node)
    while nodes:  # subgraphs (If/Loop/Scan bodies) read initializers too
        node = nodes.pop()
        for name in node.input:
            consumers[name].add(node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes.extend(attr.g.node)
    total = 0
    for init in model.graph.initializer:
        if consumers.get(init.name, {"Gather"}) == {"Gather"}:
            continue
        total += _nbytes(init)
    return total


def kv_bytes(layers: int, kv_heads: int, head_dim: int, context: int, itemsize: int = 4) -> int:
    """Keys and values of ``context`` positions, batch 1."""
    return 2 * layers * kv_heads * head_dim * context * itemsize


def stream_gb_s(threads: int, megabytes: int = 600, rounds: int = 15) -> float:
    """GB/s at which ONNX Runtime's MatMul streams fp32 weights for one activation row."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = 576, 1536
    count = max(1, megabytes * 10**6 // (k * n * 4))
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32), f"w{i}") for i in range(count)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(count)]
    nodes.append(helper.make_node("Concat", [f"y{i}" for i in range(count)], ["y"], axis=1))
    graph = helper.make_graph(nodes, "stream", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n * count])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if threads > 1 else "0")
    opts.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stream.onnx"
        onnx.save(model, str(path), save_as_external_data=True, location="stream.bin")
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feed = {"x": rng.standard_normal((1, k), dtype=np.float32)}
        for _ in range(3):
            session.run(None, feed)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - start)
    return count * k * n * 4 / statistics.median(times) / 1e9


def step_floor_ms(step_bytes: int, gb_s: float) -> float:
    return step_bytes / gb_s / 1e6


def artifact_step_bytes(artifact: Path, context: int) -> int:
    """An llmx artifact's decode step: its decode graph's weights and the KV cache at ``context``."""
    from llmx.artifact.manifest import load_manifest

    manifest = load_manifest(artifact)
    kv = manifest.kv
    itemsize = np.dtype(kv.dtype).itemsize
    return weight_bytes(artifact / manifest.graphs["decode"].file) + kv_bytes(kv.num_layers, kv.num_kv_heads,
                                                                             kv.head_dim, context, itemsize)


def genai_step_bytes(model_dir: Path, context: int) -> int:
    """The same for an onnxruntime-genai model folder (genai_config.json names the graph and KV shape)."""
    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    return weight_bytes(model_dir / decoder["filename"]) + kv_bytes(
        decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"], context)


def measured_step_ms(artifact: Path, threads: int, prompt_len: int, new_tokens: int) -> float:
    """llmx's decode step on ``artifact`` as `llmx bench` times it (warm-up, then 3 runs)."""
    from llmx.runtime.bench import bench
    from llmx.runtime.engine import Engine

    engine = Engine.load(artifact, threads=threads, spin=threads > 1)
    return bench(engine.backend, engine.tokenizer, prompt_len, new_tokens, repeat=3, warmup=1).tpot_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", type=Path, nargs="+")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    context = args.prompt_len + args.new_tokens // 2  # the mean length a step attends over
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        gb_s = stream_gb_s(threads)
        for art in args.artifacts:
            nbytes = artifact_step_bytes(art, context)
            floor = step_floor_ms(nbytes, gb_s)
            step = measured_step_ms(art, threads, args.prompt_len, args.new_tokens)
            rows.append({"artifact": str(art), "threads": threads, "stream_gb_s": round(gb_s, 1),
                         "step_mb": round(nbytes / 1e6, 1), "floor_ms": round(floor, 2), "step_ms": round(step, 2),
                         "of_floor": round(floor / step, 3)})
    print("| artifact | threads | stream GB/s | MB per step | floor ms | llmx step ms | floor / step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {Path(r['artifact']).name} | {r['threads']} | {r['stream_gb_s']} | {r['step_mb']} | {r['floor_ms']} | "
              f"{r['step_ms']} | {r['of_floor']:.0%} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
