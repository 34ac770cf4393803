"""Load test for ``llmx serve``: many concurrent streaming clients, then batching throughput.

    python benchmarks/load_test.py                      # small random Llama (32k vocab), 500 requests x 64 clients
    python benchmarks/load_test.py --model tiny         # the test suite's tiny Llama
    python benchmarks/load_test.py --model demo         # the built-in demo model (4.9M, real weights)
    python benchmarks/load_test.py --requests 100 --json out.json --plot out.png
    python benchmarks/load_test.py --artifact artifacts/demo-int8   # an artifact you built

Everything runs on loopback: the script exports a random-weight Llama (tests/checkpoints.py
plus a 32k BPE tokenizer trained on the stdlib, so every sampled id is real text and every
token is one SSE chunk, as with a real model), starts ``llmx serve`` in a subprocess and:

1. load: ``--requests`` streamed completions from ``--concurrency`` client threads; counts
   5xx/4xx answers and truncated streams (no finish_reason or no ``data: [DONE]``), and the
   server's RSS before (after a warm-up at the same concurrency) and after;
2. throughput: K = 1, 2, 4, 8 simultaneous streams of ``--tokens`` tokens each (ignore_eos),
   ``--rounds`` times; aggregate decode tok/s = sum(tokens - 1) / (last token - first token
   over all K streams). The ratio at 8 vs 1 shows what continuous batching buys.

Bounded: a wall-clock limit (``--time-limit``) and per-request timeouts; nothing leaves the host.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    # name: (checkpoint overrides, tokenizer vocab or None for the tests' 320-token one)
    "tiny": ({}, None),
    "small": (dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=1024), 32000),
    "demo": None,  # llmx/demo_model as it ships: a small code model with real weights
}
PROMPTS = ["def fibonacci(n):", "import json\n\n", "class Parser:\n    def __init__(self", "# Compute the mean of",
           "for i in range(10):", "The quick brown fox", "SELECT name FROM users WHERE", "while True:\n"]


# -- the artifact ------------------------------------------------------------------------------

def train_big_tokenizer(directory: Path, vocab: int) -> None:
    """A ``vocab``-token BPE on stdlib source, with the tests' special tokens at the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"tokenizer reached only {tok.get_vocab_size()} of {vocab} tokens")
    tok.save(str(directory / "tokenizer.json"))


