"""llmx against onnxruntime-genai, transformers eager and llama.cpp on one CPU, side by side.

    python benchmarks/compare_cpu.py [--rounds 5] [--engines fp32,quantized | llmx,genai,llmx-w8,...]

Builds (once, cached in benchmarks/.cache/) a SmolLM-135M-shaped Llama checkpoint with random
weights, exports and optimizes it with llmx, builds the onnxruntime-genai fp32 model and the
llama.cpp f32 GGUF from the same checkpoint. Quantized engines: llmx w8/w4 (``llmx calibrate``
on the optimized or the portable artifact, with stdlib source as calibration text),
onnxruntime-genai int8/int4 (its model builder) and llama.cpp Q8_0/Q4_0 (its quantizer on the
f32 GGUF). ``--engines`` takes engine names and the groups ``fp32`` and ``quantized``.

Every engine then runs in its own process (its own peak RSS), all loaded at once and taking
turns run by run, so that the background load of a shared machine falls on all of them alike:
after a warm-up, ``--rounds`` greedy generations each of the same prompt token ids (EOS
ignored), then a decode-step sweep over context lengths. Ratios to onnxruntime-genai (the
genai build of the same precision, and genai fp32) are taken within each round, then the median
is reported. Finally ``llmx bench --json`` runs on the first llmx engine's artifact (the command
users run).

Writes benchmarks/results/cpu_<date>.{json,md,png}: the markdown table (absolute numbers and
ratios) and the plot of decode tok/s against context length. The peers live in their own
venv (``benchmarks/setup_peers.sh``); onnxruntime-genai is never a dependency of llmx.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers import PEERS_PYTHON, build_genai, build_gguf, has_module, quantize_gguf  # noqa: E402
from report import write_report  # noqa: E402
from smollm_shape import SMOLLM_135M, build_checkpoint  # noqa: E402

LLMX = str(Path(sys.executable).with_name("llmx"))
BASELINE = "genai"
# Engines take turns, so each timed run starts right after another engine's. onnxruntime-genai
# leaves ONNX Runtime's default spinning on: its workers keep spinning for tens of ms after a
# generation ends and take a core from whoever runs next (llmx's TTFT right after genai at 2
# threads: 154 ms, after another llmx or a 50 ms pause: 130-137 ms; llmx's own workers stop at
# the end of every run). A short pause before each turn measures every engine on a quiet start.
SETTLE_S = 0.2
# engine name -> (worker kind, which model, python to run it with, extra worker arguments)
ENGINES = {
    "llmx": ("llmx", "art-opt", sys.executable, []),
    "llmx-portable": ("llmx", "art", sys.executable, []),
    "llmx-spin": ("llmx", "art-opt", sys.executable, ["--spin"]),
    "llmx-nospin": ("llmx", "art-opt", sys.executable, ["--no-spin"]),
    "genai": ("genai", "genai", PEERS_PYTHON, []),
    "genai-2t": ("genai", "genai", PEERS_PYTHON, ["--threads", "2"]),
    "transformers": ("transformers", "ckpt", sys.executable, []),
    "llamacpp": ("llamacpp", "gguf", PEERS_PYTHON, []),
    "llamacpp-2t": ("llamacpp", "gguf", PEERS_PYTHON, ["--threads", "2"]),
    "llmx-lowmem": ("llmx", "art-opt", sys.executable, ["--low-memory"]),
    "llmx-w8": ("llmx", "art-opt-w8", sys.executable, []),
    "llmx-w8-portable": ("llmx", "art-w8", sys.executable, []),
    "llmx-w8-1t": ("llmx", "art-opt-w8", sys.executable, ["--threads", "1"]),
    "llmx-w8-spin": ("llmx", "art-opt-w8", sys.executable, ["--spin"]),
    "llmx-w4": ("llmx", "art-opt-w4", sys.executable, []),
    "llmx-w4-portable": ("llmx", "art-w4", sys.executable, []),
    "llmx-w4-1t": ("llmx", "art-opt-w4", sys.executable, ["--threads", "1"]),
    "genai-int8": ("genai", "genai-int8", PEERS_PYTHON, []),
    "genai-int8-2t": ("genai", "genai-int8", PEERS_PYTHON, ["--threads", "2"]),
    "genai-int4": ("genai", "genai-int4", PEERS_PYTHON, []),
    "genai-int4-2t": ("genai", "genai-int4", PEERS_PYTHON, ["--threads", "2"]),
    "llamacpp-q8": ("llamacpp", "gguf-q8_0", PEERS_PYTHON, []),
    "llamacpp-q4": ("llamacpp", "gguf-q4_0", PEERS_PYTHON, []),
}
GROUPS = {
    "fp32": ["llmx", "llmx-spin", "llmx-lowmem", "genai", "genai-2t", "llamacpp", "llamacpp-2t", "transformers",
             "llmx-portable"],
    # genai and llmx fp32 stay in: the quantized rows are also compared with genai fp32.
    "quantized": ["llmx-w8", "llmx-w8-portable", "genai-int8", "genai-int8-2t", "llamacpp-q8", "llmx-w4",
                  "llmx-w4-portable", "genai-int4", "genai-int4-2t", "llamacpp-q4", "genai", "llmx"],
}
# The last part of a model's name says its precision; each precision has its genai baseline.
PRECISION = {"w8": "int8", "int8": "int8", "q8_0": "int8", "w4": "int4", "int4": "int4", "q4_0": "int4"}
GENAI_OF = {"fp32": "genai", "int8": "genai-int8", "int4": "genai-int4"}


def precision(engine: str) -> str:
    return PRECISION.get(ENGINES[engine][1].rsplit("-", 1)[-1], "fp32")


def select(spec: str) -> list[str]:
    """Engine names from a comma list of names and groups, in order, each once."""
    names = [n for item in spec.split(",") if item for n in GROUPS.get(item, [item])]
    unknown = [e for e in names if e not in ENGINES]
    if unknown:
        sys.exit(f"unknown engines {unknown}; choose from {', '.join(ENGINES)} or the groups {', '.join(GROUPS)}")
    return list(dict.fromkeys(names))


def _llmx(args: list[str]) -> None:
    subprocess.run([LLMX, *args], check=True)


def build_model(key: str, cache: Path, paths: dict[str, Path], calib_data: Path, log, shape: str = "smollm-135m",
                calibrate_args: tuple[str, ...] = ()) -> Path:
    """The model called ``key`` (see ENGINES), building it and what it comes from if missing.

    ``shape`` picks the checkpoint (smollm_shape.SHAPES); ``calibrate_args`` go to ``llmx calibrate``
    (a 1.1B model needs fewer evaluation windows to build in minutes)."""
    if key in paths:
        return paths[key]
    out = cache / key
    if key == "ckpt":
        path = build_checkpoint(out, shape=shape)
    elif key in ("art", "art-opt"):
        if not (out / "llmx.json").is_file():
            source = ["export", str(build_model("ckpt", cache, paths, calib_data, log, shape))] if key == "art" else \
                ["optimize", str(build_model("art", cache, paths, calib_data, log, shape))]
            log(f"llmx {source[0]}")
            _llmx([*source, "-o", str(out)])
        path = out
    elif key.startswith("art"):  # art-w8, art-opt-w4, ...: llmx calibrate on the fp32 artifact
        source, scheme = key.rsplit("-", 1)
        if not (out / "llmx.json").is_file():
            log(f"llmx calibrate {source} --scheme {scheme}")
            _llmx(["calibrate", str(build_model(source, cache, paths, calib_data, log, shape, calibrate_args)), "--data", str(calib_data),
                   "--scheme", scheme, *calibrate_args, "-o", str(out)])
        path = out
    elif key.startswith("genai"):
        precision_name = key.split("-", 1)[1] if "-" in key else "fp32"
        path = build_genai(build_model("ckpt", cache, paths, calib_data, log, shape), cache / f"genai-{precision_name}", log,
                           precision_name)
    elif key == "gguf":
        path = build_gguf(build_model("ckpt", cache, paths, calib_data, log, shape), cache / "smollm-f32.gguf", log)
    else:  # gguf-q8_0, gguf-q4_0
        ftype = key.split("-", 1)[1]
        path = quantize_gguf(build_model("gguf", cache, paths, calib_data, log, shape), cache / f"smollm-{ftype}.gguf", ftype, log)
    paths[key] = path
    return path


def prepare(cache: Path, engines: list[str], calib_data: Path, log) -> dict[str, Path]:
    """Model paths by name, building what is missing."""
    paths: dict[str, Path] = {}
    for engine in engines:
        build_model(ENGINES[engine][1], cache, paths, calib_data, log)
    return paths


def quality_reports(engines: list[str], paths: dict[str, Path]) -> dict[str, dict]:
    """What ``llmx calibrate`` measured for each quantized llmx engine (its artifact's quality.json)."""
    reports = {}
    for engine in engines:
        report = paths[ENGINES[engine][1]] / "quality.json"
        if ENGINES[engine][0] == "llmx" and report.is_file():
            q = json.loads(report.read_text())
            reports[engine] = {k: q[k] for k in ("scheme", "perplexity_ratio", "top1_agreement", "mean_kl", "tokens")}
            reports[engine]["graph_bytes"] = q["quantized"]["graph_bytes"]
            reports[engine]["fp32_graph_bytes"] = q["fp32"]["graph_bytes"]
    return reports


class Worker:
    """An engine process answering one JSON line per command (benchmarks/engines.py)."""

    def __init__(self, name: str, paths: dict[str, Path], prompt_file: Path):
        kind, model, python, extra = ENGINES[name]
        cmd = [str(python), str(HERE / "engines.py"), kind, str(paths[model]), "--prompt", str(prompt_file), *extra]
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, new_tokens: int) -> dict:
        """One timed generation, after the previous engine's threads have gone quiet."""
        time.sleep(SETTLE_S)
        return self.ask(f"run {new_tokens}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(workers: list[Worker], args, log) -> dict[str, dict]:
    results = {w.name: {"runs": [], "load_s": w.ready["load_s"]} for w in workers}
    for w in workers:
        log(f"warm-up: {w.name}")
        w.ask(f"run {args.new_tokens}")
    for rnd in range(args.rounds):
        shift = rnd % len(workers)
        for w in workers[shift:] + workers[:shift]:
            results[w.name]["runs"].append(w.run(args.new_tokens))
        log(f"round {rnd + 1}/{args.rounds} done")
    for w in workers:
        log(f"context sweep: {w.name}")
        results[w.name]["sweep"] = w.ask(f"sweep {args.sweep_steps} {args.sweep_passes}")
    for w in workers:
        memory = w.ask("rss")
        results[w.name].update(peak_rss_mb=memory["peak_rss_mb"], pss_mb=memory.get("pss_mb"))
    return results


def write_prompts(path: Path, prompt_len: int, contexts: list[int], vocab: int = SMOLLM_135M["vocab_size"]) -> Path:
    """The prompt ids every engine gets: the ones ``llmx bench`` makes (llmx.runtime.bench.prompt_ids)."""
    from llmx.runtime.bench import prompt_ids

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"prompt": prompt_ids(prompt_len, vocab),
                                "context_prompts": {str(c): prompt_ids(c, vocab) for c in contexts}}))
    return path


