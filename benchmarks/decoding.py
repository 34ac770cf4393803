"""Decoding benchmarks: speculative speed-up, warm-prefix TTFT, INT8 KV memory and quality, beam forks.

    python benchmarks/decoding.py                               # every section, both models
    python benchmarks/decoding.py --sections spec,kv --rounds 3 --json out.json

Models: ``demo`` (llmx/demo_model: real weights, a 4.9M-parameter Llama trained on CPython's
stdlib, 512-token context) and ``smollm`` (a random-weight SmolLM-135M-shaped Llama, 2k
context: benchmarks/smollm_shape.py). Prompts come from the demo model's held-out stdlib files
(MODEL_CARD.md), read from this interpreter's stdlib.

Sections (every timing is interleaved round by round, reported as the median over rounds):
  spec   greedy decode tok/s, plain vs prompt lookup (k = 4, 8) on code-editing prompts (a
         function, then the start of it again: the model rewrites what it just read); outputs
         asserted token-identical; acceptance = accepted / drafted drafts
  ttft   time to first token through ``llmx serve`` (in process, loopback): a long shared
         prefix already in the prefix cache (warm) vs a prefix never seen (cold)
  kv     KV-cache bytes at 2k context fp32 vs INT8 (smollm), decode step time at long context,
         and the perplexity cost of the INT8 cache: ``llmx calibrate --kv-cache int8``'s report on
         the demo model, calibrated on training-split stdlib files, graded on all its held-out
         files (scripts/demo_data.py) in llmx eval's 512-token windows
  beam   4 beams over a 1k-token prompt: fork copies (runtime/beam.py) vs gathering every row
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "scripts"))
HELD_OUT = ["argparse.py", "functools.py", "fileinput.py", "json/decoder.py", "unittest/suite.py", "asyncio/events.py",
            "multiprocessing/connection.py", "lib2to3/pgen2/tokenize.py"]
CALIBRATION = ["textwrap.py", "json/encoder.py", "collections/__init__.py", "string.py", "shlex.py", "csv.py"]


def stdlib(rel: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / rel).read_text()


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# -- artifacts ---------------------------------------------------------------------------------

def artifacts(work: Path, models: list[str], threads: int) -> dict[str, Path]:
    """Exported (and INT8-KV) artifacts, built once into ``work`` and reused."""
    from llmx.export import export_checkpoint

    out = {}
    for name in models:
        art = work / name
        if not (art / "llmx.json").is_file():
            if name == "demo":
                source = ROOT / "llmx" / "demo_model"
            else:
                from smollm_shape import build_checkpoint

                source = build_checkpoint(work / "smollm-ckpt")
            print(f"exporting {name} ...", file=sys.stderr)
            export_checkpoint(source, art)
        out[name] = art
        kv8 = work / f"{name}-kv8"
        if not (kv8 / "llmx.json").is_file():
            print(f"calibrating an int8 KV cache for {name} ...", file=sys.stderr)
            if name == "demo":
                int8_kv_artifact(art, kv8, work, threads)
            else:  # random weights: scales from a few windows; its quality would mean nothing
                from llmx.calibration.kv_int8 import quantize_kv_artifact
                from llmx.runtime.engine import Engine

                ids = Engine.load(art, threads=threads).encode("".join(stdlib(f) for f in CALIBRATION))
                quantize_kv_artifact(art, kv8, [ids[i : i + 512] for i in range(0, 8 * 512, 512)], threads=threads)
        out[f"{name}-kv8"] = kv8
    return out


def int8_kv_artifact(art: Path, out: Path, work: Path, threads: int) -> None:
    """``llmx calibrate --kv-cache int8`` on training-split stdlib files, graded on the demo
    model's held-out files (all of them, llmx eval's 512-token windows)."""
    import shutil

    from demo_data import copy_held_out

    from llmx.calibration import CalibrationOptions, calibrate_artifact

    calib, held_out = work / "calib-text", work / "held-out"
    if not held_out.is_dir():
        calib.mkdir(exist_ok=True)
        for rel in CALIBRATION:
            shutil.copyfile(Path(sysconfig.get_paths()["stdlib"]) / rel, calib / rel.replace("/", "_"))
        held_out.mkdir()
        copy_held_out(held_out)
    options = CalibrationOptions(scheme=None, kv_cache="int8", samples=32, seq_len=512, eval_samples=1000, threads=threads)
    calibrate_artifact(art, out, calib, options, eval_data=held_out)


# -- speculative decoding ------------------------------------------------------------------------

def editing_prompts(engine, count: int, budget: int) -> list[list[int]]:
    """A held-out function, three blank lines, then its first two lines again (renamed)."""
    prompts = []
    for rel in HELD_OUT:
        source = stdlib(rel)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                body = ast.get_source_segment(source, node)
                lines = body.splitlines()
                ids = engine.encode(body + "\n\n\n" + lines[0].replace("def ", "def _", 1) + "\n" + lines[1] + "\n")
                if 150 <= len(ids) <= budget:
                    prompts.append(ids)
                if len(prompts) == count:
                    return prompts
    return prompts


def timed_generate(engine, prompt, tokens: int, drafter=None) -> tuple[list[int], float]:
    """(output ids, decode tok/s after the first token)."""
    from llmx.runtime.generate import generate
    from llmx.runtime.sampling import SamplingParams

    first = []
    start = time.perf_counter()
    seq = generate(engine.backend, engine.tokenizer, [prompt], SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True),
                   on_event=lambda e: first or first.append(time.perf_counter()), drafter=drafter)[0]
    return seq.output_ids, (len(seq.output_ids) - 1) / (time.perf_counter() - first[0])


def bench_spec(art: Path, rounds: int, tokens: int, threads: int) -> dict:
    from llmx.runtime.drafters import NgramDrafter
    from llmx.runtime.engine import Engine

    engine = Engine.load(art, threads=threads, spin=False)
    prompts = editing_prompts(engine, 4, engine.max_seq_len - tokens)
    modes = {"plain": None, "ngram k=4": 4, "ngram k=8": 8}
    rates = {m: [] for m in modes}
    stats = {m: NgramDrafter(k) for m, k in modes.items() if k}
    for r in range(rounds):
        per_round = {m: [] for m in modes}
        for i, prompt in enumerate(prompts):
            outputs = {}
            order = list(modes)[(r + i) % len(modes):] + list(modes)[: (r + i) % len(modes)]  # rotate who goes first
            for m in order:
                outputs[m], rate = timed_generate(engine, prompt, tokens, stats.get(m))
                per_round[m].append(rate)
            assert all(o == outputs["plain"] for o in outputs.values()), "speculative greedy output differs"
        for m in modes:
            rates[m].append(statistics.fmean(per_round[m]))
    result = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts], "new_tokens": tokens, "modes": {}}
    for m in modes:
        entry = {"tok_s": median(rates[m]), "speedup": median([a / b for a, b in zip(rates[m], rates["plain"])])}
        if m in stats:
            entry.update({k: v for k, v in stats[m].stats.summary().items() if k in ("acceptance_rate", "tokens_per_step")})
        result["modes"][m] = entry
    return result


# -- TTFT through the server ---------------------------------------------------------------------

def serve(art: Path, threads: int):
    from werkzeug.serving import make_server

    from llmx.serve import create_app

    app = create_app(art, threads=threads, max_batch=4, prefix_cache_mb=256)
    service = app.extensions["llmx"]
    service.wait_loaded()
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, service


def first_token_s(url: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens the server reported)."""
    import requests

    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, first, cached = time.perf_counter(), None, -1
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def bench_ttft(art: Path, rounds: int, threads: int) -> dict:
    from llmx.runtime.engine import Engine

    engine = Engine.load(art, threads=1)
    ids = engine.encode("".join(stdlib(f) for f in HELD_OUT))
    prefix_len = engine.max_seq_len - 64
    shared = ids[:prefix_len]
    server, service = serve(art, threads)
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        first_token_s(url, shared + ids[prefix_len : prefix_len + 16])  # warms the cache (and the engine)
        cold, warm, cached = [], [], []
        for r in range(rounds):
            suffix = ids[prefix_len + 16 * (r + 1) : prefix_len + 16 * (r + 2)]
            fresh = ids[(r + 1) * 997 % (len(ids) - prefix_len) :][:prefix_len]  # a prefix no request used before
            pair = [("cold", fresh + suffix), ("warm", shared + suffix)][:: 1 if r % 2 else -1]
            for kind, prompt in pair:
                seconds, hit = first_token_s(url, prompt)
                (cold if kind == "cold" else warm).append(seconds)
                if kind == "warm":
                    cached.append(hit)
    finally:
        server.shutdown()
        service.scheduler.stop()
    return {"prompt_tokens": prefix_len + 16, "shared_prefix_tokens": prefix_len, "cached_tokens_reported": median(cached),
            "ttft_cold_s": median(cold), "ttft_warm_s": median(warm), "speedup": median(cold) / median(warm)}