def make_big_vocab_checkpoint(directory: Path, vocab: int, **overrides) -> Path:
    """tests/checkpoints.py's recipe (random Llama, weights scaled), with a real ``vocab``-token
    tokenizer, so every sampled id is text and every token is one SSE chunk, as with real models."""
    import torch
    import transformers as T
    from checkpoints import make_config, train_tokenizer

    train_tokenizer(directory)  # tokenizer_config.json (special tokens, chat template)
    train_big_tokenizer(directory, vocab)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(make_config("llama", vocab, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(2.5)
    model.eval().save_pretrained(directory)
    return directory


def build_artifact(model: str, workdir: Path) -> Path:
    art = workdir / f"art-{model}"
    if (art / "llmx.json").is_file():
        return art
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import make_checkpoint

    from llmx.export import export_checkpoint

    if MODELS[model] is None:
        export_checkpoint(ROOT / "llmx" / "demo_model", art)
        return art
    overrides, vocab = MODELS[model]
    ckpt = workdir / f"ckpt-{model}"
    if vocab:
        make_big_vocab_checkpoint(ckpt, vocab, **overrides)
    else:
        make_checkpoint(ckpt, "llama", **overrides)
    export_checkpoint(ckpt, art)
    return art


# -- the server --------------------------------------------------------------------------------

class Server:
    def __init__(self, artifact: Path, max_batch: int, max_queue: int, threads: int, spin: bool | None = None,
                 extra: tuple[str, ...] = ()):
        # spin None: the server's own default (runtime/cpu_plan.py decides from the free cores)
        cmd = [sys.executable, "-m", "llmx.cli", "serve", str(artifact), "--host", "127.0.0.1", "--port", "0", "--quiet",
               "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--threads", str(threads),
               *([] if spin is None else ["--spin" if spin else "--no-spin"]), *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if not match:
            self.proc.kill()
            raise SystemExit(f"server did not start: {line}{self.proc.stderr.read()}")
        self.url = match.group(1)
        self.ps = psutil.Process(self.proc.pid)
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep the pipe drained

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- the clients -------------------------------------------------------------------------------

def stream(url: str, body: dict, timeout: float = 300) -> dict:
    """One streamed completion; what arrived and when."""
    start = time.perf_counter()
    out = {"status": None, "done": False, "finish": None, "tokens": 0, "first": None, "last": None, "error": None}
    try:
        with requests.post(url + "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                           stream=True, timeout=(10, timeout)) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                return out
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    out["done"] = True
                    break
                chunk = json.loads(line[6:])
                now = time.perf_counter() - start
                for c in chunk["choices"]:
                    if c["text"]:
                        out["first"] = out["first"] if out["first"] is not None else now
                        out["last"] = now
                    out["finish"] = c["finish_reason"] or out["finish"]
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
    except (requests.RequestException, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    out["start"] = start
    return out


def load_phase(url: str, n: int, concurrency: int, deadline: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    bodies = [{"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(16, 96), "temperature": 0.8, "seed": i}
              for i in range(n)]

    def run(body):
        if time.monotonic() > deadline:
            return {"status": None, "error": "skipped: time limit", "done": False, "finish": None, "tokens": 0}
        return stream(url, body)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(run, bodies))


def throughput(url: str, k: int, tokens: int) -> float:
    """Aggregate decode tok/s of k simultaneous streams of ``tokens`` tokens each."""
    body = {"max_tokens": tokens, "temperature": 0.8, "ignore_eos": True}
    with ThreadPoolExecutor(k) as pool:
        results = list(pool.map(lambda i: stream(url, {**body, "prompt": PROMPTS[i % len(PROMPTS)], "seed": i}), range(k)))
    if any(r["status"] != 200 or not r["done"] or r["first"] is None for r in results):
        raise SystemExit(f"throughput run failed: {results}")
    first = min(r["start"] + r["first"] for r in results)
    last = max(r["start"] + r["last"] for r in results)
    return sum(r["tokens"] - 1 for r in results) / (last - first)


# -- report ------------------------------------------------------------------------------------

def summarize_load(results: list[dict], rss_before: float, rss_after: float, wall: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    truncated = [r for r in ok if not r["done"] or r["finish"] not in ("stop", "length")]
    ttfts = sorted(r["first"] for r in ok if r.get("first") is not None)
    return {
        "requests": len(results),
        "ok": len(ok),
        "status_5xx": sum(1 for r in results if r["status"] and r["status"] >= 500),
        "status_4xx": sum(1 for r in results if r["status"] and 400 <= r["status"] < 500),
        "errors": sum(1 for r in results if r["error"]),
        "truncated_streams": len(truncated),
        "tokens": sum(r["tokens"] for r in ok),
        "wall_s": round(wall, 1),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
        "ttft_p95_s": round(ttfts[int(len(ttfts) * 0.95)], 3) if ttfts else None,
        "rss_before_mib": round(rss_before, 1),
        "rss_after_mib": round(rss_after, 1),
        "rss_growth_pct": round(100 * (rss_after - rss_before) / rss_before, 2),
        "first_errors": [r["error"] for r in results if r["error"]][:3],
    }


def plot(rates: dict[int, float], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(rates)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ks, [rates[k] for k in ks], "o-", label="llmx serve (continuous batching)")
    ax.plot(ks, [rates[1] * k for k in ks], ":", color="gray", label="linear scaling")
    ax.set(xlabel="concurrent streams", ylabel="aggregate decode tok/s", title=f"llmx serve, {model} model, loopback")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--artifact", type=Path, help="serve this artifact instead of building --model's (e.g. the quickstart's)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llmx-load-test")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads of the server")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream in the throughput runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--time-limit", type=float, default=1200, help="seconds for the whole load phase")
    ap.add_argument("--spin", action=argparse.BooleanOptionalAction, default=None,
                    help="start the server with --spin or --no-spin (default: neither, the server decides)")
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--server-args", default="", help="more llmx serve flags, e.g. '--prefix-cache-mb 0'")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    art = args.artifact or build_artifact(args.model, args.workdir)
    model = art.name if args.artifact else args.model  # what the report and the plot name
    server = Server(art, args.max_batch, args.max_queue, args.threads, args.spin, tuple(shlex.split(args.server_args)))
    report: dict = {"model": model, "artifact": str(art), "max_batch": args.max_batch, "max_queue": args.max_queue,
                    "spin": args.spin}
    try:
        if not args.skip_load:
            load_phase(server.url, args.concurrency, args.concurrency, time.monotonic() + 300, seed=1)  # warm-up
            rss_before = server.rss_mib()
            start = time.monotonic()
            results = load_phase(server.url, args.requests, args.concurrency, start + args.time_limit, seed=2)
            report["load"] = summarize_load(results, rss_before, server.rss_mib(), time.monotonic() - start)
            print_load(report["load"], args.concurrency)
        levels = [int(k) for k in args.levels.split(",")]
        rates: dict[int, list[float]] = {k: [] for k in levels}
        for _ in range(args.rounds):  # interleaved, so machine noise hits every level alike
            for k in levels:
                rates[k].append(throughput(server.url, k, args.tokens))
        medians = {k: statistics.median(v) for k, v in rates.items()}
        report["throughput"] = {"tokens_per_stream": args.tokens, "rounds": args.rounds,
                                "tok_s": {str(k): [round(x, 1) for x in v] for k, v in rates.items()},
                                "median_tok_s": {str(k): round(v, 1) for k, v in medians.items()}}
        top = max(levels)
        if 1 in medians and top > 1:
            # Both: the ratio of medians, and the median of each round's side-by-side ratio.
            per_round = [hi / lo for hi, lo in zip(rates[top], rates[1])]
            report["throughput"][f"ratio_{top}_vs_1"] = round(medians[top] / medians[1], 2)
            report["throughput"][f"ratio_{top}_vs_1_per_round"] = [round(r, 2) for r in per_round]
            report["throughput"][f"ratio_{top}_vs_1_median_of_rounds"] = round(statistics.median(per_round), 2)
        print_throughput(report["throughput"])
        if args.plot:
            plot(medians, args.plot, model)
    finally:
        server.stop()
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def print_load(s: dict, concurrency: int) -> None:
    print(f"\nload: {s['requests']} streamed requests, {concurrency} concurrent clients, {s['wall_s']} s")
    print(f"  ok {s['ok']}  5xx {s['status_5xx']}  4xx {s['status_4xx']}  client errors {s['errors']}  "
          f"truncated streams {s['truncated_streams']}  tokens {s['tokens']}")
    print(f"  TTFT p50 {s['ttft_p50_s']} s  p95 {s['ttft_p95_s']} s")
    print(f"  server RSS {s['rss_before_mib']} MiB -> {s['rss_after_mib']} MiB ({s['rss_growth_pct']:+.2f} %)")


def print_throughput(t: dict) -> None:
    print(f"\nthroughput ({t['tokens_per_stream']} tokens per stream, median of {t['rounds']}):")
    print("  streams | aggregate decode tok/s | runs")
    for k, v in t["median_tok_s"].items():
        print(f"  {k:>7} | {v:>22} | {t['tok_s'][k]}")
    for key, value in t.items():
        if key.startswith("ratio"):
            print(f"  {key}: {value}x")


if __name__ == "__main__":
    main()
