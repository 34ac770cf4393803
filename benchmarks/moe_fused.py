"""ONNX Runtime's MoE contrib op against a TopK + Gather formulation, for the optimized graphs.

    python benchmarks/moe_fused.py [--hidden 512] [--inner 1024] [--experts 8] [--top-k 2] [--threads 2]

One MoE block (router, top-k, SwiGLU experts) as a standalone graph in each formulation of
llmx/fused/moe.py, plus the portable graphs' dense form (every expert, combined with the
routing weights). The router's logits are of order 1, so the top-k weights are far from one-hot and the
renormalization matters. Each is checked against a numpy reference (with and without renormalizing
the top-k weights), then timed for decode-sized (1 and 4 tokens) and prefill-sized (64 tokens)
inputs. Prints a table and writes benchmarks/results/moe_fused.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from llmx.fused.graph import GraphBuilder
from llmx.fused.moe import MoEWeights, contrib_layout, moe_block

SILU = ("QuickGelu", "com.microsoft", {"alpha": 1.0})


def reference(x, router, gate_up, down, k, renormalize):
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    index = np.argsort(-probs, axis=-1)[:, :k]
    top = np.take_along_axis(probs, index, -1)
    if renormalize:
        top /= top.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    inner = down.shape[1]
    for n in range(x.shape[0]):
        for j in range(k):
            h = x[n] @ gate_up[index[n, j]]
            gate, up = h[:inner], h[inner:]
            out[n] += top[n, j] * ((gate / (1 + np.exp(-gate)) * up) @ down[index[n, j]])
    return out


def dense(g: GraphBuilder, x: str, w: MoEWeights, experts, k, renormalize) -> str:
    """The portable graphs' form: every expert on every token, zero weight for those not chosen."""
    probs = g.op1("Softmax", [g.op1("MatMul", [x, w.router])], axis=-1)
    top, index = g.op("TopK", [probs, g.const([k], dtype=np.int64)], 2, axis=-1)
    if renormalize:
        top = g.op1("Div", [top, g.op1("ReduceSum", [top, g.const([-1], dtype=np.int64)], keepdims=1)])
    weights = g.op1("ScatterElements", [g.op1("Mul", [probs, g.const(np.float32(0))]), index, top], axis=-1)
    h = g.op1("MatMul", [g.op1("Unsqueeze", [x, g.const([0], dtype=np.int64)]), w.gate_up])  # [E,N,2I]
    inner = g.op1("Div", [g.op1("Shape", [h], start=2, end=3), g.const([2], dtype=np.int64)])
    gate, up = g.op("Split", [h, g.op1("Concat", [inner, inner], axis=0)], 2, axis=-1)
    out = g.op1("MatMul", [g.op1("Mul", [g.op1("QuickGelu", [gate], domain="com.microsoft", alpha=1.0), up]), w.down])
    weighted = g.op1("Mul", [out, g.op1("Unsqueeze", [g.op1("Transpose", [weights], perm=[1, 0]), g.const([2], dtype=np.int64)])])
    return g.op1("ReduceSum", [weighted, g.const([0], dtype=np.int64)], keepdims=0)


def build(kind, arrays, experts, k, inner, hidden, renormalize):
    g = GraphBuilder(f"moe_{kind}")
    g.input("x", "float32", ["n", hidden])
    g.output("y", "float32", ["n", hidden])
    names = {name: g.const(a, name) for name, a in arrays.items()}
    w = MoEWeights(names["router"], names["gate_up"], names["down"], names["gate_up_t"], names["down_t"])
    if kind == "dense":
        y = dense(g, "x", w, experts, k, renormalize)
    else:
        y = moe_block(g, "x", w, experts=experts, top_k=k, inner=inner, hidden=hidden, renormalize=renormalize,
                      act=SILU, formulation=kind)
    g.op("Identity", [y], ["y"])
    return g.model().SerializeToString()


def timed(session, x, seconds=1.5):
    session.run(None, {"x": x})
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        session.run(None, {"x": x})
        runs += 1
    return (time.perf_counter() - start) / runs * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inner", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    h, i, e, k = args.hidden, args.inner, args.experts, args.top_k
    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)).astype(np.float32)
    down = (rng.standard_normal((e, i, h)) / np.sqrt(i)).astype(np.float32)
    fc1, fc2 = contrib_layout(gate_up, down)
    arrays = dict(router=(rng.standard_normal((h, e)) / np.sqrt(h)).astype(np.float32), gate_up=gate_up, down=down, gate_up_t=fc1, down_t=fc2)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    rows, result = [], {"shape": dict(hidden=h, inner=i, experts=e, top_k=k, threads=args.threads), "runs": []}
    for renormalize in (True, False):
        for kind in ("contrib", "gather", "dense"):
            session = ort.InferenceSession(build(kind, arrays, e, k, i, h, renormalize), opts, providers=["CPUExecutionProvider"])
            x = rng.standard_normal((16, h)).astype(np.float32)
            ref = reference(x, arrays["router"], gate_up, down, k, renormalize)
            err = float(np.abs(session.run(None, {"x": x})[0] - ref).max() / np.abs(ref).max())
            times = {n: timed(session, rng.standard_normal((n, h)).astype(np.float32)) for n in (1, 4, 64)}
            result["runs"].append(dict(formulation=kind, renormalize=renormalize, rel_err=err, ms=times))
            rows.append(f"| {kind:8} | {str(renormalize):5} | {err:.1e} | " + " | ".join(f"{times[n]:8.3f}" for n in (1, 4, 64)) + " |")
    print(f"MoE block: hidden {h}, inner {i}, {e} experts, top-{k}, {args.threads} threads (ms per call)")
    print("| formulation | renormalize | rel err | 1 token | 4 tokens | 64 tokens |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    out = Path(__file__).parent / "results" / "moe_fused.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
