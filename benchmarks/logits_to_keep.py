"""What ``logits_to_keep`` saves: single-prompt prefill on the decode graph, LM head on the last
position (fed 1, what the runtime does) against every position (fed 0, what artifacts exported
before the input cost), and the prefill graph's own session for reference (what
LLMX_PREFILL_SESSION=eager buys, with a second packed copy of the weights).

    python benchmarks/logits_to_keep.py ART [--prompt-len 128] [--rounds 10] [--threads N]

Both settings run on one session and one KV cache, alternating round by round (a busy host slows
both alike); prints the median prefill ms of each, their ratio and the logits buffer's size, as a
table and JSON. The artifact's decode graph must declare the input (this llmx's export/optimize).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from llmx.artifact import Artifact
from llmx.runtime.onnx_backend import OrtBackend


def time_prefill(backend: OrtBackend, prompt: np.ndarray, how: str) -> tuple[float, int]:
    """ms for one prefill of ``prompt`` [1, T] into a fresh cache row, and the logits buffer bytes."""
    cache = backend.new_cache(1, prompt.shape[1])
    start = time.perf_counter()
    if how == "prefill graph":
        logits = backend.prefill(cache, [0], prompt.tolist())
    else:
        logits = backend._decode(cache, prompt, 0, last_only=how == "decode, keep 1")
    return (time.perf_counter() - start) * 1e3, logits.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    backend = OrtBackend(Artifact.open(args.artifact), threads=args.threads, lazy_prefill=False)
    if not backend.keeps_logits:
        raise SystemExit(f"error: {args.artifact}'s decode graph has no logits_to_keep input; re-export it")
    prompt = np.random.default_rng(0).integers(3, backend.vocab_size, (1, args.prompt_len), dtype=np.int64)
    times: dict[str, list[float]] = {"decode, keep 1": [], "decode, keep 0 (all)": [], "prefill graph": []}
    sizes = {}
    for _ in range(2):  # warm-up: first runs allocate
        for how in times:
            time_prefill(backend, prompt, how)
    for _ in range(args.rounds):
        for how in times:
            ms, sizes[how] = time_prefill(backend, prompt, how)
            times[how].append(ms)
    median = {how: round(statistics.median(v), 2) for how, v in times.items()}
    result = {"artifact": str(args.artifact), "prompt_len": args.prompt_len, "rounds": args.rounds,
              "threads": backend.cpu_plan.threads, "prefill_ms": median, "logits_bytes": sizes,
              "all_over_keep1": round(median["decode, keep 0 (all)"] / median["decode, keep 1"], 3),
              "keep1_over_prefill_graph": round(median["decode, keep 1"] / median["prefill graph"], 3)}
    print(f"{'prefill on':<24}{'ms (median)':>14}{'logits MB':>12}")
    for how in times:
        print(f"{how:<24}{median[how]:>14.2f}{sizes[how] / 1e6:>12.2f}")
    print(f"all positions / keep 1: {result['all_over_keep1']:.3f}x; keep 1 / prefill graph: {result['keep1_over_prefill_graph']:.3f}x")
    print(json.dumps(result))

if __name__ == "__main__":
    main()
