"""A served-size model on a lent GPU: llmx's ort-cuda artifacts against onnxruntime-genai's CUDA
models of the same checkpoint, loaded once and timed in interleaved rounds on the same GPU.

    python benchmarks/gpu_big.py prepare --shape tinyllama-1.1b --work /tmp/gb   # checkpoint, artifacts, genai models
    python benchmarks/gpu_big.py speed   --work /tmp/gb                          # TTFT, decode tok/s, batch 1 and 8
    python benchmarks/gpu_big.py parity  --work /tmp/gb                          # quantized graphs: CUDA vs CPU

``prepare`` writes big_export.py's random-weight bf16 checkpoint of ``--shape`` (the shape decides
speed, not the values) and builds, side by side in child processes:

  art-fp16      llmx export --precision fp16                 portable fp16 graphs (CUDA-graph decode)
  art-w4        llmx export --precision w4                   fused graphs, MatMulNBits, float32 activations
  art-w4-fp16   llmx build art-w4 --onnx-only --precision fp16   the same blocks, float16 activations and KV cache
  art-w8-fp16   likewise from llmx export --precision w8
  genai-fp16, genai-int4   onnxruntime-genai's builder, -e cuda (int4: its default, blocks of 32)

``speed`` loads every engine once, then takes ``--rounds`` rounds in which each engine runs
batch 1 and batch 8 in turn (drift hits all alike); each cell is the median of llmx bench's
3 runs after a warm-up (genai: the same, timed the same way: TTFT is prefill plus the first
token, decode the remaining tokens over their time). ``parity`` compares the quantized
artifacts' prefill logits and greedy continuation on ort-cuda with the same artifact on
ort-cpu (the w4-fp16 graphs with art-w4 on the CPU). Every step appends to WORK/results.json.
Set LLMX_VERIFY_BACKEND=ort-cpu to dry-run the flow on a CPU box (genai rows then fail: its
builder's -e cuda needs onnxruntime-gpu).
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

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import big_export  # noqa: E402
from gpu_verify import GPU, greedy, median_rows, print_rows, record  # noqa: E402

LLMX = [sys.executable, "-m", "llmx.cli"]
GENAI_EP = "cpu" if GPU == "ort-cpu" else "cuda"


def run_all(jobs: dict[str, list[list[str]]], work: Path) -> dict:
    """Each job is a chain of commands run in order; the chains run side by side."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    running = {}
    for name, chain in jobs.items():
        script = " && ".join(" ".join(f"'{a}'" for a in map(str, cmd)) for cmd in chain)
        log = open(work / "logs" / f"{name}.log", "w")
        running[name] = (subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT), time.time(), log)
    out = {}
    while len(out) < len(running):
        for name, (proc, start, log) in running.items():
            if name in out or proc.poll() is None:
                continue
            log.close()
            out[name] = dict(rc=proc.returncode, wall_s=round(time.time() - start, 1))
            if proc.returncode:
                out[name]["tail"] = (work / "logs" / f"{name}.log").read_text()[-1500:]
            print(name, json.dumps(out[name]), flush=True)
        time.sleep(0.5)
    return out


def prepare(work: Path, shape: str) -> None:
    big_export.SHAPE = big_export.SHAPES[shape]
    ckpt = work / f"ckpt-{shape}"
    start = time.time()
    _, params = big_export.build_checkpoint(ckpt)
    record(work, "checkpoint", dict(shape=shape, parameters=params, write_s=round(time.time() - start, 1)))
    exp = lambda out, *flags: [*LLMX, "export", ckpt, "-o", work / out, "--force", *flags]  # noqa: E731
    build = lambda src, out: [*LLMX, "build", work / src, "-o", work / out, "--onnx-only", "--precision", "fp16", "--force"]  # noqa: E731
    genai = lambda p: [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", ckpt, "-o", work / f"genai-{p}",  # noqa: E731
                       "-p", p, "-e", GENAI_EP, "-c", work / f"genai-cache-{p}", "--extra_options", "hf_token=false"]
    jobs = {"llmx-fp16": [("art-fp16", exp("art-fp16", "--precision", "fp16"))],
            "llmx-w4": [("art-w4", exp("art-w4", "--precision", "w4")), ("art-w4-fp16", build("art-w4", "art-w4-fp16"))],
            "llmx-w8": [("art-w8", exp("art-w8", "--precision", "w8")), ("art-w8-fp16", build("art-w8", "art-w8-fp16"))],
            "genai-int4": [("genai-int4", genai("int4"))], "genai-fp16": [("genai-fp16", genai("fp16"))]}
    if todo := pending(jobs, work):
        record(work, "prepare", run_all(todo, work))


