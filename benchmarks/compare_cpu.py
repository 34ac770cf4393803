"""llmx against onnxruntime-genai, transformers eager and llama.cpp on one CPU, side by side.

    python benchmarks/compare_cpu.py [--rounds 5] [--engines llmx,genai,genai-2t,llamacpp,...]

Builds (once, cached in benchmarks/.cache/) a SmolLM-135M-shaped Llama checkpoint with random
weights, exports and optimizes it with llmx, builds the onnxruntime-genai fp32 model and the
llama.cpp f32 GGUF from the same checkpoint. Every engine then runs in its own process (its
own peak RSS), all loaded at once and taking turns run by run, so that the background load of
a shared machine falls on all of them alike: after a warm-up, ``--rounds`` greedy generations
each of the same prompt token ids (EOS ignored), then a decode-step sweep over context lengths.
Ratios to onnxruntime-genai are taken within each round, then the median is reported.
Finally ``llmx bench --json`` runs on the optimized artifact (the command users run).

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
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers import PEERS_PYTHON, build_genai, build_gguf, has_module  # noqa: E402
from report import write_report  # noqa: E402
from smollm_shape import SMOLLM_135M, build_checkpoint  # noqa: E402

LLMX = str(Path(sys.executable).with_name("llmx"))
BASELINE = "genai"
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
}


def prepare(cache: Path, engines: list[str], log) -> dict[str, Path]:
    """Model paths by kind, building what is missing."""
    ckpt = build_checkpoint(cache / "ckpt")
    paths = {"ckpt": ckpt, "art": cache / "art", "art-opt": cache / "art-opt"}
    if not (paths["art"] / "llmx.json").is_file():
        log("llmx export")
        subprocess.run([LLMX, "export", str(ckpt), "-o", str(paths["art"])], check=True)
    if not (paths["art-opt"] / "llmx.json").is_file():
        log("llmx optimize")
        subprocess.run([LLMX, "optimize", str(paths["art"]), "-o", str(paths["art-opt"])], check=True)
    if any(ENGINES[e][0] == "genai" for e in engines):
        paths["genai"] = build_genai(ckpt, cache / "genai-fp32", log)
    if "llamacpp" in engines:
        paths["gguf"] = build_gguf(ckpt, cache / "smollm-f32.gguf", log)
    return paths


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
            results[w.name]["runs"].append(w.ask(f"run {args.new_tokens}"))
        log(f"round {rnd + 1}/{args.rounds} done")
    for w in workers:
        log(f"context sweep: {w.name}")
        results[w.name]["sweep"] = w.ask(f"sweep {args.sweep_steps} {args.sweep_passes}")
    for w in workers:
        results[w.name]["peak_rss_mb"] = w.ask("rss")["peak_rss_mb"]
    return results


def write_prompts(path: Path, prompt_len: int, contexts: list[int]) -> Path:
    """The prompt ids every engine gets: the ones ``llmx bench`` makes (llmx.runtime.bench.prompt_ids)."""
    from llmx.runtime.bench import prompt_ids

    vocab = SMOLLM_135M["vocab_size"]
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
    ap.add_argument("--engines", default="llmx,llmx-spin,genai,genai-2t,llamacpp,llamacpp-2t,transformers,llmx-portable")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--contexts", default="64,128,256,512,1024")
    ap.add_argument("--sweep-steps", type=int, default=16)
    ap.add_argument("--sweep-passes", type=int, default=3, help="median over passes per context length")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        sys.exit(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")
    if any(ENGINES[e][0] == "genai" for e in engines) and not has_module("onnxruntime_genai"):
        sys.exit("onnxruntime-genai is not installed in the peers venv: run benchmarks/setup_peers.sh")
    if "llamacpp" in engines and not has_module("llama_cpp"):
        log("llama-cpp-python is not installed in the peers venv; leaving llama.cpp out")
        engines.remove("llamacpp")
    contexts = [int(c) for c in args.contexts.split(",")]
    paths = prepare(args.cache, engines, log)
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
    cli = llmx_bench_cli(paths["art-opt"], args)
    meta = {
        "model": {k: SMOLLM_135M[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "intermediate_size", "vocab_size")},
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": 1, "rounds": args.rounds,
        "contexts": contexts, "baseline": BASELINE, "wall_s": round(time.time() - started),
        "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_1m_at_start": load_start,
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), "llmx_bench_cli": cli,
    }
    out = write_report(results, meta, args.out)
    print(out["md"].read_text())
    log(f"wrote {', '.join(str(p) for p in out.values())}")


if __name__ == "__main__":
    main()
