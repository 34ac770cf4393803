"""``llmx calibrate`` artifacts side by side with llama.cpp's quantized GGUFs of the same checkpoint.

    python benchmarks/calibrate_peers.py --hf CKPT --data CALIB --eval-data HELDOUT --work DIR [--reuse]
           [--rounds 3] [--windows N] [--name NAME] [--out DIR] [--quick]

    # e.g. SmolLM2-135M-Instruct (the checkpoint benchmarks/gguf_import.py rebuilds):
    python benchmarks/calibrate_peers.py --hf /tmp/llmx-gguf-import/hf --data /tmp/c34/calib.txt \\
           --eval-data /tmp/c34/heldout.txt --work /tmp/cpeers --name smollm2-135m-instruct --reuse

From one Hugging Face checkpoint directory:

1. llmx: ``llmx export`` + ``llmx optimize`` (the fp32 artifact), then ``llmx calibrate --scheme w8``,
   ``w4`` and ``w8a8`` with the default flags (the accuracy-aware search), each timed (wall s, peak
   RSS by GNU time; benchmarks/big_model.measure, output in WORK/logs/); quality.json gives the perplexity ratio, the search record and
   calibration_seconds. A calibrate that exits non-zero (target not met) is recorded with its error
   line, and the run goes on without that artifact.
2. llama.cpp (tools from benchmarks/build_llama_server.sh, in benchmarks/.peers-build): its
   ``convert_hf_to_gguf.py --outtype f32``, then ``llama-quantize`` to Q8_0, Q4_K_M and Q4_0, timed
   the same way.
3. Quality, as benchmarks/gguf_import.py compares the two engines: the held-out text is cut to
   exactly N windows of 256 tokens (all the text holds, or --windows), then ``llmx eval --seq-len 256
   --score-from 128`` and ``llama-perplexity -c 256`` score the same tokens with the same context;
   each engine's perplexity is divided by its own fp32 / F32 perplexity.
4. Speed, batch 1, greedy, 2 threads, a 128-token prompt then 128 new tokens: llmx artifacts each in
   an engines.py worker process (the runtime's generate loop, no torch; benchmarks/compare_cpu.py's
   Worker), llama.cpp through ``llama-bench -p 128 -n 128 -d 0,128`` (decode = tg128 at depth 128,
   i.e. after the prompt; TTFT = the pp128 time). Engines take turns for --rounds rounds (the order
   rotates), medians per engine; the llmx/llama.cpp ratios are taken within each round, then the median.

Prints a table, writes benchmarks/results/calibrate_peers_<name>_<date>.json (and a .png when
matplotlib is installed). --reuse keeps artifacts, GGUFs and their recorded build timings under
--work (a failed calibrate's record too, so a search that misses its target is not rerun). --quick
(smoke test): 4 evaluation windows, 1 round, ``--samples 4 --eval-samples 4`` to calibrate; with
--reuse of an earlier export it runs in a few minutes. Run it alone: it times things on a 2-core box.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from big_model import failed, measure  # noqa: E402
from compare_cpu import ENGINES, Worker, write_prompts  # noqa: E402
from gguf_import import CONVERT, TOOLS, gguf_field, llama_ppl, llmx, measured  # noqa: E402
from quantization import TARGETS  # noqa: E402

SCHEMES = ("w8", "w4", "w8a8")
GGUF_TYPES = ("Q8_0", "Q4_K_M", "Q4_0")
# The speed ratios the comparison is about: each llmx scheme against llama.cpp's usual file of that width.
PAIRS = {"w8": "Q8_0", "w4": "Q4_K_M"}
SEQ_LEN = 256  # llmx's window length; llama-perplexity -c 256 scores the second half of each (gguf_import.py)
SCORE_FROM = SEQ_LEN // 2
QUICK_WINDOWS = 4
QUICK_SAMPLES = 4  # --quick: llmx calibrate --samples and --eval-samples
# Generic checkpoint folder names say nothing about the model; the result file is then named after the parent.
GENERIC_DIRS = {"hf", "ckpt", "checkpoint", "model"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- timed steps ---------------------------------------------------------------------------------

def error_line(stderr: str, timed: bool = True) -> str:
    """The last line the tool printed; ``timed``: its stderr came through GNU time (gguf_import.measured),
    whose own lines (a status line, then the %M peak last) are not the tool's."""
    lines = [l.strip() for l in stderr.strip().splitlines()[: -1 if timed else None] if l.strip()]
    lines = [l for l in lines if not l.startswith(("Command exited with", "Command terminated by"))]
    return lines[-1][:300] if lines else "no output"