# -- INT8 KV cache -------------------------------------------------------------------------------

def decode_steps_ms(arts: list[Path], context: int, threads: int, reps: int = 21) -> list[float]:
    """Median time of one decode step at ``context`` cached tokens, artifacts taking turns."""
    from llmx.runtime.engine import Engine

    setups = []
    for art in arts:
        backend = Engine.load(art, threads=threads, spin=False).backend
        cache = backend.new_cache(1, context + 1)
        backend.prefill(cache, [0], [list(range(10, 10 + context))])
        setups.append((backend, cache))
    times = [[] for _ in arts]
    for _ in range(reps):
        for (backend, cache), out in zip(setups, times):
            cache.lengths[0] = context  # the step's token is rolled back: the same step every time
            start = time.perf_counter()
            backend.decode(cache, np.array([[42]]))
            out.append(time.perf_counter() - start)
    return [median(t) * 1e3 for t in times]


def bench_kv_memory(arts: dict[str, Path], model: str, threads: int) -> dict:
    from llmx.runtime.engine import Engine

    out = {}
    pair = [arts[model], arts[f"{model}-kv8"]]
    for kind, art in zip(("fp32", "int8"), pair):
        backend = Engine.load(art, threads=threads).backend
        context = backend.max_seq_len
        out[kind] = {"context": context, "bytes_1_row": backend.new_cache(1, context).nbytes(),
                     "bytes_8_rows": backend.new_cache(8, context).nbytes()}
    steps = decode_steps_ms(pair, out["fp32"]["context"] - 8, threads)
    for kind, ms in zip(("fp32", "int8"), steps):
        out[kind]["decode_step_ms_at_context"] = ms
    out["ratio"] = out["int8"]["bytes_1_row"] / out["fp32"]["bytes_1_row"]
    return out


