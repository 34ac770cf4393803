"""Verify llmx's ONNX Runtime CUDA path on a real GPU, next to transformers + torch on the same GPU.

    python benchmarks/gpu_verify.py prepare  --work /tmp/gv    # checkpoints + artifacts (fp32, fp16, optimized)
    python benchmarks/gpu_verify.py parity   --work /tmp/gv    # ort-cuda vs ort-cpu logits, greedy; KV residency
    python benchmarks/gpu_verify.py speed    --work /tmp/gv    # llmx bench vs transformers, batch 1 and 8, interleaved
    python benchmarks/gpu_verify.py serve    --work /tmp/gv    # llmx serve --backend ort-cuda: 1 vs 8 streams

Models: the built-in demo model (6 layers, hidden 256) and a SmolLM-135M-shaped Llama with
random weights (the shape decides speed and numerics, not the values). fp16 graphs come from
``llmx build --onnx-only --precision fp16`` (no TensorRT needed). Every step appends its
figures to ``<work>/results.json``; the last lines printed are a table.

Residency: if the KV cache travelled through the host each step, a decode step at a fixed
context would cost more with a larger cache capacity (the whole buffer would be copied); the
``residency`` rows time a step at capacity 256 and at the model maximum and list the Memcpy nodes ONNX Runtime's
profiler saw in the decode session.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from smollm_shape import build_checkpoint  # noqa: E402
LLMX = [sys.executable, "-m", "llmx.cli"]
PROMPT = "def fibonacci(n):\n    "
GPU = os.environ.get("LLMX_VERIFY_BACKEND", "ort-cuda")  # ort-cpu: dry-run this script on a CPU box


def sh(args: list, **kw) -> str:
    print("+", " ".join(map(str, args)), file=sys.stderr, flush=True)
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, **kw)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(map(str, args))}")
    return proc.stdout


def record(work: Path, key: str, value) -> None:
    path = work / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2))


# -- prepare ------------------------------------------------------------------------------------

def prepare(work: Path, models: list[str], optimized: bool = True) -> None:
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt-smollm"
    if "smollm" in models:
        build_checkpoint(ckpt)
    sources = {"demo": ROOT / "llmx" / "demo_model", "smollm": ckpt}
    for name in models:
        src = sources[name]
        art = work / f"art-{name}"
        if not art.exists():
            sh([*LLMX, "export", src, "-o", art])
        if not (work / f"art-{name}-fp16").exists():
            sh([*LLMX, "build", art, "-o", work / f"art-{name}-fp16", "--precision", "fp16", "--onnx-only"])
        if optimized and not (work / f"art-{name}-opt").exists():
            sh([*LLMX, "optimize", art, "-o", work / f"art-{name}-opt"])
    print("prepared", sorted(p.name for p in work.iterdir()))


# -- parity and residency ------------------------------------------------------------------------

def greedy(engine, ids: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill then ``steps`` greedy decode steps on row 0: the logits of each step and the tokens."""
    backend = engine.backend
    cache = backend.new_cache(1, len(ids) + steps + 1)
    logits = [np.array(backend.prefill(cache, [0], [ids])[0], np.float32)]
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        step = backend.decode(cache, np.array([[tokens[-1]]], np.int64))
        logits.append(np.array(step[0, -1], np.float32))
    return logits, tokens