def timed_step(name: str, cmd: list, work: Path) -> dict:
    """Run ``cmd`` under GNU time with big_model.measure: its output streams to WORK/logs/NAME.log as it
    runs (a search takes many minutes: the log shows where it is); peak RSS: the larger of the kernel's
    (GNU time) and the sampled process tree's."""
    result = measure(work, name, cmd)
    record = {"rc": result["rc"], "wall_s": result["wall_s"], "peak_rss_mib": round(result["peak_rss_bytes"] / 2**20, 1),
              "log": result["log"]}
    if result["rc"]:
        record["error"] = failed(result)
    return record


def shown(cmd: list) -> list[str]:
    """The command as recorded: the converter wrapper's source (an argument with newlines) by name."""
    return ["<CONVERT>" if "\n" in str(c) else str(c) for c in cmd]


def cached_step(name: str, cmd: list, output: Path, work: Path, reuse: bool) -> dict:
    """``cmd`` run by timed_step, or with --reuse the record saved when ``output`` was built by this same
    command (its timings are what the table shows: rebuilding a minutes-long search just to time it
    again is what --reuse avoids; another command, e.g. --quick's smaller calibration, builds anew).
    A failure's record is kept too: the output is then absent, the record says why."""
    saved = work / "records" / f"{name}.json"
    if reuse and saved.is_file():
        record = json.loads(saved.read_text())
        if record.get("cmd") == shown(cmd) and (record["rc"] or output.exists()):
            log(f"{name}: reusing {output if output.exists() else 'the recorded failure'}")
            return {**record, "reused": True}
    record = {**timed_step(name, cmd, work), "cmd": shown(cmd)}
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(record, indent=1))
    return record


# -- llmx side -----------------------------------------------------------------------------------

def llmx_fp32(hf: Path, work: Path, reuse: bool) -> tuple[Path, dict]:
    """``llmx export`` then ``llmx optimize``: the fp32 artifact every scheme is calibrated from."""
    portable, fp32 = work / "llmx-portable", work / "llmx-fp32"

    exported = cached_step("llmx-export", llmx("export", str(hf), "-o", str(portable), "--force"),
                           portable / "llmx.json", work, reuse)
    if exported["rc"]:
        sys.exit(f"llmx export failed: {exported['error']} (see {exported['log']})")
    optimized = cached_step("llmx-optimize", llmx("optimize", str(portable), "-o", str(fp32), "--force"),
                            fp32 / "llmx.json", work, reuse)
    if optimized["rc"]:
        sys.exit(f"llmx optimize failed: {optimized['error']} (see {optimized['log']})")
    return fp32, {"export": exported, "optimize": optimized,
                  "wall_s": round(exported["wall_s"] + optimized["wall_s"], 2),
                  "peak_rss_mib": max(exported["peak_rss_mib"], optimized["peak_rss_mib"])}


def search_summary(search: dict) -> dict:
    """What the table and JSON keep of quality.json's search record (the whole record stays in the artifact)."""
    chosen = search["candidates"][search["chosen"]]
    return {"target": search["target"], "met": search["met"], "chosen": chosen["label"],
            "candidates": len(search["candidates"]), "fallbacks": len(chosen["fallback"]),
            "search_s": search["seconds"]["search"]}


