"""llmx with NO flags against onnxruntime-genai at 1 and 2 threads, on a quiet and a busy host (issue 17).

    python benchmarks/fast_default.py                      # SmolLM-135M shape, fp32/w8/w4, quiet host
    python benchmarks/fast_default.py --hosts quiet,busy   # the same, then with a CPU-burning neighbour
    python benchmarks/fast_default.py --shape tinyllama-1.1b --hosts quiet,busy   # fp32 and w4 (int4)
    python benchmarks/fast_default.py --shape tinyllama-1.1b --build-only          # build, measure nothing

Per precision (fp32; w8 = llmx calibrate w8 vs genai int8; w4 vs genai int4) three engines, each
in its own process (benchmarks/engines.py), are loaded together and take turns run by run:
``llmx`` as a user gets it with no flags (Engine.load defaults: thread count and spin policy
chosen at start-up), genai with ``intra_op_num_threads`` 1 and 2. After a warm-up, ``--rounds``
greedy generations of ``--new-tokens`` tokens after a ``--prompt-len`` prompt, batch 1. Ratios to
genai's faster setting are taken within each round, then the median. PSS is read after the runs.

``busy`` starts a neighbour process that burns one core (``while True: pass``) before the
engines load, and stops it after; every engine meets it alike. Models are built once under
``--work`` (default benchmarks/.cache/<shape>/; the 1.1B shape takes several minutes and ~15 GB
of disk). Writes benchmarks/results/fast_default_<shape>_<date>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_cpu import ENGINES, Worker, build_model, write_prompts  # noqa: E402
from peers import PEERS_PYTHON, has_module, start_neighbour  # noqa: E402
from roofline import artifact_step_bytes, genai_step_bytes, step_floor_ms, stream_gb_s  # noqa: E402
from smollm_shape import SHAPES  # noqa: E402

# precision -> (llmx model key, genai model key); the genai keys build with genai's own builder.
MODELS = {"fp32": ("art-opt", "genai"), "w8": ("art-opt-w8", "genai-int8"), "w4": ("art-opt-w4", "genai-int4")}
SHAPE_PRECISIONS = {"smollm-135m": "fp32,w8,w4", "tinyllama-1.1b": "fp32,w4"}
# A 1.1B model's calibration report (perplexity before/after) on two windows keeps the build in minutes,
# and plain round-to-nearest w4 like genai's builder: random weights cannot meet a perplexity target,
# so the search would try every recipe (minutes each at 1.1B) for a speed benchmark that needs none.
# Block 128 is what the search builds first when the target holds (--no-search alone would build 32),
# fixed here because random weights make the 1.1B search pointless.
SHAPE_CALIBRATE = {"smollm-135m": (), "tinyllama-1.1b": ("--samples", "2", "--eval-samples", "2", "--seq-len", "128",
                                                         "--no-search", "--no-awq", "--block-size", "128")}


def engines_for(precision: str) -> dict[str, tuple]:
    """name -> (worker kind, model key, python, extra args): llmx with no flags, genai at 1 and 2 threads."""
    art, genai = MODELS[precision]
    return {
        f"llmx-{precision}": ("llmx", art, sys.executable, []),
        f"genai-{precision}-1t": ("genai", genai, PEERS_PYTHON, ["--threads", "1"]),
        f"genai-{precision}-2t": ("genai", genai, PEERS_PYTHON, ["--threads", "2"]),
    }


def run_group(precision: str, paths: dict[str, Path], prompt_file: Path, args, log) -> dict[str, dict]:
    """Load the precision's three engines together, warm them up, let them take turns ``args.rounds`` times."""
    group = engines_for(precision)
    ENGINES.update(group)  # compare_cpu.Worker looks its engine up there
    workers = []
    try:
        for name in group:
            log(f"loading {name}")
            workers.append(Worker(name, paths, prompt_file))
        results = {w.name: {"runs": [], "load_s": w.ready["load_s"], "plan": w.ready.get("plan"),
                            "threads": w.ready.get("threads")} for w in workers}
        for w in workers:
            w.ask(f"run {args.new_tokens}")
        for rnd in range(args.rounds):
            shift = rnd % len(workers)
            for w in workers[shift:] + workers[:shift]:
                results[w.name]["runs"].append(w.run(args.new_tokens))
        for w in workers:
            memory = w.ask("rss")
            results[w.name].update(peak_rss_mb=memory["peak_rss_mb"], pss_mb=memory.get("pss_mb"))
    finally:
        for w in workers:
            w.close()
    return results


