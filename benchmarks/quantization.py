"""What each quantization scheme costs and buys on one model: quality and decode speed vs fp32.

    python benchmarks/quantization.py ART --data CALIB --eval-data HELDOUT --out DIR [--json F]

Calibrates ART with every variant (reusing DIR/<variant> when present and --reuse is given),
takes perplexity ratio, top-1 agreement and mean KL from each artifact's quality.json (all on
the same held-out windows), then times single-sequence decode of all artifacts side by side:
interleaved rounds, median per artifact, so machine noise hits every variant alike. Prints a
table and the targets from the issue; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

VARIANTS = {
    "w8a8": dict(scheme="w8a8", method="percentile"),
    "w8a8-sq": dict(scheme="w8a8", method="percentile", smoothquant=0.5),
    "w8a8-entropy-sq": dict(scheme="w8a8", method="entropy", smoothquant=0.5),
    "w8": dict(scheme="w8"),
    "w4": dict(scheme="w4", block_size=32),
    # `llmx calibrate --scheme X` with no other flag: the accuracy-aware search (calibration/search.py)
    "w8a8-search": dict(scheme="w8a8", search=True),
    "w8-search": dict(scheme="w8", search=True),
    "w4-search": dict(scheme="w4", search=True),  # a block_size here would fix the search's block size
}
TARGETS = {"w8a8": 1.02, "w8a8-sq": 1.02, "w8a8-entropy-sq": 1.02, "w8": 1.005, "w4": 1.05,  # max perplexity ratio
           "w8a8-search": 1.02, "w8-search": 1.005, "w4-search": 1.03}


def calibrate(art: Path, out: Path, name: str, args) -> dict:
    from llmx.calibration import CalibrationOptions, calibrate_artifact

    from llmx.calibration.report import format_report
    from llmx.calibration.search import SearchSpace

    target = out / name
    if not (args.reuse and (target / "quality.json").is_file()):
        settings = dict(VARIANTS[name])
        settings["search"] = SearchSpace() if settings.pop("search", False) else None
        options = CalibrationOptions(**settings, samples=args.samples, seq_len=args.seq_len,
                                     eval_samples=args.eval_samples, threads=args.threads)
        start = time.perf_counter()
        calibrate_artifact(art, target, args.data, options, eval_data=args.eval_data, force=True,
                           log=lambda msg: print(msg, file=sys.stderr))
        print(f"{name}: calibrated in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    report = json.loads((target / "quality.json").read_text())
    if "search" in report:
        print(f"{name}:\n{format_report(report)}")
    return report


def decode_rate(backend, prompt: int, steps: int) -> float:
    cache = backend.new_cache(1, prompt + steps + 1)
    backend.prefill(cache, [0], [list(range(3, 3 + prompt))])
    token = np.array([[5]], dtype=np.int64)
    backend.decode(cache, token)  # first call pays for lazy allocations
    start = time.perf_counter()
    for _ in range(steps):
        backend.decode(cache, token)
    return steps / (time.perf_counter() - start)


def decode_speeds(artifacts: dict[str, Path], args) -> dict[str, list[float]]:
    from llmx.artifact import Artifact
    from llmx.runtime.engine import make_backend

    backends = {n: make_backend(Artifact.open(p), "ort-cpu", threads=args.threads) for n, p in artifacts.items()}
    rates: dict[str, list[float]] = {n: [] for n in artifacts}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            rates[name].append(decode_rate(backend, args.prompt, args.steps))
    return rates


def table(quality: dict[str, dict], rates: dict[str, list[float]]) -> str:
    base = float(np.median(rates["fp32"]))
    rows = [f"{'variant':16}{'ppl':>10}{'ratio':>9}{'target':>10}{'top-1':>8}{'KL':>9}{'MiB/graph':>10}{'tok/s':>8}{'vs fp32':>9}"]
    for name, rate in rates.items():
        q = quality.get(name)
        speed = float(np.median(rate))
        if q is None:
            first = next(iter(quality.values()))
            size = max(first["fp32"]["graph_bytes"].values()) / 2**20
            rows.append(f"{name:16}{first['fp32']['perplexity']:>10.3f}{'':>9}{'':>10}{'':>8}{'':>9}{size:>10.1f}"
                        f"{speed:>8.1f}{1:>8.2f}x")
            continue
        ok = "ok" if q["perplexity_ratio"] <= TARGETS[name] else "MISS"
        size = max(q["quantized"]["graph_bytes"].values()) / 2**20
        rows.append(f"{name:16}{q['quantized']['perplexity']:>10.3f}{q['perplexity_ratio']:>8.4f}x"
                    f"{f'<={TARGETS[name]} {ok}':>11}{q['top1_agreement']:>8.2%}{q['mean_kl']:>9.5f}{size:>10.1f}"
                    f"{speed:>8.1f}{speed / base:>8.2f}x")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="fp32 artifact")
    parser.add_argument("--data", required=True, help="calibration text (file, JSONL or folder)")
    parser.add_argument("--eval-data", default=None, help="held-out text for the quality report")
    parser.add_argument("--out", type=Path, required=True, help="directory for the quantized artifacts")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median reported)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens before timing decode")
    parser.add_argument("--reuse", action="store_true", help="keep quantized artifacts already in --out")
    parser.add_argument("--no-speed", action="store_true", help="quality only")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    quality = {name: calibrate(args.artifact, args.out, name, args) for name in names}
    artifacts = {"fp32": args.artifact, **{n: args.out / n for n in names}}
    rates = {n: [float("nan")] for n in artifacts} if args.no_speed else decode_speeds(artifacts, args)
    print(table(quality, rates))
    if args.json:
        args.json.write_text(json.dumps({"quality": quality, "decode_tokens_per_s": rates,
                                         "settings": {k: str(v) for k, v in vars(args).items()}}, indent=2))


if __name__ == "__main__":
    main()