def parity(work: Path, models: list[str]) -> None:
    from llmx.runtime.engine import Engine

    rows = []
    for name in models:
        cpu = Engine.load(work / f"art-{name}", backend="ort-cpu")
        ids = cpu.encode(PROMPT)
        ref_logits, ref_tokens = greedy(cpu, ids, 32)
        for variant in ("", "-fp16", "-opt"):
            label = f"{name}{variant}"
            try:
                gpu = Engine.load(work / f"art-{name}{variant}", backend=GPU)
                logits, tokens = greedy(gpu, ids, 32)
            except Exception as exc:  # a row that fails says why; the others still run
                rows.append(dict(artifact=label, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                continue
            scale = float(np.abs(ref_logits[0]).max())
            diffs = [float(np.abs(a - b).max()) for a, b in zip(logits[:17], ref_logits[:17])]
            same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
            rows.append(dict(artifact=label, max_abs_diff_prefill=diffs[0], max_abs_diff_16_steps=max(diffs),
                             relative_to_logit_scale=max(diffs) / scale, greedy_identical_tokens=same,
                             greedy_identical=tokens == ref_tokens))
            del gpu
    record(work, "parity", rows)
    rows_res = residency(work, models[-1])
    record(work, "residency", rows_res)
    for r in rows + rows_res:
        print(json.dumps(r))


def residency(work: Path, name: str) -> list[dict]:
    import onnxruntime as ort

    import llmx.runtime.ort_device_backend as odb
    from llmx.artifact import Artifact
    from llmx.runtime.engine import Engine

    out = []
    original = odb.session_options

    def profiled(*args, **kw):
        opts = original(*args, **kw)
        opts.enable_profiling = True
        opts.profile_file_prefix = str(work / "ort_profile")
        return opts

    art = work / f"art-{name}-fp16"
    odb.session_options = profiled
    try:  # plain steps: a captured graph's replays are not profiled node by node
        backend = odb.OrtDeviceBackend(Artifact.open(art), provider=GPU.removeprefix("ort-"), cuda_graph=False)
    finally:
        odb.session_options = original
    ids = Engine.load(art).encode(PROMPT)
    for capacity in (256, backend.max_seq_len):  # the largest cache the model allows
        cache = backend.new_cache(1, capacity)
        backend.prefill(cache, [0], [ids])
        token = np.array([[5]], np.int64)
        for _ in range(5):
            backend.decode(cache, token)
        times = []
        for _ in range(40):
            start = time.perf_counter()
            backend.decode(cache, token)
            times.append(time.perf_counter() - start)
        out.append(dict(check=f"decode step, capacity {capacity}, context ~{len(ids) + 45}",
                        median_ms=round(statistics.median(times) * 1e3, 3)))
    profile = backend.sessions["decode"].end_profiling()
    events = json.loads(Path(profile).read_text())
    nodes = [e for e in events if e.get("cat") == "Node"]
    memcpy = sorted({e["name"] for e in nodes if "Memcpy" in e["name"] or "memcpy" in e["name"].lower()})
    providers = sorted({e.get("args", {}).get("provider", "?") for e in nodes})
    out.append(dict(check="decode session profile", node_events=len(nodes), memcpy_nodes=memcpy, providers=providers,
                    ort_version=ort.__version__))
    return out


# -- speed: llmx bench vs transformers -------------------------------------------------------------

def llmx_bench(art: Path, batch: int, prompt_len: int, new_tokens: int, cuda_graph: bool | None) -> dict:
    """llmx bench's measurement, in process, with CUDA graphs on or off (the CLI takes the default)."""
    from llmx.artifact import Artifact
    from llmx.runtime.bench import bench
    from llmx.runtime.ort_device_backend import OrtDeviceBackend
    from llmx.runtime.tokenizer import Tokenizer

    artifact = Artifact.open(art)
    backend = OrtDeviceBackend(artifact, provider="cuda", cuda_graph=cuda_graph)
    r = bench(backend, Tokenizer(artifact), prompt_len, new_tokens, batch, 3, 1)
    return dict(ttft_ms=r.ttft_ms, decode_tok_s=r.decode_tokens_per_s)


def torch_bench(model, batch: int, prompt_len: int, new_tokens: int) -> dict:
    import torch

    ids = torch.tensor([[8 + (i * 7 + row) % 300 for i in range(prompt_len)] for row in range(batch)], device="cuda")
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(new_tokens)  # warm-up
    ttft = statistics.median(timed(1) for _ in range(3))
    full = statistics.median(timed(new_tokens) for _ in range(3))
    return dict(ttft_ms=round(ttft * 1e3, 3), decode_tok_s=round(batch * (new_tokens - 1) / (full - ttft), 1))


def speed(work: Path, rounds: int, prompt_len: int, new_tokens: int) -> None:
    import torch
    import transformers

    models = {dtype: transformers.AutoModelForCausalLM.from_pretrained(work / "ckpt-smollm", dtype=dtype).cuda().eval()
              for dtype in (torch.float32, torch.float16)}
    arts = {"llmx ort-cuda fp32, CUDA graphs": (work / "art-smollm", None),
            "llmx ort-cuda fp32, plain": (work / "art-smollm", False),
            "llmx ort-cuda fp16, CUDA graphs": (work / "art-smollm-fp16", None),
            "llmx ort-cuda fp16, plain": (work / "art-smollm-fp16", False),
            "llmx ort-cuda optimized fp32": (work / "art-smollm-opt", None)}
    samples: dict[tuple[str, int], list[dict]] = {}
    for _ in range(rounds):  # engines take turns round by round: drift hits all alike
        for batch in (1, 8):
            for label, (art, graphs) in arts.items():
                try:
                    samples.setdefault((label, batch), []).append(llmx_bench(art, batch, prompt_len, new_tokens, graphs))
                except Exception as exc:  # an artifact this run did not prepare, or a failure: one row says so
                    samples.setdefault((label, batch), []).append(dict(error=str(exc)[:200]))
            for dtype, model in models.items():
                label = f"transformers {str(dtype).split('.')[-1].replace('float', 'fp')}"
                samples.setdefault((label, batch), []).append(torch_bench(model, batch, prompt_len, new_tokens))
    rows = median_rows(samples)
    record(work, "speed", dict(prompt_len=prompt_len, new_tokens=new_tokens, gpu=torch.cuda.get_device_name(), rows=rows))
    print_rows(rows)


def median_rows(samples: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """One row per (engine, batch): medians over the rounds that ran, or the first error."""
    rows = []
    for (label, batch), runs in samples.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append(dict(engine=label, batch=batch, error=runs[0]["error"]))
            continue
        rows.append(dict(engine=label, batch=batch, ttft_ms=round(statistics.median(r["ttft_ms"] for r in ok), 3),
                         decode_tok_s=round(statistics.median(r["decode_tok_s"] for r in ok), 1), rounds=len(ok)))
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'engine':36} {'batch':>5} {'TTFT ms':>9} {'decode tok/s':>13}")
    for r in sorted(rows, key=lambda r: (r["batch"], r["engine"])):
        print(f"{r['engine']:36} {r['batch']:>5} {r.get('ttft_ms', '-')!s:>9} {r.get('decode_tok_s', r.get('error', '-'))!s:>13}")


# -- serve: aggregate throughput of concurrent streams ---------------------------------------------

def stream(url: str, tokens: int, out: list, lock: threading.Lock) -> None:
    """One streamed completion; its token count comes from the usage chunk (a text chunk is not a
    token: ids that decode to no text, or to part of a UTF-8 character, send none)."""
    import requests

    body = {"prompt": PROMPT, "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    start, done, used = time.perf_counter(), False, 0
    with requests.post(url, json=body, stream=True, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: ") and b'"usage"' in line:
                used = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", used)
    with lock:
        out.append(dict(tokens=used, start=start, end=time.perf_counter(), done=done))


def serve(work: Path, art_name: str, tokens: int) -> None:
    import requests

    port = 8517
    art = work / art_name
    command = [*LLMX, "serve", art, "--backend", GPU, "--host", "127.0.0.1", "--port", port, "--max-batch", 8]
    log = open(work / "serve.log", "w")  # a pipe nobody reads would block the server once full
    proc = subprocess.Popen(list(map(str, command)), stdout=log, stderr=subprocess.STDOUT, text=True)
    rows = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/ready", timeout=2).ok:
                    break
            except requests.RequestException:  # not listening yet, or busy loading
                time.sleep(1)
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {(work / 'serve.log').read_text()[-3000:]}")
        url = f"http://127.0.0.1:{port}/v1/completions"
        for k in (1, 8, 1, 8, 1, 8):
            out, lock = [], threading.Lock()
            threads = [threading.Thread(target=stream, args=(url, tokens, out, lock)) for _ in range(k)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            span = max(r["end"] for r in out) - min(r["start"] for r in out)  # TTFT included
            rows.append(dict(streams=k, aggregate_tok_s=round(sum(r["tokens"] for r in out) / span, 1),
                             all_done=all(r["done"] for r in out), tokens=[r["tokens"] for r in out]))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    best = {k: max(r["aggregate_tok_s"] for r in rows if r["streams"] == k) for k in (1, 8)}
    record(work, f"serve {art_name}", dict(rows=rows, best=best, ratio_8_vs_1=round(best[8] / best[1], 2)))
    for r in rows:
        print(json.dumps(r))
    print(f"serve {art_name}: 1 stream {best[1]} tok/s, 8 streams {best[8]} tok/s ({best[8] / best[1]:.2f}x)")


def cuda_graph(work: Path) -> None:
    """Can ONNX Runtime capture the decode step as a CUDA graph? It needs every node on the CUDA
    provider and fixed input shapes; record what it says for each decode graph."""
    import onnxruntime as ort

    rows = []
    for name in ("art-smollm", "art-smollm-fp16", "art-smollm-opt"):
        path = work / name / json.loads((work / name / "llmx.json").read_text())["graphs"]["decode"]["file"]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        try:
            ort.InferenceSession(str(path), opts, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
            rows.append(dict(graph=name, session="created with enable_cuda_graph=1"))
        except Exception as exc:
            rows.append(dict(graph=name, session=str(exc).splitlines()[0][:400]))
        session = ort.InferenceSession(str(path), opts, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        del session
    for name in ("art-smollm", "art-smollm-fp16"):
        rows.append(dict(graph=name, **{f"step_ms_{k}": v for k, v in captured_step(work / name).items()}))
    record(work, "cuda_graph", rows)
    for r in rows:
        print(json.dumps(r))


ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


def captured_step(art: Path, capacity: int = 256, steps: int = 200) -> dict:
    """A decode step's time with every input on the device at fixed addresses and shapes, run
    plainly and replayed from a captured CUDA graph. The mask spans the whole capacity, so both
    runs attend over ``capacity`` slots: this times the graph, not llmx's loop."""
    import onnxruntime as ort

    path = art / json.loads((art / "llmx.json").read_text())["graphs"]["decode"]["file"]
    out = {}
    for mode, options in (("plain", {}), ("cuda_graph", {"enable_cuda_graph": "1"})):
        session = ort.InferenceSession(str(path), providers=[("CUDAExecutionProvider", options)])
        binding, values = session.io_binding(), {}
        for arg in session.get_inputs():
            if arg.name == "input_ids":
                host = np.array([[5]], np.int64)
            elif arg.name == "attention_mask":
                host = np.ones((1, capacity), np.int64)
            elif arg.name == "position_ids":
                host = np.array([[capacity - 1]], np.int64)
            else:
                host = np.zeros((1, arg.shape[1], capacity, arg.shape[3]), ORT_TYPES[arg.type])
            values[arg.name] = ort.OrtValue.ortvalue_from_numpy(host, "cuda", 0)
            binding.bind_ortvalue_input(arg.name, values[arg.name])
        for arg in session.get_outputs():
            if arg.name.startswith("present."):
                past = values[arg.name.replace("present.", "past_key_values.")]
                binding.bind_ortvalue_output(arg.name, past)
            else:
                shape = (1, 1, session.get_outputs()[0].shape[-1])
                binding.bind_ortvalue_output(arg.name, ort.OrtValue.ortvalue_from_shape_and_type(shape, ORT_TYPES[arg.type], "cuda", 0))
        for _ in range(3):
            session.run_with_iobinding(binding)  # the first run with enable_cuda_graph captures
        start = time.perf_counter()
        for i in range(steps):
            values["input_ids"].update_inplace(np.array([[5 + i % 100]], np.int64))
            session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        out[mode] = round((time.perf_counter() - start) / steps * 1e3, 4)
        del binding, session
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prepare", "parity", "speed", "serve", "cuda-graph", "all"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-verify"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-optimized", action="store_true", help="prepare no fused (llmx optimize) artifacts")
    ap.add_argument("--models", default="demo,smollm", help="comma-separated: demo, smollm")
    ap.add_argument("--serve-artifact", default="art-smollm-fp16")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.step in ("prepare", "all"):
        prepare(args.work, args.models.split(","), not args.no_optimized)
    if args.step in ("parity", "all"):
        parity(args.work, args.models.split(","))
    if args.step in ("speed", "all"):
        speed(args.work, args.rounds, args.prompt_len, args.new_tokens)
    if args.step in ("cuda-graph", "all"):
        cuda_graph(args.work)
    if args.step in ("serve", "all"):
        serve(args.work, args.serve_artifact, 64)


if __name__ == "__main__":
    main()