def roofline(summary: dict, precision: str, paths: dict[str, Path], gb_s: dict[int, float], context: int) -> dict:
    """Each engine's median step against the fastest step its bytes allow at its thread count
    (benchmarks/roofline.py): near 1.0 is memory-bound, where no rewrite of graph or loop helps."""
    art, genai = MODELS[precision]
    step_bytes = {"llmx": artifact_step_bytes(paths[art], context), "genai": genai_step_bytes(paths[genai], context)}
    out = {"stream_gb_s": gb_s, "context": context, "step_mb": {k: round(v / 1e6, 1) for k, v in step_bytes.items()},
           "engines": {}}
    for name, row in summary["engines"].items():
        floor = step_floor_ms(step_bytes[name.split("-")[0]], gb_s[row["threads"]])
        step = 1e3 / row["decode_tok_s"]
        out["engines"][name] = {"floor_ms": round(floor, 2), "step_ms": round(step, 2), "floor_over_step": round(floor / step, 3)}
    return out


def summarize(results: dict[str, dict], precision: str) -> dict:
    """Medians per engine and llmx's per-round ratios to genai's faster thread setting in that round."""
    rows = {}
    for name, r in results.items():
        decode = [len(run["steps_s"]) / sum(run["steps_s"]) for run in r["runs"]]
        ttft = [run["ttft_s"] * 1e3 for run in r["runs"]]
        rows[name] = {"decode_tok_s": statistics.median(decode), "ttft_ms": statistics.median(ttft),
                      "decode_runs": decode, "ttft_runs": ttft, "pss_mb": r["pss_mb"], "peak_rss_mb": r["peak_rss_mb"],
                      "load_s": r["load_s"], "plan": r.get("plan"), "threads": r.get("threads"),
                      "tokens": r["runs"][-1]["token_ids"]}
    llmx, g1, g2 = (rows[f"llmx-{precision}"], rows[f"genai-{precision}-1t"], rows[f"genai-{precision}-2t"])
    best = "2t" if g2["decode_tok_s"] >= g1["decode_tok_s"] else "1t"
    decode_ratios = [d / max(a, b) for d, a, b in zip(llmx["decode_runs"], g1["decode_runs"], g2["decode_runs"])]
    ttft_ratios = [t / min(a, b) for t, a, b in zip(llmx["ttft_runs"], g1["ttft_runs"], g2["ttft_runs"])]
    genai_best = rows[f"genai-{precision}-{best}"]
    return {
        "engines": rows, "genai_best_threads": best,
        "decode_x_genai_best": statistics.median(decode_ratios), "decode_ratio_rounds": decode_ratios,
        "ttft_x_genai_best": statistics.median(ttft_ratios), "ttft_ratio_rounds": ttft_ratios,
        "pss_x_genai_best": llmx["pss_mb"] / genai_best["pss_mb"] if llmx["pss_mb"] and genai_best["pss_mb"] else None,
        "same_tokens": llmx["tokens"] == g1["tokens"] == g2["tokens"],
    }


