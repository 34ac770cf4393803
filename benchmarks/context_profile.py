"""Decode step time against context length, split into attention and everything else.

    python benchmarks/context_profile.py ART [--contexts 64,1024] [--passes 5]

Runs the artifact's decode graph with ONNX Runtime's profiler on a KV buffer bound in place
(as the runtime does), alternating the context lengths pass by pass, and reports per context
the median step time, the time inside the attention nodes (GroupQueryAttention, or the
MatMul/Softmax attention of a portable graph is not separable: then only the total) and the
rest. The rest must not grow with context: no per-step allocation or copy of the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from llmx.artifact.manifest import load_manifest
from llmx.runtime.onnx_backend import session_options

ATTENTION_OPS = ("GroupQueryAttention",)


def profile_steps(art: Path, context: int, steps: int, threads: int | None) -> tuple[float, float]:
    """(median step ms, median attention ms) of ``steps`` decode steps at ``context`` cached tokens."""
    import onnxruntime as ort

    manifest = load_manifest(art)
    kv = manifest.kv
    opts = session_options(threads)
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(tempfile.gettempdir(), "llmx_context_profile")
    session = ort.InferenceSession(str(art / manifest.graphs["decode"].file), opts, providers=["CPUExecutionProvider"])
    shape = (1, kv.num_kv_heads, context + 16, kv.head_dim)
    buffers = [np.zeros(shape, np.float32) for _ in range(2 * kv.num_layers)]
    binding = session.io_binding()
    binding.bind_cpu_input("input_ids", np.array([[9]]))
    binding.bind_cpu_input("position_ids", np.array([[context]]))
    binding.bind_cpu_input("attention_mask", np.ones((1, context + 1), np.int64))
    names = list(zip(kv.past_names(), kv.present_names()))
    for (past, present), buf in zip(names, buffers):
        binding.bind_input(past, "cpu", 0, np.float32, shape, buf.ctypes.data)
        binding.bind_output(present, "cpu", 0, np.float32, shape, buf.ctypes.data)
    binding.bind_output("logits")
    for _ in range(steps + 2):
        session.run_with_iobinding(binding)
    path = session.end_profiling()
    events = json.loads(Path(path).read_text())
    os.remove(path)
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][2:]
    attention = []
    for run in runs:
        start, end = run["ts"], run["ts"] + run["dur"]
        attention.append(sum(e["dur"] for e in events if e.get("cat") == "Node" and start <= e["ts"] <= end
                             and e["name"].endswith("_kernel_time") and e["args"].get("op_name") in ATTENTION_OPS))
    return float(np.median([r["dur"] for r in runs])) / 1e3, float(np.median(attention)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--contexts", default="64,1024")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    samples: dict[int, list[tuple[float, float]]] = {c: [] for c in contexts}
    for p in range(args.passes):
        for c in contexts if p % 2 == 0 else contexts[::-1]:
            samples[c].append(profile_steps(args.artifact, c, args.steps, args.threads))
    rows = {}
    for c, values in samples.items():
        total, attention = (float(np.median([v[i] for v in values])) for i in (0, 1))
        rows[c] = {"step_ms": round(total, 3), "attention_ms": round(attention, 3), "rest_ms": round(total - attention, 3)}
    first, last = rows[contexts[0]], rows[contexts[-1]]
    result = {"artifact": str(args.artifact), "passes": args.passes, "by_context": rows,
              "step_ratio": round(last["step_ms"] / first["step_ms"], 3),
              "rest_ratio": round(last["rest_ms"] / first["rest_ms"], 3), "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
