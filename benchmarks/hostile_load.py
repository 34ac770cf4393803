"""Normal streaming clients alone, then beside one hostile client: does anyone hold the server?

    python benchmarks/hostile_load.py                         # demo model, 32 clients, 2 rounds of 20 s phases
    python benchmarks/hostile_load.py --clients 16 --seconds 15 --json out.json

``llmx serve`` runs in a subprocess on loopback. Each phase, ``--clients`` threads stream
completions back to back (max_tokens 32) for ``--seconds``; the client-side gaps between a
stream's text chunks are its inter-token latencies (ITL). In the "hostile" phase one more client
sends, one after another: two 240 kB stop strings, four stop strings at the 4096-character cap,
``n`` = 64, ``logprobs`` = 20 with ``n`` = 8, a 1 MB prompt, a lone surrogate; and 16 slow-loris
connections trickle request bodies a byte a second. Phases alternate (alone, hostile, alone, ...)
so drift on a shared host hits both. Reported: normal clients' errors, ITL p50/p99, TTFT p50,
server RSS, and p99 ITL hostile / alone (the target: within 1.5x, 0 errors).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import PROMPTS, Server, build_artifact  # noqa: E402

HOSTILE = [
    ("stop 2 x 240 kB", {"prompt": "def f(x):", "max_tokens": 16, "stop": ["z" * 240000, "y" * 240000]}),
    ("stop 4 x 4096 chars", {"prompt": "def f(x):", "max_tokens": 64, "stop": ["z" * 4095 + "y"] * 4, "ignore_eos": True}),
    ("n = 64", {"prompt": "import os", "max_tokens": 16, "n": 64}),
    ("logprobs 20, n = 8", {"prompt": "class A:", "max_tokens": 64, "logprobs": 20, "n": 8, "ignore_eos": True}),
    ("1 MB prompt", {"prompt": "x " * 500_000, "max_tokens": 16}),
    ("lone surrogate", {"prompt": "a\ud800b", "max_tokens": 4}),
]


def demo_artifact(workdir: Path) -> Path:
    art = workdir / "art-demo"
    if not (art / "llmx.json").is_file():
        import llmx
        from llmx.export import export_checkpoint

        export_checkpoint(Path(llmx.__file__).parent / "demo_model", art)
    return art


def normal_client(url: str, until: float, seed: int) -> dict:
    """Streams back to back until ``until``; the gaps between text chunks, TTFTs, errors."""
    gaps, ttfts, errors, done = [], [], [], 0
    body = {"max_tokens": 32, "temperature": 0.8, "stream": True}
    while time.monotonic() < until:
        start = last = time.perf_counter()
        first, finished = None, False
        try:
            with requests.post(url + "/v1/completions", json={**body, "prompt": PROMPTS[seed % len(PROMPTS)], "seed": seed},
                               stream=True, timeout=(10, 120)) as r:
                if r.status_code != 200:
                    errors.append(f"HTTP {r.status_code}")
                    continue
                for line in r.iter_lines():
                    if line == b"data: [DONE]":
                        finished = True
                        break
                    if not line.startswith(b"data: "):
                        continue
                    chunk, now = json.loads(line[6:]), time.perf_counter()
                    if "error" in chunk:
                        errors.append(chunk["error"]["message"][:120])
                        continue
                    if not any(c["text"] for c in chunk["choices"]):
                        continue
                    if first is None:
                        first = now
                        ttfts.append(now - start)
                    else:
                        gaps.append(now - last)
                    last = now
        except (requests.RequestException, ValueError) as exc:
            errors.append(type(exc).__name__)
            continue
        if not finished:
            errors.append("stream ended without [DONE]")
        done += 1
        seed += 1000
    return {"gaps": gaps, "ttfts": ttfts, "errors": errors, "requests": done}


def hostile_client(url: str, until: float) -> dict:
    statuses: dict[str, list[int]] = {name: [] for name, _ in HOSTILE}
    lorises = [slow_loris(url) for _ in range(16)]
    i = 0
    while time.monotonic() < until:
        name, body = HOSTILE[i % len(HOSTILE)]
        try:
            statuses[name].append(requests.post(url + "/v1/completions", json=body, timeout=120).status_code)
        except requests.RequestException as exc:
            statuses[name].append(type(exc).__name__)
        for sock in lorises:
            try:
                sock.send(b" ")
            except OSError:
                pass
        i += 1
    for sock in lorises:
        sock.close()
    return statuses


def slow_loris(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{")
    return sock


def phase(server: Server, clients: int, seconds: float, hostile: bool) -> dict:
    until = time.monotonic() + seconds
    with ThreadPoolExecutor(clients + 1) as pool:
        normal = [pool.submit(normal_client, server.url, until, seed) for seed in range(clients)]
        bad = pool.submit(hostile_client, server.url, until) if hostile else None
        results = [f.result() for f in normal]
    gaps = sorted(g for r in results for g in r["gaps"])
    ttfts = sorted(t for r in results for t in r["ttfts"])
    return {
        "hostile": hostile, "requests": sum(r["requests"] for r in results),
        "errors": [e for r in results for e in r["errors"]],
        "itl_p50_ms": 1e3 * quantile(gaps, 0.5), "itl_p99_ms": 1e3 * quantile(gaps, 0.99),
        "ttft_p50_ms": 1e3 * quantile(ttfts, 0.5), "rss_mib": server.rss_mib(),
        "hostile_statuses": bad.result() if bad else None,
    }


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["demo", "tiny", "small"], default="demo")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llmx-load-test")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-cache-mb", type=int, default=None, help="passed to llmx serve (default: its own)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    art = demo_artifact(args.workdir) if args.model == "demo" else build_artifact(args.model, args.workdir)
    extra = () if args.prefix_cache_mb is None else ("--prefix-cache-mb", str(args.prefix_cache_mb))
    # max_queue covers 32 clients + n = 64 + logprobs' 8: the point is fairness, not 429s.
    server = Server(art, max_batch=8, max_queue=128, threads=args.threads, extra=extra)
    try:
        rss_start = server.rss_mib()
        phase(server, args.clients, min(args.seconds, 5), hostile=False)  # warm-up
        runs = [phase(server, args.clients, args.seconds, hostile=h) for _ in range(args.rounds) for h in (False, True)]
    finally:
        server.stop()
    report(runs, rss_start, args)


def report(runs: list[dict], rss_start: float, args) -> None:
    print(f"model {args.model}, {args.clients} normal streaming clients, {args.rounds} x {args.seconds:g} s per phase; "
          f"server RSS at start {rss_start:.1f} MiB")
    print("| phase | requests | errors | ITL p50 ms | ITL p99 ms | TTFT p50 ms | RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {'with hostile' if r['hostile'] else 'alone'} | {r['requests']} | {len(r['errors'])} | {r['itl_p50_ms']:.1f} "
              f"| {r['itl_p99_ms']:.1f} | {r['ttft_p50_ms']:.0f} | {r['rss_mib']:.1f} |")
    alone = statistics.median(r["itl_p99_ms"] for r in runs if not r["hostile"])
    hostile = statistics.median(r["itl_p99_ms"] for r in runs if r["hostile"])
    errors = sum(len(r["errors"]) for r in runs)
    print(f"p99 ITL with hostile / alone: {hostile / alone:.2f}x (median of rounds); normal-client errors: {errors}")
    for r in runs:
        if r["hostile_statuses"]:
            print("hostile answers:", {k: sorted(set(map(str, v))) for k, v in r["hostile_statuses"].items()})
            break
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "rss_start_mib": rss_start, "p99_ratio": hostile / alone,
                                         "normal_errors": errors, "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1))


if __name__ == "__main__":
    main()