def calibrate(fp32: Path, scheme: str, args) -> tuple[Path, dict]:
    """``llmx calibrate --scheme SCHEME`` with the default flags (the search); timed, then quality.json."""
    out = args.work / f"llmx-{scheme}"
    cmd = llmx("calibrate", str(fp32), "--data", str(args.data), "--scheme", scheme, "-o", str(out), "--force",
               *args.calibrate_args)
    record = cached_step(f"calibrate-{scheme}", cmd, out / "quality.json", args.work, args.reuse)
    report_path = out / "quality.json"
    if record["rc"] or not report_path.is_file():
        return out, {**record, "ok": False}
    q = json.loads(report_path.read_text())
    quality = {"perplexity_ratio": q["perplexity_ratio"], "top1_agreement": q["top1_agreement"],
               "mean_kl": q["mean_kl"], "calibration_seconds": q.get("calibration_seconds"),
               "eval_windows": q.get("windows"), "options": q.get("options"),
               "target": TARGETS.get(f"{scheme}-search")}
    if "search" in q:
        quality["search"] = search_summary(q["search"])
    return out, {**record, "ok": True, "quality": quality}


# -- llama.cpp side ------------------------------------------------------------------------------

def llama_ggufs(hf: Path, work: Path, reuse: bool) -> dict[str, tuple[Path, dict]]:
    """F32 GGUF by llama.cpp's converter (gguf_import.CONVERT), then llama-quantize to each GGUF_TYPES."""
    folder = work / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    f32 = folder / "F32.gguf"
    convert = [sys.executable, "-c", CONVERT, TOOLS / "llama.cpp", hf, "--outtype", "f32", "--outfile", f32]
    record = cached_step("convert-F32", convert, f32, work, reuse)
    if record["rc"]:
        sys.exit(f"convert_hf_to_gguf.py failed: {record['error']} (see {record['log']})")
    files = {"F32": (f32, record)}
    for kind in GGUF_TYPES:
        path = folder / f"{kind}.gguf"
        # 2 threads, as gguf_import.py and big_model.py quantize
        cmd = [TOOLS / "llama-quantize", f32, path, kind, "2"]
        files[kind] = (path, cached_step(f"quantize-{kind}", cmd, path, work, reuse))
    return files


# -- quality on the same tokens ------------------------------------------------------------------

def held_out_windows(text: Path, art: Path, work: Path, windows: int | None) -> tuple[Path, int]:
    """The held-out text cut to exactly N windows of SEQ_LEN tokens (the artifact's tokenizer; llama.cpp
    tokenizes the converted file identically, gguf_import.py checks it): llmx eval then scores every
    window and llama-perplexity every chunk, so both see the same tokens with the same context."""
    from llmx.artifact import Artifact
    from llmx.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(Artifact.open(art))
    ids = tokenizer.encode(text.read_text())
    n = len(ids) // SEQ_LEN if windows is None else min(windows, len(ids) // SEQ_LEN)
    if n < 2:  # llama-perplexity refuses text shorter than two contexts
        sys.exit(f"{text} holds {len(ids)} tokens: need at least {2 * SEQ_LEN} for two {SEQ_LEN}-token windows")
    path = work / f"heldout-{n}x{SEQ_LEN}.txt"
    path.write_text(tokenizer.decode(ids[: n * SEQ_LEN]))
    return path, n


def llmx_perplexity(art: Path, text: Path, windows: int, threads: int) -> dict:
    out = subprocess.run(llmx("eval", str(art), "--data", str(text), "--samples", str(windows), "--seq-len",
                              str(SEQ_LEN), "--score-from", str(SCORE_FROM), "--threads", str(threads), "--json"),
                         capture_output=True, text=True)
    if out.returncode:
        return {"error": error_line(out.stderr, timed=False)}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"perplexity": result["perplexity"], "windows": result["windows"], "tokens": result["tokens"]}


