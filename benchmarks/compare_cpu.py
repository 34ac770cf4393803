"""llmx against onnxruntime-genai, transformers eager and llama.cpp on one CPU, side by side.

    python benchmarks/compare_cpu.py [--rounds 2] [--engines llmx,genai,transformers,llamacpp]

Builds (once, cached in benchmarks/.cache/) a SmolLM-135M-shaped Llama checkpoint with random
weights, exports and optimizes it with llmx, builds the onnxruntime-genai fp32 model and the
llama.cpp f32 GGUF from the same checkpoint, then runs every engine in its own process (clean
peak RSS) on the same prompt token ids: greedy, EOS ignored, warm-up, ``--repeat`` runs.
Engines take turns in ``--rounds`` rounds (order rotated) so that load from other processes
falls on all of them; ratios are taken within a round and the medians reported.

Writes benchmarks/results/cpu_<date>.{json,md,png}: the markdown table (absolute numbers and
ratios to onnxruntime-genai) and the plot of decode tok/s against context length.
The peers live in their own venv (``benchmarks/setup_peers.sh``): onnxruntime-genai pins its own
onnxruntime, and is never a dependency of llmx.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from peers import PEERS_PYTHON, build_genai, build_gguf, has_module  # noqa: E402
from report import write_report  # noqa: E402
from smollm_shape import SMOLLM_135M, build_checkpoint  # noqa: E402

LLMX = str(Path(sys.executable).with_name("llmx"))
BASELINE = "genai"


def prepare(cache: Path, engines: list[str], log) -> dict[str, str]:
    """Model paths per engine, building what is missing."""
    ckpt = build_checkpoint(cache / "ckpt")
    paths = {"transformers": str(ckpt)}
    art, opt = cache / "art", cache / "art-opt"
    if any(e.startswith("llmx") for e in engines):
        if not (art / "llmx.json").is_file():
            log("llmx export")
            subprocess.run([LLMX, "export", str(ckpt), "-o", str(art)], check=True)
        if not (opt / "llmx.json").is_file():
            log("llmx optimize")
            subprocess.run([LLMX, "optimize", str(art), "-o", str(opt)], check=True)
        paths.update({"llmx": str(opt), "llmx-portable": str(art)})
    if "genai" in engines:
        paths["genai"] = str(build_genai(ckpt, cache / "genai-fp32", log))
    if "llamacpp" in engines:
        paths["llamacpp"] = str(build_gguf(ckpt, cache / "smollm-f32.gguf", log))
    return paths


def command(engine: str, model: str, prompt_file: Path, args, contexts: list[int], sweep: bool) -> list[str]:
    threads = args.llmx_threads if engine.startswith("llmx") else args.peer_threads
    if engine.startswith("llmx"):
        cmd = [LLMX, "bench", model, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
               "--repeat", str(args.repeat), "--json"]
        cmd += ["--context", ",".join(map(str, contexts))] if sweep else []
    else:
        python = sys.executable if engine == "transformers" else str(PEERS_PYTHON)
        cmd = [python, str(HERE / "engines.py"), engine, model, "--prompt", str(prompt_file),
               "--new-tokens", str(args.new_tokens), "--repeat", str(args.repeat)]
        cmd += ["--contexts"] if sweep else []
    return cmd + (["--threads", str(threads)] if threads else [])


def run_engine(cmd: list[str], timeout: float) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="llmx,genai,transformers,llamacpp,llmx-portable")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--contexts", default="64,128,256,512,1024")
    ap.add_argument("--llmx-threads", type=int, default=None, help="default: llmx's own default")
    ap.add_argument("--peer-threads", type=int, default=None, help="default: each peer's own default")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    engines = [e for e in args.engines.split(",") if e]
    if "genai" in engines and not has_module("onnxruntime_genai"):
        sys.exit("onnxruntime-genai is not installed in the peers venv: run benchmarks/setup_peers.sh")
    if "llamacpp" in engines and not has_module("llama_cpp"):
        log("llama-cpp-python is not installed in the peers venv; skipping llama.cpp")
        engines.remove("llamacpp")
    contexts = [int(c) for c in args.contexts.split(",")]
    paths = prepare(args.cache, engines, log)
    prompt_file = write_prompts(args.cache / "prompts.json", args.prompt_len, contexts)

    results: dict[str, list[dict]] = {e: [] for e in engines}
    started = time.time()
    for rnd in range(args.rounds):
        order = engines[rnd % len(engines):] + engines[: rnd % len(engines)]
        for engine in order:
            log(f"round {rnd + 1}/{args.rounds}: {engine}")
            results[engine].append(run_engine(command(engine, paths[engine], prompt_file, args, contexts, rnd == 0), 900))
    meta = {
        "model": {k: SMOLLM_135M[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "intermediate_size", "vocab_size")},
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": 1, "repeat": args.repeat,
        "rounds": args.rounds, "contexts": contexts, "baseline": BASELINE, "wall_s": round(time.time() - started),
        "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_1m_at_end": round(__import__("os").getloadavg()[0], 2),
    }
    paths_out = write_report(results, meta, args.out)
    print(paths_out["md"].read_text())
    log(f"wrote {', '.join(str(p) for p in paths_out.values())}")


def write_prompts(path: Path, prompt_len: int, contexts: list[int]) -> Path:
    """The prompt ids every engine gets: the same ones ``llmx bench`` makes (llmx.runtime.bench.prompt_ids)."""
    from llmx.runtime.bench import prompt_ids

    vocab = SMOLLM_135M["vocab_size"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"prompt": prompt_ids(prompt_len, vocab),
                                "context_prompts": {str(c): prompt_ids(c, vocab) for c in contexts}}))
    return path


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
