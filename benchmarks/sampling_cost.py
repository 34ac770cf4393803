"""What sampling costs per row, and what it takes from a batched decode step.

    python benchmarks/sampling_cost.py                          # synthetic 49k-token logits
    python benchmarks/sampling_cost.py --artifact ART [--rows 32] [--tokens 48]

1. ``sample`` per row for the settings clients send (temperature alone, top-p, top-k + top-p,
   min-p), on logits from ART run over stdlib text (its real next-token distributions) or,
   without ART, on synthetic Zipf-shaped logits of a 49,152-token vocabulary.
2. With ART: ``Engine.generate`` of --rows prompts at once, --tokens each, greedy and with each
   setting (best of 3): sampled tok/s against greedy says what sampling costs a step.

Prints tables and writes benchmarks/results/sampling_cost_<date>.json. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
import timeit
from datetime import datetime
from pathlib import Path

import numpy as np

from llmx.runtime.sampling import SamplingParams, sample

SETTINGS = {
    "temperature 0.8": dict(temperature=0.8),
    "temperature 1.0, top_p 0.95": dict(temperature=1.0, top_p=0.95),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 50, top_p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "temperature 1.0, min_p 0.05": dict(temperature=1.0, min_p=0.05),
}


def real_logits(engine, positions: int = 256) -> np.ndarray:
    """Next-token logits of ``engine``'s model over stdlib prose, one decode step at a time."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py").read_text()[:20000]
    ids = engine.encode(text)[: positions + 1]
    backend = engine.backend
    cache = backend.new_cache(1, len(ids) + 1)
    backend.prefill(cache, [0], [ids[:1]])
    return np.stack([backend.decode(cache, np.array([[t]]))[0, -1].copy() for t in ids[1:]])


def synthetic_logits(rows: int = 256, vocab: int = 49152) -> np.ndarray:
    rng = np.random.default_rng(0)
    ranks = np.arange(1, vocab + 1)
    out = np.empty((rows, vocab), np.float32)
    for r in range(rows):
        steep = rng.uniform(0.8, 2.0)  # some rows peaked, some flat, as a model's are
        out[r] = rng.permutation(-steep * np.log(ranks) + rng.normal(0, 0.3, vocab))
    return out


def per_row_us(logits: np.ndarray) -> dict[str, float]:
    rng = np.random.default_rng(0)
    result = {}
    for name, kw in SETTINGS.items():
        params = SamplingParams(**kw)
        seconds = min(timeit.repeat(lambda p=params: [sample(row.copy(), p, rng) for row in logits], number=1, repeat=5))
        result[name] = seconds / len(logits) * 1e6
    return result


def batched_tok_s(engine, rows: int, tokens: int) -> dict[str, float]:
    prompts = [f"Question {i}: explain how a hash map handles collisions." for i in range(rows)]
    result = {}
    for name, kw in {"greedy": dict(temperature=0), **SETTINGS}.items():
        params = [SamplingParams(max_new_tokens=tokens, ignore_eos=True, seed=i, **kw) for i in range(rows)]
        engine.generate(prompts[:2], params[:2])
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            engine.generate(prompts, params)
            best = min(best, time.perf_counter() - start)
        result[name] = rows * tokens / best
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    engine = None
    if args.artifact:
        from llmx.runtime.engine import Engine

        engine = Engine.load(args.artifact, threads=args.threads)
        logits, source = real_logits(engine), f"{args.artifact.name} over stdlib prose"
    else:
        logits, source = synthetic_logits(), "synthetic Zipf-shaped"
    report = {"date": datetime.now().isoformat(timespec="minutes"), "logits": source, "vocab": logits.shape[1],
              "per_row_us": per_row_us(logits)}
    print(f"sample() per row, {logits.shape[1]}-token vocabulary, {source} logits ({len(logits)} rows)")
    print("| setting | us per row |\n|---|---:|")
    for name, us in report["per_row_us"].items():
        print(f"| {name} | {us:.0f} |")
    if engine is not None:
        tok_s = batched_tok_s(engine, args.rows, args.tokens)
        report["batched"] = {"rows": args.rows, "tokens": args.tokens, "tok_s": tok_s}
        print(f"\ngenerate, {args.rows} rows x {args.tokens} tokens, best of 3")
        print("| setting | tok/s | vs greedy |\n|---|---:|---:|")
        for name, value in tok_s.items():
            print(f"| {name} | {value:.0f} | {value / tok_s['greedy']:.2f}x |")
    out = Path(__file__).parent / "results" / f"sampling_cost_{datetime.now():%Y-%m-%d_%H%M}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