def llama_perplexity(gguf: Path, text: Path, windows: int) -> dict:
    try:
        return {"perplexity": llama_ppl(gguf, text, windows)}
    except SystemExit as exc:  # gguf_import.llama_ppl exits on failure; here one file's failure is one row's
        lines = [l for l in str(exc).splitlines() if l.strip()]
        return {"error": " ".join(dict.fromkeys([lines[0], lines[-1]]))[:300] if lines else "llama-perplexity failed"}


def with_ratios(scores: dict[str, dict], base: str) -> dict[str, dict]:
    """Each engine's perplexity over its own fp32 one."""
    reference = scores.get(base, {}).get("perplexity")
    for score in scores.values():
        if reference and "perplexity" in score:
            score["ratio"] = score["perplexity"] / reference
    return scores


# -- speed ---------------------------------------------------------------------------------------

def llama_bench(gguf: Path, args) -> dict:
    """One llama-bench run: decode = tg at depth prompt-len (after a prompt, as llmx decodes), TTFT =
    the pp time of the prompt from an empty cache (llmx's TTFT: prefill plus the first token's pick)."""
    cmd = [TOOLS / "llama-bench", "-m", gguf, "-t", args.threads, "-p", args.prompt_len, "-n", args.new_tokens,
           "-d", f"0,{args.prompt_len}", "-r", "1", "-o", "json"]
    out, _, peak_gib = measured([str(c) for c in cmd])
    if out.returncode:
        return {"error": error_line(out.stderr)}
    tests = json.loads(out.stdout)
    pp = next(t for t in tests if t["n_prompt"] == args.prompt_len and t["n_gen"] == 0 and t["n_depth"] == 0)
    tg = next(t for t in tests if t["n_gen"] == args.new_tokens and t["n_depth"] == args.prompt_len)
    return {"decode_tok_s": tg["avg_ts"], "ttft_ms": args.prompt_len / pp["avg_ts"] * 1e3,
            "peak_rss_mib": peak_gib * 1024}


def llmx_workers(artifacts: dict[str, Path], prompt_file: Path, threads: int) -> dict[str, Worker]:
    """One engines.py process per artifact (compare_cpu.Worker looks the engine up in its ENGINES)."""
    workers = {}
    for name, path in artifacts.items():
        ENGINES[name] = ("llmx", name, sys.executable, ["--threads", str(threads)])
        log(f"loading {name}")
        workers[name] = Worker(name, {name: path}, prompt_file)
    return workers


def llmx_run(worker: Worker, new_tokens: int) -> dict:
    run = worker.run(new_tokens)
    return {"decode_tok_s": len(run["steps_s"]) / sum(run["steps_s"]), "ttft_ms": run["ttft_s"] * 1e3}


def speed_rounds(artifacts: dict[str, Path], ggufs: dict[str, Path], vocab: int, args) -> dict[str, list[dict]]:
    """Every engine once per round, the order rotating, so a shared host's load falls on all alike."""
    prompt_file = write_prompts(args.work / "prompts.json", args.prompt_len, [], vocab)
    runs: dict[str, list[dict]] = {name: [] for name in [*artifacts, *ggufs]}
    workers = {}
    try:
        workers = llmx_workers(artifacts, prompt_file, args.threads)
        for worker in workers.values():  # warm-up: first runs pay for lazy allocations
            worker.ask(f"run {args.new_tokens}")
        order = list(runs)
        for rnd in range(args.rounds):
            shift = rnd % len(order)
            for name in order[shift:] + order[:shift]:
                runs[name].append(llmx_run(workers[name], args.new_tokens) if name in workers
                                  else llama_bench(ggufs[name], args))
            log(f"speed round {rnd + 1}/{args.rounds} done")
        for name, worker in workers.items():
            peak = worker.ask("rss")["peak_rss_mb"]
            for run in runs[name]:
                run["peak_rss_mib"] = peak
    finally:
        for worker in workers.values():
            worker.close()
    return runs


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def pair_ratios(runs: dict[str, list[dict]], ours: str, theirs: str) -> dict | None:
    """Median over rounds of the within-round ratio ours / theirs (decode: >1 is faster; TTFT: <1 is faster)."""
    if ours not in runs or theirs not in runs:
        return None
    rounds = [(a, b) for a, b in zip(runs[ours], runs[theirs]) if "error" not in a and "error" not in b]
    if not rounds:
        return None
    return {"decode": statistics.median(a["decode_tok_s"] / b["decode_tok_s"] for a, b in rounds),
            "ttft": statistics.median(a["ttft_ms"] / b["ttft_ms"] for a, b in rounds)}


