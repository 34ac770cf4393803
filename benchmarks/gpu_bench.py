"""llmx on a GPU vs onnxruntime-genai's CUDA backend, same GPU, same run (needs a GPU box).

    python benchmarks/gpu_bench.py --checkpoint ./SmolLM-135M [--int8-artifact ./art-int8]
        [--prompt-len 128] [--new-tokens 128] [--repeat 5] [--out benchmarks/results/gpu.json]

Steps: ``llmx export`` the checkpoint; ``llmx build`` fp16 engines in both layouts (split,
shared) and INT8 engines from ``--int8-artifact`` (an ``llmx calibrate`` output) when given;
then ``llmx bench --json`` on each (TensorRT; ONNX Runtime CUDA on fp32 and fp16 graphs;
ONNX Runtime TensorRT provider), each in its own process so GPU memory is released between
them; then onnxruntime-genai's model builder (fp16 and int4, CUDA) and its generation loop
on the same prompt ids. Prints a table and writes JSON. Each llmx row is a median over
``--repeat`` runs after one warm-up (llmx bench); genai rows likewise.

genai's TTFT here is ``append_tokens`` (prefill) plus the first ``generate_next_token``, its
decode rate the remaining tokens over their time: the same split as llmx bench.
This script has not been run yet: it was written on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LLMX = [sys.executable, "-m", "llmx.cli"]


def sh(args: list[str], **kw) -> str:
    print("+", " ".join(map(str, args)), file=sys.stderr)
    return subprocess.run(list(map(str, args)), check=True, capture_output=True, text=True, **kw).stdout


def prepare(args, work: Path) -> list[tuple[str, Path, str]]:
    """(label, artifact, backend) for every llmx configuration."""
    art = work / "art"
    if not art.exists():
        sh([*LLMX, "export", args.checkpoint, "-o", art])
    configs = [("llmx ort-cuda fp32", art, "ort-cuda")]
    for layout in ("split", "shared"):
        out = work / f"trt-fp16-{layout}"
        if not out.exists():
            sh([*LLMX, "build", art, "-o", out, "--precision", "fp16", "--layout", layout, "--max-batch", "8",
                "--max-seq-len", str(args.max_seq_len)])
        configs.append((f"llmx tensorrt fp16 {layout}", out, "tensorrt"))
    configs += [("llmx ort-cuda fp16", work / "trt-fp16-split", "ort-cuda"),
                ("llmx ort-tensorrt fp16", work / "trt-fp16-split", "ort-tensorrt")]
    if args.int8_artifact:
        out = work / "trt-int8"
        if not out.exists():
            sh([*LLMX, "build", args.int8_artifact, "-o", out, "--max-batch", "8", "--max-seq-len", str(args.max_seq_len)])
        configs.append(("llmx tensorrt int8", out, "tensorrt"))
    return configs


def bench_llmx(label: str, artifact: Path, backend: str, args) -> dict:
    try:
        out = sh([*LLMX, "bench", artifact, "--backend", backend, "--prompt-len", args.prompt_len,
                  "--new-tokens", args.new_tokens, "--repeat", args.repeat, "--json"])
        return {"name": label, **json.loads(out)}
    except subprocess.CalledProcessError as exc:
        return {"name": label, "error": (exc.stderr or "").strip().splitlines()[-1:]}


def build_genai(checkpoint: str, out: Path, precision: str) -> Path:
    if not (out / "genai_config.json").exists():
        sh([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", checkpoint, "-o", out,
            "-p", precision, "-e", "cuda", "-c", out.parent / "genai-cache"])
    return out


def bench_genai(model_dir: Path, prompt: list[int], new_tokens: int, repeat: int) -> dict:
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))

    def once() -> tuple[float, float]:
        params = og.GeneratorParams(model)
        total = len(prompt) + new_tokens  # min_length = max_length: EOS cannot stop it early
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(np.asarray([prompt], dtype=np.int32))
        generator.generate_next_token()
        generator.get_next_tokens()
        ttft = time.perf_counter() - start
        steps = 0
        while not generator.is_done():
            generator.generate_next_token()
            generator.get_next_tokens()
            steps += 1
        return ttft, steps / (time.perf_counter() - start - ttft)

    once()  # warm-up
    runs = [once() for _ in range(repeat)]
    return {"ttft_ms": round(float(np.median([r[0] for r in runs])) * 1e3, 3),
            "decode_tokens_per_s": round(float(np.median([r[1] for r in runs])), 2)}


def genai_rows(args, work: Path) -> list[dict]:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return [{"name": "onnxruntime-genai", "error": "not installed (pip install onnxruntime-genai-cuda)"}]
    rng = np.random.default_rng(1234)  # llmx bench uses fixed random ids too; the content does not matter for speed
    prompt = rng.integers(8, 1000, size=args.prompt_len).tolist()
    rows = []
    for precision in ("fp16", "int4"):
        label = f"onnxruntime-genai cuda {precision}"
        try:
            model_dir = build_genai(args.checkpoint, work / f"genai-{precision}", precision)
            rows.append({"name": label, **bench_genai(model_dir, prompt, args.new_tokens, args.repeat)})
        except Exception as exc:  # report and continue: one failing peer should not lose the other rows
            rows.append({"name": label, "error": str(exc).splitlines()[-1:]})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'configuration':36} {'TTFT ms':>10} {'decode tok/s':>13}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:36} error: {r['error']}")
        else:
            lines.append(f"{r['name']:36} {r['ttft_ms']:10.2f} {r['decode_tokens_per_s']:13.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="local Hugging Face checkpoint directory")
    ap.add_argument("--int8-artifact", help="an `llmx calibrate` output (Q/DQ int8) to build INT8 engines from")
    ap.add_argument("--work", default="benchmarks/results/gpu-work")
    ap.add_argument("--out", default="benchmarks/results/gpu.json")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--fresh", action="store_true", help="rebuild everything under --work")
    args = ap.parse_args()
    work = Path(args.work)
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    rows = [bench_llmx(label, art, backend, args) for label, art, backend in prepare(args, work)]
    rows += genai_rows(args, work)
    gpu = json.loads(sh([sys.executable, "-c", "import json; from llmx.cuda import open_device; print(json.dumps(open_device().record()))"]))
    report = {"gpu": gpu, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeat": args.repeat, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{gpu['name']} (compute capability {gpu['compute_capability']}): prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, medians of {args.repeat}")
    print(table(rows))


if __name__ == "__main__":
    main()
