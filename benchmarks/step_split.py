"""Where a decode step's time goes: the graph run, input binding, sampling, and the rest of Python.

    python benchmarks/step_split.py ART [--steps 128] [--prompt-len 128] [--threads N] [--spin|--no-spin]

Runs ``llmx bench``'s loop (runtime/bench.run_once: Batch.step = bind inputs, run the decode graph,
choose the token, accept it and detokenize) with timers around each part, greedy, batch 1, and
prints the median per part over all steps (ms and share of the step) as a table and JSON. The
timers themselves cost ~1 us per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

from llmx.runtime import onnx_backend
from llmx.runtime.bench import prompt_ids, run_once
from llmx.runtime.engine import Engine
from llmx.runtime.sequence import Sequence


class Timers:
    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - t0

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def split(engine: Engine, prompt_len: int, steps: int, repeat: int) -> dict:
    backend = engine.backend
    timers = Timers()
    timers.wrap(backend.sessions["decode"], "run_with_iobinding", "graph run")
    timers.wrap(onnx_backend, "bind_decode_inputs", "bind inputs")
    timers.wrap(Sequence, "choose", "sampling (choose)")
    timers.wrap(Sequence, "accept", "accept + detokenize")
    per_step: dict[str, list[float]] = defaultdict(list)
    prompt = prompt_ids(prompt_len, backend.vocab_size)
    batch_step = None
    import llmx.runtime.batch as batch_module

    original_step = batch_module.Batch.step

    def step(self):
        nonlocal batch_step
        timers.take()
        t0 = time.perf_counter()
        events = original_step(self)
        total = time.perf_counter() - t0
        parts = timers.take()
        for label, seconds in parts.items():
            per_step[label].append(seconds * 1e3)
        per_step["step total"].append(total * 1e3)
        per_step["other Python"].append((total - sum(parts.values())) * 1e3)
        return events

    batch_module.Batch.step = step
    try:
        run_once(backend, engine.tokenizer, [prompt], steps)  # warm-up
        per_step.clear()
        for _ in range(repeat):
            run_once(backend, engine.tokenizer, [prompt], steps)
    finally:
        batch_module.Batch.step = original_step
    medians = {label: statistics.median(v) for label, v in per_step.items()}
    return {"median_ms": medians, "share_of_step": {k: v / medians["step total"] for k, v in medians.items()},
            "steps": len(per_step["step total"]), "cpu_plan": backend.cpu_plan.describe()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--spin", dest="spin", action="store_true", default=None)
    ap.add_argument("--no-spin", dest="spin", action="store_false")
    args = ap.parse_args()
    options = {"threads": args.threads} | ({} if args.spin is None else {"spin": args.spin})
    result = split(Engine.load(args.artifact, **options), args.prompt_len, args.steps, args.repeat)
    print(f"{args.artifact}: {result['steps']} decode steps, {result['cpu_plan']}")
    for label in ("graph run", "bind inputs", "sampling (choose)", "accept + detokenize", "other Python", "step total"):
        ms = result["median_ms"].get(label, 0.0)
        print(f"  {label:22s} {ms:8.3f} ms  {100 * result['share_of_step'].get(label, 0.0):5.1f} %")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