# -- report --------------------------------------------------------------------------------------

def size_mib(path: Path) -> float | None:
    if path.is_file():
        return path.stat().st_size / 2**20
    if path.is_dir():  # the weights and graphs, not the tokenizer (as gguf_import.py sizes an artifact)
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and "tokenizer" not in f.parts) / 2**20
    return None


def build_rows(builds: dict[str, dict], paths: dict[str, Path], scores: dict[str, dict],
               runs: dict[str, list[dict]]) -> dict[str, dict]:
    """One row per engine: what it took to build, its quality and its speed."""
    rows = {}
    for name, build in builds.items():
        speed = runs.get(name, [])
        rows[name] = {
            "size_mib": size_mib(paths[name]), "build_s": build.get("wall_s"), "build_peak_rss_mib": build.get("peak_rss_mib"),
            "built": build.get("rc", 0) == 0, "error": build.get("error"),
            "calibrate_quality": build.get("quality"), "heldout": scores.get(name, {}),
            "decode_tok_s": median_of(speed, "decode_tok_s"), "ttft_ms": median_of(speed, "ttft_ms"),
            "run_peak_rss_mib": median_of(speed, "peak_rss_mib"), "runs": speed,
        }
    return rows


def fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def table(rows: dict[str, dict], ratios: dict[str, dict | None]) -> str:
    head = (f"{'engine':16}{'MiB':>8}{'ppl':>9}{'ppl/fp32':>10}{'calib ratio':>12}{'target':>8}{'decode tok/s':>13}"
            f"{'TTFT ms':>9}{'build s':>9}{'build RSS MiB':>14}{'run RSS MiB':>12}  search / error")
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        q = r["calibrate_quality"] or {}
        note = r["error"] or ""
        if q.get("search"):
            s = q["search"]
            note = f"{s['chosen']} ({s['candidates']} tried, {'met' if s['met'] else 'MISSED'}, {s['search_s']:.0f} s)"
        elif r["heldout"].get("error"):
            note = r["heldout"]["error"]
        lines.append(f"{name:16}{fmt(r['size_mib'], '.1f', 8)}{fmt(r['heldout'].get('perplexity'), '.3f', 9)}"
                     f"{fmt(r['heldout'].get('ratio'), '.4f', 10)}{fmt(q.get('perplexity_ratio'), '.4f', 12)}"
                     f"{fmt(q.get('target'), '.3f', 8)}{fmt(r['decode_tok_s'], '.1f', 13)}{fmt(r['ttft_ms'], '.0f', 9)}"
                     f"{fmt(r['build_s'], '.1f', 9)}{fmt(r['build_peak_rss_mib'], '.0f', 14)}"
                     f"{fmt(r['run_peak_rss_mib'], '.0f', 12)}  {note}")
    lines.append("")
    lines.append("ppl/fp32: held-out perplexity over the engine's own fp32/F32 one (same tokens both engines); "
                 "calib ratio: llmx calibrate's quality.json; build: export+optimize, calibrate, convert or quantize")
    for pair, ratio in ratios.items():
        lines.append(f"{pair}: " + (f"decode x{ratio['decode']:.2f}, TTFT x{ratio['ttft']:.2f} (median of per-round "
                                    f"ratios)" if ratio else "not measured"))
    return "\n".join(lines)