def llmx_bench_cli(artifact: Path, args) -> dict:
    """What a user runs: ``llmx bench ART --prompt-len 128 --new-tokens 128 --batch 1 --json``."""
    cmd = [LLMX, "bench", str(artifact), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--batch", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {"command": " ".join(["llmx", *cmd[1:]]), **json.loads(out.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="fp32,quantized", help=f"engine names and groups ({', '.join(GROUPS)})")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--contexts", default="64,128,256,512,1024")
    ap.add_argument("--sweep-steps", type=int, default=16)
    ap.add_argument("--sweep-passes", type=int, default=3, help="median over passes per context length")
    ap.add_argument("--calib-data", type=Path, default=Path(sysconfig.get_paths()["stdlib"]) / "email",
                    help="llmx calibrate --data for the w8/w4 artifacts (default: the stdlib's email package)")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    engines = select(args.engines)
    if any(ENGINES[e][0] == "genai" for e in engines) and not has_module("onnxruntime_genai"):
        sys.exit("onnxruntime-genai is not installed in the peers venv: run benchmarks/setup_peers.sh")
    if any(ENGINES[e][0] == "llamacpp" for e in engines) and not has_module("llama_cpp"):
        log("llama-cpp-python is not installed in the peers venv; leaving llama.cpp out")
        engines = [e for e in engines if ENGINES[e][0] != "llamacpp"]
    contexts = [int(c) for c in args.contexts.split(",")]
    paths = prepare(args.cache, engines, args.calib_data, log)
    prompt_file = write_prompts(args.cache / "prompts.json", args.prompt_len, contexts)

    load_start = round(os.getloadavg()[0], 2)
    started = time.time()
    workers = []
    try:
        for name in engines:
            log(f"loading {name}")
            workers.append(Worker(name, paths, prompt_file))
        results = measure(workers, args, log)
    finally:
        for w in workers:
            w.close()
    first_llmx = next((e for e in engines if ENGINES[e][0] == "llmx"), None)
    meta = {
        "model": {k: SMOLLM_135M[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "intermediate_size", "vocab_size")},
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": 1, "rounds": args.rounds,
        "contexts": contexts, "baseline": BASELINE, "wall_s": round(time.time() - started),
        "same_precision_baseline": {e: GENAI_OF[precision(e)] for e in engines if GENAI_OF[precision(e)] in engines},
        "precision": {e: precision(e) for e in engines},
        "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_1m_at_start": load_start,
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        "calibration_data": str(args.calib_data), "llmx_quality": quality_reports(engines, paths),
        "llmx_bench_cli": llmx_bench_cli(paths[ENGINES[first_llmx][1]], args) if first_llmx else None,
    }
    out = write_report(results, meta, args.out)
    print(out["md"].read_text())
    log(f"wrote {', '.join(str(p) for p in out.values())}")


if __name__ == "__main__":
    main()