def bench_kv_quality(arts: dict[str, Path]) -> dict:
    """The quality report ``llmx calibrate --kv-cache int8`` wrote (held-out perplexity, agreement)."""
    from llmx.artifact.manifest import load_manifest

    report = load_manifest(arts["demo-kv8"]).extras["quality"]
    return {"windows": report["evaluation"]["windows"], "seq_len": report["evaluation"]["seq_len"],
            "tokens": report["tokens"], "source": "the demo model's held-out stdlib files (scripts/demo_data.py)",
            "reference_perplexity": report["fp32"]["perplexity"], "perplexity": report["quantized"]["perplexity"],
            "perplexity_ratio": report["perplexity_ratio"], "top1_agreement": report["top1_agreement"],
            "mean_kl": report["mean_kl"]}


# -- beam forks ----------------------------------------------------------------------------------

def bench_beam(art: Path, threads: int, steps: int = 24) -> dict:
    from llmx.runtime.beam import BeamParams, BeamSearch, _Beam
    from llmx.runtime.engine import Engine

    class Gathering(BeamSearch):
        """Every step, every row gathered from its parent row (KVCache.reorder)."""

        def _fork(self, children, parents):
            self.cache.reorder(np.array([p.row for p, _, _ in children]))
            self.copied_slots += len(children) * int(self.cache.lengths[0])
            return [_Beam(i, p.tokens + [t], lp) for i, (p, t, lp) in enumerate(children)]

    engine = Engine.load(art, threads=threads, spin=False)
    prompt = engine.encode("".join(stdlib(f) for f in HELD_OUT))[: min(1024, engine.max_seq_len - steps - 1)]
    params = BeamParams(num_beams=4, max_new_tokens=steps, ignore_eos=True)
    out = {}
    for name, cls in (("fork", BeamSearch), ("gather", Gathering), ("fork again", BeamSearch)):
        search = cls(engine.backend, prompt, params, [])
        search.step()  # prefill
        start = time.perf_counter()
        hyps = search.run()
        out[name] = {"ms_per_step": (time.perf_counter() - start) * 1e3 / (steps - 1), "slots_copied": search.copied_slots,
                     "tokens": [h.token_ids for h in hyps]}
    assert out["fork"]["tokens"] == out["gather"]["tokens"], "beam results differ between fork and gather"
    row_bytes = engine.backend.new_cache(1, 1).nbytes()  # one slot of every buffer
    return {"prompt_tokens": len(prompt), "num_beams": 4, "steps": steps,
            **{k: {"ms_per_step": v["ms_per_step"], "mib_copied": v["slots_copied"] * row_bytes / 2**20}
               for k, v in out.items()}}