def markdown(report: dict) -> str:
    lines = []
    for host, by_precision in report["hosts"].items():
        lines += [f"### {report['shape']}, {host} host (1-min load {report['load'][host][0]} -> {report['load'][host][1]})", "",
                  "| precision | llmx decode tok/s | genai 1t | genai 2t | decode x genai best | llmx TTFT ms | genai 1t | "
                  "genai 2t | TTFT x genai best | llmx PSS MB | genai best PSS MB | PSS x | same tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for p, s in by_precision.items():
            e = s["engines"]
            llmx, g1, g2 = e[f"llmx-{p}"], e[f"genai-{p}-1t"], e[f"genai-{p}-2t"]
            best = e[f"genai-{p}-{s['genai_best_threads']}"]
            pss_x = f"{s['pss_x_genai_best']:.2f}" if s["pss_x_genai_best"] else "-"
            lines.append(f"| {p} | {llmx['decode_tok_s']:.1f} | {g1['decode_tok_s']:.1f} | {g2['decode_tok_s']:.1f} | "
                         f"**{s['decode_x_genai_best']:.2f}** | {llmx['ttft_ms']:.0f} | {g1['ttft_ms']:.0f} | "
                         f"{g2['ttft_ms']:.0f} | **{s['ttft_x_genai_best']:.2f}** | {llmx['pss_mb']:.0f} | "
                         f"{best['pss_mb']:.0f} | {pss_x} | {s['same_tokens']} |")
        plans = sorted({s["engines"][f"llmx-{p}"].get("plan") or "?" for p, s in by_precision.items()})
        lines += ["", f"llmx chose: {'; '.join(plans)}", ""]
        roofs = {p: s["roofline"] for p, s in by_precision.items() if s.get("roofline")}
        if roofs:
            gb_s = next(iter(roofs.values()))["stream_gb_s"]
            lines += [f"Memory roofline (benchmarks/roofline.py): ONNX Runtime's MatMul streams fp32 weights at "
                      f"{gb_s[1]:.1f} GB/s on 1 thread, {gb_s[2]:.1f} on 2; floor = bytes a step reads / that speed.", "",
                      "| precision | MB per step llmx | genai | llmx step ms | floor ms | floor / step | "
                      "genai 1t step | floor / step | genai 2t step | floor / step |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for p, r in roofs.items():
                cells = []
                for name in (f"llmx-{p}", f"genai-{p}-1t", f"genai-{p}-2t"):
                    e = r["engines"][name]
                    cells += [f"{e['step_ms']:.2f}"] + ([f"{e['floor_ms']:.2f}"] if name.startswith("llmx") else []) + \
                             [f"{e['floor_over_step']:.0%}"]
                lines.append(f"| {p} | {r['step_mb']['llmx']:.0f} | {r['step_mb']['genai']:.0f} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hosts = list(report["hosts"])
    fig, axes = plt.subplots(1, len(hosts), figsize=(5 * len(hosts), 3.6), squeeze=False)
    for ax, host in zip(axes[0], hosts):
        precisions = list(report["hosts"][host])
        for k, (label, suffix) in enumerate([("llmx (no flags)", None), ("genai 1 thread", "1t"), ("genai 2 threads", "2t")]):
            values = [report["hosts"][host][p]["engines"][f"llmx-{p}" if suffix is None else f"genai-{p}-{suffix}"]
                      ["decode_tok_s"] for p in precisions]
            ax.bar([i + (k - 1) * 0.27 for i in range(len(precisions))], values, 0.27, label=label)
        ax.set_xticks(range(len(precisions)), precisions)
        ax.set_title(f"{report['shape']}, {host} host")
        ax.set_ylabel("decode tok/s (batch 1)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m")
    ap.add_argument("--hosts", default="quiet", help="comma list of quiet,busy (busy: a neighbour burns one core)")
    ap.add_argument("--busy", action="store_true", help="the same as --hosts busy")
    ap.add_argument("--precisions", default=None, help="comma list of fp32,w8,w4 (default: all for the 135M shape, "
                                                          "fp32,w4 for the 1.1B)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--work", type=Path, default=None, help="model cache (default benchmarks/.cache/<shape>)")
    ap.add_argument("--calib-data", type=Path, default=Path(sysconfig.get_paths()["stdlib"]) / "email")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    hosts = ["busy"] if args.busy else args.hosts.split(",")
    precisions = (args.precisions or SHAPE_PRECISIONS[args.shape]).split(",")
    work = args.work or HERE / ".cache" / args.shape
    if not has_module("onnxruntime_genai"):
        sys.exit("onnxruntime-genai is not installed in benchmarks/.peers-venv: run benchmarks/setup_peers.sh")

    started = time.time()
    paths: dict[str, Path] = {}
    for p in precisions:
        for key in MODELS[p]:
            build_model(key, work, paths, args.calib_data, log, args.shape, SHAPE_CALIBRATE[args.shape])
    if args.build_only:
        log(f"built {', '.join(paths)} under {work}")
        return
    prompt_file = write_prompts(work / "prompts.json", args.prompt_len, [], SHAPES[args.shape]["vocab_size"])
    report = {"shape": args.shape, "model": {k: SHAPES[args.shape][k] for k in ("hidden_size", "num_hidden_layers",
                                                                                 "intermediate_size", "vocab_size")},
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": 1, "rounds": args.rounds,
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"), "hosts": {}, "load": {},
              "command": " ".join(["python", *sys.argv])}
    stem = args.out / f"fast_default_{args.shape}_{time.strftime('%Y-%m-%d_%H%M')}"
    args.out.mkdir(parents=True, exist_ok=True)
    for host in hosts:
        neighbour = start_neighbour() if host == "busy" else None
        load_start = round(os.getloadavg()[0], 2)
        try:
            report["hosts"][host] = {}
            log(f"{host} host: weight streaming speed (roofline)")
            gb_s = {threads: round(stream_gb_s(threads), 2) for threads in (1, 2)}
            for p in precisions:
                log(f"{host} host: {p}")
                summary = summarize(run_group(p, paths, prompt_file, args, log), p)
                summary["roofline"] = roofline(summary, p, paths, gb_s, args.prompt_len + args.new_tokens // 2)
                report["hosts"][host][p] = summary
                report["load"][host] = (load_start, round(os.getloadavg()[0], 2))
                text = write(report, stem, started)  # after every group: an interrupted run keeps what it measured
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
    plot(report, _named(stem, ".png"))
    print(text)
    log(f"wrote {stem}.{{json,md,png}}")


def _named(stem: Path, suffix: str) -> Path:
    # Not stem.with_suffix: "tinyllama-1.1b_<date>" would lose everything after "1." as a suffix.
    return stem.with_name(stem.name + suffix)


def write(report: dict, stem: Path, started: float) -> str:
    report["wall_s"] = round(time.time() - started)
    text = f"Measured {report['date']}, {report['wall_s']} s, `{report['command']}`\n\n" + markdown(report)
    _named(stem, ".json").write_text(json.dumps(report, indent=1))
    _named(stem, ".md").write_text(text)
    return text

if __name__ == "__main__":
    main()