def pending(jobs: dict[str, list[tuple[str, list]]], work: Path) -> dict[str, list[list]]:
    """The commands whose output is not there yet (a rerun, or a second call, finishes the rest)."""
    done = lambda out: (work / out / "llmx.json").is_file() or (work / out / "genai_config.json").is_file()  # noqa: E731
    return {name: todo for name, chain in jobs.items() if (todo := [cmd for out, cmd in chain if not done(out)])}


class Llmx:
    def __init__(self, art: Path, **options):
        from llmx.artifact import Artifact
        from llmx.runtime.engine import make_backend
        from llmx.runtime.tokenizer import Tokenizer

        self.artifact = Artifact.open(art)
        self.backend = make_backend(self.artifact, GPU, **options)
        self.tokenizer = Tokenizer(self.artifact)

    def run(self, batch: int, prompt_len: int, new_tokens: int) -> dict:
        from llmx.runtime.bench import bench

        r = bench(self.backend, self.tokenizer, prompt_len, new_tokens, batch, 3, 1)
        return dict(ttft_ms=round(r.ttft_ms, 2), decode_tok_s=round(r.decode_tokens_per_s, 1))


class GenAI:
    def __init__(self, model: Path):
        import onnxruntime_genai as og

        self.og, self.model = og, og.Model(str(model))

    def once(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, float]:
        params = self.og.GeneratorParams(self.model)
        total = prompts.shape[1] + new_tokens  # min_length = max_length: EOS cannot end it early
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=prompts.shape[0])
        gen = self.og.Generator(self.model, params)
        start = time.perf_counter()
        gen.append_tokens(prompts)
        gen.generate_next_token()
        gen.get_next_tokens()
        ttft = time.perf_counter() - start
        for _ in range(new_tokens - 1):
            gen.generate_next_token()
        gen.get_next_tokens()  # the tokens reach the host: the steps are done
        return ttft, prompts.shape[0] * (new_tokens - 1) / (time.perf_counter() - start - ttft)

    def run(self, batch: int, prompt_len: int, new_tokens: int) -> dict:
        rng = np.random.default_rng(1234)
        prompts = rng.integers(8, 1000, size=(batch, prompt_len)).astype(np.int32)
        self.once(prompts, new_tokens)
        runs = [self.once(prompts, new_tokens) for _ in range(3)]
        return dict(ttft_ms=round(statistics.median(r[0] for r in runs) * 1e3, 2),
                    decode_tok_s=round(statistics.median(r[1] for r in runs), 1))


class LlmxPlain(Llmx):
    def __init__(self, art: Path):
        super().__init__(art, cuda_graph=False)


ENGINES = {"llmx fp16 (portable, CUDA graphs)": ("art-fp16", Llmx), "llmx fp16 (portable, plain steps)": ("art-fp16", LlmxPlain),
           "llmx w4, fp16 activations": ("art-w4-fp16", Llmx),
           "llmx w8, fp16 activations": ("art-w8-fp16", Llmx), "llmx w4, fp32 activations": ("art-w4", Llmx),
           "genai fp16": ("genai-fp16", GenAI), "genai int4": ("genai-int4", GenAI)}