# -- report --------------------------------------------------------------------------------------

def report(results: dict) -> None:
    for model, spec in results.get("spec", {}).items():
        print(f"\nspeculative decoding, {model}: {spec['prompts']} code-editing prompts, {spec['new_tokens']} greedy tokens")
        print(f"  {'mode':12}{'tok/s':>9}{'speed-up':>10}{'accepted':>10}{'tok/step':>10}")
        for m, e in spec["modes"].items():
            print(f"  {m:12}{e['tok_s']:>9.1f}{e['speedup']:>9.2f}x{e.get('acceptance_rate', float('nan')):>10.1%}"
                  f"{e.get('tokens_per_step', 1.0):>10.2f}")
    for model, t in results.get("ttft", {}).items():
        print(f"\nTTFT through llmx serve, {model}: {t['prompt_tokens']}-token prompt, {t['shared_prefix_tokens']} shared")
        print(f"  cold {t['ttft_cold_s'] * 1e3:.0f} ms, warm {t['ttft_warm_s'] * 1e3:.0f} ms ({t['speedup']:.1f}x), "
              f"cached_tokens reported {t['cached_tokens_reported']}")
    for model, m in results.get("kv_memory", {}).items():
        print(f"\nKV cache at {m['fp32']['context']} tokens, {model}: fp32 {m['fp32']['bytes_1_row'] / 2**20:.1f} MiB/row, "
              f"int8 {m['int8']['bytes_1_row'] / 2**20:.1f} MiB/row ({m['ratio']:.2f}x); 8 rows "
              f"{m['fp32']['bytes_8_rows'] / 2**20:.0f} vs {m['int8']['bytes_8_rows'] / 2**20:.0f} MiB; decode step "
              f"{m['fp32']['decode_step_ms_at_context']:.1f} vs {m['int8']['decode_step_ms_at_context']:.1f} ms")
    if "kv_quality" in results:
        q = results["kv_quality"]
        print(f"\nINT8 KV quality, demo, {q['windows']} held-out windows x {q['seq_len']}: perplexity "
              f"{q['reference_perplexity']:.3f} -> {q['perplexity']:.3f} ({q['perplexity_ratio']:.4f}x), top-1 agreement "
              f"{q['top1_agreement']:.2%}, mean KL {q['mean_kl']:.5f}")
    for model, b in results.get("beam", {}).items():
        print(f"\nbeam search, {model}: {b['num_beams']} beams, {b['prompt_tokens']}-token prompt, {b['steps']} steps")
        for k in ("fork", "gather", "fork again"):
            print(f"  {k:11}{b[k]['ms_per_step']:>8.1f} ms/step{b[k]['mib_copied']:>10.1f} MiB copied")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="spec,ttft,kv,beam")
    parser.add_argument("--models", default="demo,smollm")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".cache" / "decoding")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sections, models = args.sections.split(","), args.models.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    arts = artifacts(args.work, models, args.threads)
    results: dict = {"machine": {"cpus": __import__("os").cpu_count(), "threads": args.threads}}
    started = time.time()
    for model in models:
        if "spec" in sections:
            results.setdefault("spec", {})[model] = bench_spec(arts[model], args.rounds, args.tokens, args.threads)
        if "ttft" in sections:
            results.setdefault("ttft", {})[model] = bench_ttft(arts[model], args.rounds, args.threads)
        if "kv" in sections and model == "smollm":
            results.setdefault("kv_memory", {})[model] = bench_kv_memory(arts, model, args.threads)
        if "beam" in sections:
            results.setdefault("beam", {})[model] = bench_beam(arts[model], args.threads)
    if "kv" in sections and "demo" in models:
        results["kv_quality"] = bench_kv_quality(arts)
    results["seconds"] = round(time.time() - started, 1)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