def plot(rows: dict[str, dict], path: Path) -> Path | None:
    """Decode speed and held-out perplexity ratio per engine, only if matplotlib is already installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    colors = ["tab:blue" if n.startswith("llmx") else "tab:orange" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, label in ((axes[0], lambda r: r["decode_tok_s"], "decode tok/s (batch 1, 2 threads)"),
                           (axes[1], lambda r: r["heldout"].get("ratio"), "held-out perplexity / own fp32")):
        ax.bar(names, [key(rows[n]) or 0 for n in names], color=colors)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=45)
    axes[1].set_ylim(bottom=0.95)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# -- main ----------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", type=Path, required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--data", type=Path, required=True, help="calibration text (llmx calibrate --data)")
    ap.add_argument("--eval-data", type=Path, required=True, help="held-out text both engines are scored on")
    ap.add_argument("--work", type=Path, default=Path("/tmp/calibrate-peers"), help="artifacts, GGUFs, logs")
    ap.add_argument("--reuse", action="store_true", help="keep what an earlier run built under --work")
    ap.add_argument("--name", default=None, help="model name for the result file (default: from --hf's path)")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="where the JSON (and PNG) go")
    ap.add_argument("--windows", type=int, default=None, help=f"held-out {SEQ_LEN}-token windows (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds (median reported)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="threads for eval and speed (calibrate: its default)")
    ap.add_argument("--samples", type=int, default=None, help="llmx calibrate --samples (default: calibrate's)")
    ap.add_argument("--eval-samples", type=int, default=None, help="llmx calibrate --eval-samples (default: calibrate's)")
    ap.add_argument("--calibrate-on-heldout", action="store_true",
                    help="also pass --eval-data to llmx calibrate; by default its search judges on a held-out tail "
                         "of --data, so the text the table compares on is never the text the search chose by")
    ap.add_argument("--no-speed", action="store_true", help="build and quality only")
    ap.add_argument("--schemes", type=lambda s: tuple(s.split(",")), default=SCHEMES,
                    help=f"llmx calibrate schemes, comma-separated (default: {','.join(SCHEMES)})")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: {QUICK_WINDOWS} windows, 1 round, calibrate --samples {QUICK_SAMPLES} "
                         f"--eval-samples {QUICK_SAMPLES}")
    args = ap.parse_args()
    args.calibrate_args = []
    if args.quick:
        args.windows = min(args.windows or QUICK_WINDOWS, QUICK_WINDOWS)
        args.rounds = 1
        args.samples, args.eval_samples = args.samples or QUICK_SAMPLES, args.eval_samples or QUICK_SAMPLES
    if args.samples:
        args.calibrate_args += ["--samples", str(args.samples)]
    if args.eval_samples:
        args.calibrate_args += ["--eval-samples", str(args.eval_samples)]
    if args.calibrate_on_heldout:
        args.calibrate_args += ["--eval-data", str(args.eval_data)]
    if args.name is None:
        hf = args.hf.resolve()
        args.name = hf.parent.name if hf.name.lower() in GENERIC_DIRS else hf.name
    return args


def check_tools() -> None:
    missing = [t for t in ("llama-quantize", "llama-perplexity", "llama-bench", "llama.cpp/convert_hf_to_gguf.py")
               if not (TOOLS / t).is_file()]
    if missing:
        sys.exit(f"missing in {TOOLS}: {', '.join(missing)}; run benchmarks/build_llama_server.sh")


def build_all(args) -> tuple[dict[str, Path], dict[str, dict]]:
    """Every engine's model (path) and how building it went (record), llmx's first."""
    fp32, fp32_build = llmx_fp32(args.hf, args.work, args.reuse)
    paths, builds = {"llmx-fp32": fp32}, {"llmx-fp32": fp32_build}
    for scheme in args.schemes:
        paths[f"llmx-{scheme}"], builds[f"llmx-{scheme}"] = calibrate(fp32, scheme, args)
    for kind, (path, record) in llama_ggufs(args.hf, args.work, args.reuse).items():
        paths[f"llama.cpp-{kind}"], builds[f"llama.cpp-{kind}"] = path, record
    return paths, builds


def quality(paths: dict[str, Path], built: list[str], args) -> tuple[dict[str, dict], int]:
    """Held-out perplexity of every built engine on the same windows, and each one's ratio to its own fp32."""
    text, windows = held_out_windows(args.eval_data, paths["llmx-fp32"], args.work, args.windows)
    log(f"held-out: {windows} windows x {SEQ_LEN} tokens ({text})")
    scores = {}
    for name in built:
        log(f"perplexity: {name}")
        scores[name] = (llmx_perplexity(paths[name], text, windows, args.threads) if name.startswith("llmx")
                        else llama_perplexity(paths[name], text, windows))
    with_ratios({n: s for n, s in scores.items() if n.startswith("llmx")}, "llmx-fp32")
    with_ratios({n: s for n, s in scores.items() if n.startswith("llama.cpp")}, "llama.cpp-F32")
    return scores, windows