def speed(work: Path, rounds: int, prompt_len: int, new_tokens: int) -> None:
    engines, samples = {}, {}
    for label, (name, kind) in ENGINES.items():
        start = time.time()
        try:
            engines[label] = kind(work / name)
            print(f"loaded {label} in {time.time() - start:.1f} s", flush=True)
        except Exception as exc:  # a missing or broken engine is one row; the others still run
            samples[(label, 0)] = [dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")]
            print(label, samples[(label, 0)], flush=True)
    for _ in range(rounds):
        for batch in (1, 8):
            for label, engine in engines.items():
                try:
                    r = engine.run(batch, prompt_len, new_tokens)
                except Exception as exc:
                    r = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                samples.setdefault((label, batch), []).append(r)
                print(label, batch, r, flush=True)
    rows = median_rows(samples)
    record(work, "speed", dict(prompt_len=prompt_len, new_tokens=new_tokens, rows=rows))
    print_rows(rows)


def compare(cpu_art: Path, gpu_art: Path, steps: int) -> dict:
    from llmx.runtime.engine import Engine

    cpu = Engine.load(cpu_art, backend="ort-cpu")
    ids = cpu.encode("def fibonacci(n):\n    ")
    ref_logits, ref_tokens = greedy(cpu, ids, steps)
    del cpu
    gpu = Engine.load(gpu_art, backend=GPU)
    logits, tokens = greedy(gpu, ids, steps)
    scale = float(np.abs(ref_logits[0]).max())
    diffs = [float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits)]
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    return dict(cpu=cpu_art.name, gpu=gpu_art.name, relative_diff_prefill=round(diffs[0] / scale, 6),
                relative_diff_first_divergence_or_end=round(max(diffs[:same + 1]) / scale, 6),
                greedy_identical_tokens=f"{same}/{steps}")


def parity(work: Path, steps: int) -> None:
    pairs = [(p, p) for p in ("art-w4", "art-w8", "art-w8a8", "art-demo-w4")]
    pairs += [("art-w4", "art-w4-fp16"), ("art-w8", "art-w8-fp16"), ("art-demo-w4", "art-demo-w4-fp16")]
    rows = []
    for cpu, gpu in pairs:
        if not (work / cpu).exists() or not (work / gpu).exists():
            continue
        try:
            rows.append(compare(work / cpu, work / gpu, steps))
        except Exception as exc:
            rows.append(dict(cpu=cpu, gpu=gpu, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
        print(json.dumps(rows[-1]), flush=True)
    record(work, "parity", rows)


def prepare_small(work: Path) -> None:
    """The demo model as w4 (and its fp16-activation build) and as calibrated w8a8 Q/DQ graphs
    (calibrated on the standard library's os.py: a text every machine has)."""
    demo = HERE.parent / "llmx" / "demo_model"
    jobs = {"demo-w4": [("art-demo-w4", [*LLMX, "export", demo, "-o", work / "art-demo-w4", "--precision", "w4", "--force"]),
                        ("art-demo-w4-fp16", [*LLMX, "build", work / "art-demo-w4", "-o", work / "art-demo-w4-fp16",
                                              "--onnx-only", "--precision", "fp16", "--force"])],
            "demo-w8a8": [("art-demo", [*LLMX, "export", demo, "-o", work / "art-demo", "--force"]),
                          ("art-w8a8", [*LLMX, "calibrate", work / "art-demo", "-o", work / "art-w8a8", "--scheme", "w8a8",
                                        "--data", os.__file__, "--no-search", "--samples", "8", "--eval-samples", "4",
                                        "--force"])]}
    if todo := pending(jobs, work):
        record(work, "prepare_small", run_all(todo, work))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prepare", "prepare-small", "speed", "parity"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-big"))
    ap.add_argument("--shape", default="tinyllama-1.1b", choices=sorted(big_export.SHAPES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16, help="parity: greedy steps compared")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.step == "prepare":
        prepare(args.work, args.shape)
    elif args.step == "prepare-small":
        prepare_small(args.work)
    elif args.step == "speed":
        speed(args.work, args.rounds, args.prompt_len, args.new_tokens)
    else:
        parity(args.work, args.steps)


if __name__ == "__main__":
    main()
