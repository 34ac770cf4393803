"""What the weight-only block size costs in speed: decode step and TTFT per ``--block-size``.

    python benchmarks/block_size.py ART [--schemes w4,w8] [--sizes 32,64,128] [--threads 1,2] [--rounds 4]

ART is an fp32 (optimized) artifact. Each (scheme, block size) is quantized once with
``llmx calibrate --no-search --no-awq`` (round-to-nearest, the quality report on 2 short windows)
into ``--work`` (default benchmarks/.cache/block_size/<ART name>/), then all of them are loaded in
one process per thread count and take turns, round by round (a busy host slows all alike): greedy,
batch 1, a ``--prompt-len`` prompt and ``--new-tokens`` tokens, the loop ``llmx bench`` times.
Prints the median decode step and TTFT per artifact, their ratio to block 32 (the old default and
onnxruntime-genai's), and each build's perplexity ratio, as a table and JSON
(benchmarks/results/block_size_<name>_<date>.{md,json}). Why it matters: calibrate's search tries
block 128 first and keeps it when the quality target holds (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(art: Path, scheme: str, size: int, out: Path, data: Path) -> Path:
    if not (out / "llmx.json").is_file():
        subprocess.run([str(Path(sys.executable).parent / "llmx"), "calibrate", str(art), "--data", str(data), "--scheme", scheme,
                        "--block-size", str(size), "--no-search", "--no-awq", "--samples", "2", "--eval-samples", "2",
                        "--seq-len", "128", "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def measure(paths: dict[str, Path], threads: int, args) -> dict[str, dict]:
    from llmx.runtime.bench import run_once
    from llmx.runtime.engine import Engine

    engines = {name: Engine.load(str(p), threads=threads, spin=threads > 1) for name, p in paths.items()}
    prompt = list(range(100, 100 + args.prompt_len))
    steps: dict[str, list[float]] = {name: [] for name in engines}
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        run_once(engine.backend, engine.tokenizer, [prompt], 8)
    for rnd in range(args.rounds):
        names = list(engines)
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            times = run_once(engines[name].backend, engines[name].tokenizer, [prompt], args.new_tokens)
            steps[name].append(1e3 * statistics.median(times.steps_s))
            ttft[name].append(1e3 * times.ttft_s)
    return {name: {"step_ms": statistics.median(steps[name]), "ttft_ms": statistics.median(ttft[name]),
                   "step_rounds": steps[name], "ttft_rounds": ttft[name]} for name in engines}


def markdown(report: dict) -> str:
    lines = [f"Block size, {report['artifact']} ({report['date']}, 1-min load {report['load'][0]:.2f} -> "
             f"{report['load'][1]:.2f}), prompt {report['prompt_len']}, {report['new_tokens']} new tokens, "
             f"{report['rounds']} interleaved rounds", ""]
    for threads, rows in report["threads"].items():
        lines += [f"### {threads} thread(s)", "",
                  "| scheme | block | decode step ms | x block 32 | TTFT ms | x block 32 | perplexity ratio |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, row in rows.items():
            scheme, size = name.split("-b")
            base = rows.get(f"{scheme}-b32")
            step_x = f"{row['step_ms'] / base['step_ms']:.2f}" if base else "-"
            ttft_x = f"{row['ttft_ms'] / base['ttft_ms']:.2f}" if base else "-"
            ppl = report["perplexity_ratio"][name]
            lines.append(f"| {scheme} | {size} | {row['step_ms']:.2f} | {step_x} | {row['ttft_ms']:.1f} | {ttft_x} | "
                         f"{ppl:.4f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    import email

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--schemes", default="w4,w8")
    parser.add_argument("--sizes", default="32,64,128")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=Path(email.__file__).parent,
                        help="calibration text (default: the stdlib's email package)")
    args = parser.parse_args()
    work = args.work or HERE / ".cache" / "block_size" / args.artifact.resolve().name
    paths = {f"{s}-b{n}": build(args.artifact, s, int(n), work / f"{s}-b{n}", args.data)
             for s in args.schemes.split(",") for n in args.sizes.split(",")}
    load = [os.getloadavg()[0]]
    report = {"artifact": str(args.artifact), "date": time.strftime("%Y-%m-%d %H:%M"), "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "rounds": args.rounds,
              "perplexity_ratio": {name: json.loads((p / "quality.json").read_text())["perplexity_ratio"]
                                   for name, p in paths.items()},
              "threads": {t: measure(paths, int(t), args) for t in args.threads.split(",")}}
    report["load"] = load + [os.getloadavg()[0]]
    text = markdown(report)
    print(text)
    art = args.artifact.resolve()
    stem = HERE / "results" / f"block_size_{art.parent.name}-{art.name}_{time.strftime('%Y-%m-%d_%H%M')}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