def speed(paths: dict[str, Path], built: list[str], args) -> dict[str, list[dict]]:
    load = os.getloadavg()[0]
    if load > 0.5:  # llama.cpp's threads spin: other work on the box hurts it far more than llmx
        log(f"load average {load:.2f} before the speed rounds: other processes share the cores")
    vocab = json.loads((args.hf / "config.json").read_text())["vocab_size"]
    return speed_rounds({n: paths[n] for n in built if n.startswith("llmx")},
                        {n: paths[n] for n in built if n.startswith("llama.cpp")}, vocab, args)


def write_record(args, rows: dict, ratios: dict, text_table: str, windows: int, paths: dict[str, Path],
                 started: float, loads: dict) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d_%H%M")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"calibrate_peers_{args.name}_{stamp}"
    record = {
        "model": args.name, "checkpoint": str(args.hf), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]), "quick": args.quick, "wall_s": round(time.time() - started),
        "cpus": os.cpu_count(), "load_avg_1m": {**loads, "end": round(os.getloadavg()[0], 2)},
        "llama_cpp_version": (TOOLS / "VERSION").read_text().strip() if (TOOLS / "VERSION").is_file() else None,
        "gguf_pre_tokenizer": gguf_field(paths["llama.cpp-F32"], "tokenizer.ggml.pre"),
        "settings": {"calibrate_args": args.calibrate_args, "heldout": str(args.eval_data), "windows": windows,
                     "seq_len": SEQ_LEN, "score_from": SCORE_FROM, "rounds": args.rounds, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "threads": args.threads, "batch": 1},
        "rows": rows, "speed_ratios": ratios, "table": text_table,
    }
    path = stem.with_name(stem.name + ".json")
    path.write_text(json.dumps(record, indent=1, default=str))
    return path


def main() -> None:
    args = parse_args()
    check_tools()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # as gguf_import.py: the converter's torch
    args.work.mkdir(parents=True, exist_ok=True)
    started, loads = time.time(), {"start": round(os.getloadavg()[0], 2)}

    paths, builds = build_all(args)
    built = [name for name, b in builds.items() if b.get("rc", 0) == 0 and paths[name].exists()]
    scores, windows = quality(paths, built, args)
    loads["speed_start"] = round(os.getloadavg()[0], 2)
    runs = {} if args.no_speed else speed(paths, built, args)
    ratios = {f"llmx-{ours} / llama.cpp-{theirs}": pair_ratios(runs, f"llmx-{ours}", f"llama.cpp-{theirs}")
              for ours, theirs in PAIRS.items()}

    rows = build_rows(builds, paths, scores, runs)
    text_table = table(rows, ratios)
    if not args.no_speed:
        text_table += f"\nload average (1 min) before the speed rounds: {loads['speed_start']} on {os.cpu_count()} cores"
    print(text_table)
    path = write_record(args, rows, ratios, text_table, windows, paths, started, loads)
    png = None if args.no_speed else plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}" + (f" and {png.name}" if png else ""))


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # as gguf_import.py: a crashing tool leaves no core file
    main()
