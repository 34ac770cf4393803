"""``llmx serve`` against llama-server on a real chat model, quantized, both servers on their defaults.

    python benchmarks/server_defaults.py \\
        --pair fp32=ART_FP32:F32.gguf --pair w4=ART_W4:Q4_K_M.gguf --pair w4=ART_W4:Q4_0.gguf \\
        --pair w8=ART_W8:Q8_0.gguf
    python benchmarks/server_defaults.py --pair fp32=A:F.gguf --concurrency 1,8 --rounds 1 --tokens 32

Each ``--pair NAME=ARTIFACT:GGUF`` is one llmx artifact (``llmx export``/``calibrate`` of a real
checkpoint) and the GGUF llama.cpp's own tools wrote from the same checkpoint. Unlike
benchmarks/server_peers.py (random weights, both caches off, ``--no-warmup``), every server keeps
its defaults; the one setting a deployment must choose is the number of concurrent sequences, so
llmx gets ``--max-batch C`` and llama-server ``-np C`` (C = the clients), and both get 2 threads.
``--llmx-args``/``--llama-args`` add flags for a tuned pair, reported under its own name.

C clients each stream one chat completion (the model's own template, a short distinct question
per client, ``--tokens`` new tokens, greedy, EOS ignored so every stream has the same length);
aggregate tok/s = C x tokens / (last stream done - first request sent). ``--sample T,P`` asks
for temperature T and top_p P instead of greedy (what chat clients send; each server applies its
own defaults for the rest: llama-server adds its top_k 40 and min_p 0.05, llmx nothing). Rounds are interleaved:
at each level the two servers take turns (the order alternates every round), so a shared host's
background load falls on both alike; the ratio llmx / llama-server is taken per round, then the
median. Writes benchmarks/results/server_defaults_<date>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from server_peers import LLAMA_SERVER, Server, free_port, log  # noqa: E402

SUBJECTS = ["tides", "volcanoes", "bread", "glaciers", "bees", "comets", "rivers", "the moon", "coffee", "bridges",
            "owls", "deserts", "rainbows", "salt", "maps", "clocks", "whales", "copper", "tea", "lightning", "maple trees",
            "sand dunes", "penguins", "paper", "wind", "coral reefs", "silk", "thunder", "caves", "honey", "trains",
            "mushrooms", "fog", "lighthouses", "cheese", "eclipses", "ants", "glass", "rain", "kites", "wolves", "ink",
            "snow", "canals", "tulips", "iron", "islands", "bats", "sugar", "stars", "moss", "ships", "frogs", "wool",
            "earthquakes", "rice", "clouds", "bicycles", "octopuses", "chalk", "lakes", "foxes", "marble", "seeds"]
ASKS = ["Explain in a few sentences how {} form.", "Tell me three facts about {}.", "Why are {} important to people?",
        "Describe {} to a child.", "Write a short poem about {}."]


def questions(c: int, rnd: int) -> list[str]:
    """C distinct questions, different in every round (no prompt is asked twice)."""
    ask = ASKS[rnd % len(ASKS)]
    return [ask.format(SUBJECTS[(rnd * 7 + i) % len(SUBJECTS)]) + f" ({rnd}.{i})" for i in range(c)]


def llmx_server(artifact: Path, slots: int, threads: int, extra: list[str]) -> Server:
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("llmx")), "serve", str(artifact), "--port", str(port),
           "--max-batch", str(slots), "--max-queue", str(max(64, slots)), "--threads", str(threads), "--quiet", *extra]
    return Server(f"llmx {artifact.name} C={slots}", cmd, port, "/ready")


def llama_server(gguf: Path, slots: int, threads: int, extra: list[str]) -> Server:
    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-t", str(threads), "-tb", str(threads), *extra]
    return Server(f"llama-server {gguf.name} -np {slots}", cmd, port, "/health")


# What each request asks for beside its question: greedy, or --sample's temperature and top_p.
SAMPLING = {"temperature": 0}


def stream_chat(url: str, question: str, tokens: int, start: threading.Barrier, out: dict) -> None:
    import requests

    body = {"messages": [{"role": "user", "content": question}], "max_tokens": tokens, **SAMPLING,
            "ignore_eos": True, "stream": True}
    start.wait()
    out["sent"] = time.perf_counter()
    pieces = 0
    try:
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    break
                for choice in json.loads(line[6:]).get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        pieces += 1
                        out.setdefault("first", time.perf_counter())
                    out["finish"] = choice.get("finish_reason") or out.get("finish")
    except Exception as exc:  # noqa: BLE001 -- a dropped stream is a result (counted), not a crash
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    out["done"] = time.perf_counter()
    out["pieces"] = pieces


def clients(url: str, qs: list[str], tokens: int) -> dict:
    """C streams at once. A stream that fails or ends before ``tokens`` is counted in ``failed``
    and the round's tok/s counts only the complete ones."""
    outs = [{} for _ in qs]
    barrier = threading.Barrier(len(qs))
    threads = [threading.Thread(target=stream_chat, args=(url, q, tokens, barrier, o)) for q, o in zip(qs, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [o for o in outs if o.get("finish") == "length" and "error" not in o]
    failed = [o.get("error") or f"finish_reason {o.get('finish')}" for o in outs if o not in ok]
    if failed:
        log(f"{url}: {len(failed)} of {len(outs)} streams failed: {failed[0]}")
    wall = max(o["done"] for o in outs) - min(o["sent"] for o in outs)
    return {"tok_s": len(ok) * tokens / wall, "wall_s": wall, "failed": len(failed),
            "ttft_s": statistics.median([o["first"] - o["sent"] for o in ok if "first" in o] or [float("nan")])}


def rss_mib(server: Server) -> float:
    import psutil

    return round(psutil.Process(server.proc.pid).memory_info().rss / 2**20, 1)


def run_pair(name: str, artifact: Path, gguf: Path, args) -> dict:
    """Every concurrency level of one pair. Only the two servers of one level run at a time:
    llama-server's default context is the model's whole window for each of its -np slots (12 GB
    of F32 KV for the 135M model at -np 64), so all levels at once would not fit in 24 GiB."""
    results = {f"c{c}": {"llmx": [], "llama-server": []} for c in args.concurrency}
    for c in args.concurrency:
        servers: dict[str, Server] = {}
        try:
            servers["llmx"] = llmx_server(artifact, c, args.threads, args.llmx_args)
            servers["llama-server"] = llama_server(gguf, c, args.threads, args.llama_args)
            for s in servers.values():  # graphs, thread pools, KV of every slot, drafting widths
                clients(s.url, questions(c, 99), 16)
            for rnd in range(args.rounds):
                qs = questions(c, rnd)
                for engine in ["llmx", "llama-server"][:: 1 if rnd % 2 == 0 else -1]:
                    results[f"c{c}"][engine].append(clients(servers[engine].url, qs, args.tokens))
                r = results[f"c{c}"]
                log(f"{name} C={c} round {rnd + 1}: llmx {r['llmx'][-1]['tok_s']:.1f}, "
                    f"llama-server {r['llama-server'][-1]['tok_s']:.1f} tok/s")
            results[f"c{c}"]["rss_mib"] = {e: rss_mib(s) for e, s in servers.items()}
        finally:
            for s in servers.values():
                s.close()
    return results


def summarize(data: dict) -> tuple[str, dict]:
    rows, ratios = [], {}
    for pair, res in data.items():
        ratios[pair] = {}
        for key, per in res["results"].items():
            rss = per.pop("rss_mib", {})
            failed = {e: sum(r.get("failed", 0) for r in runs) for e, runs in per.items()}
            med = {e: statistics.median(r["tok_s"] for r in runs) for e, runs in per.items()}
            ratio = statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(per["llmx"], per["llama-server"]))
            ratios[pair][key] = round(ratio, 3)
            ttft = {e: statistics.median(r["ttft_s"] for r in runs) * 1000 for e, runs in per.items()}
            rows.append(f"| {pair} | {res['gguf']} | {key[1:]} | {med['llmx']:.1f} | {med['llama-server']:.1f} | "
                        f"**{ratio:.2f}x** | {ttft['llmx']:.0f} / {ttft['llama-server']:.0f} | "
                        f"{rss.get('llmx', 0):.0f} / {rss.get('llama-server', 0):.0f} | {failed['llmx']} / {failed['llama-server']} |")
            per["rss_mib"] = rss
    head = ("| llmx artifact | llama-server GGUF | C | llmx tok/s | llama-server tok/s | llmx / llama-server | "
            "median TTFT ms (llmx / llama) | RSS MiB after (llmx / llama) | failed streams |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(rows) + "\n", ratios


def plot(ratios: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for pair, per in ratios.items():
        levels = [int(k[1:]) for k in per]
        ax.plot(levels, list(per.values()), marker="o", label=pair)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streaming clients (C)")
    ax.set_ylabel("aggregate tok/s, llmx / llama-server")
    ax.set_title("llmx serve vs llama-server, both on defaults")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", action="append", required=True, metavar="NAME=ARTIFACT:GGUF")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llmx-args", default="", help="extra `llmx serve` flags (a tuned run)")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags (a tuned run)")
    ap.add_argument("--sample", metavar="T,P", help="sampled requests: temperature T, top_p P (default greedy)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if args.sample:
        temperature, top_p = (float(v) for v in args.sample.split(","))
        SAMPLING.update(temperature=temperature, top_p=top_p)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.llmx_args, args.llama_args = args.llmx_args.split(), args.llama_args.split()
    if not LLAMA_SERVER.is_file():
        sys.exit("llama-server is not built: run benchmarks/build_llama_server.sh")
    pairs = []
    for spec in args.pair:
        name, _, paths = spec.partition("=")
        artifact, _, gguf = paths.partition(":")
        if not (Path(artifact) / "llmx.json").is_file() or not Path(gguf).is_file():
            sys.exit(f"--pair {spec}: need an llmx artifact directory and a GGUF file")
        pairs.append((name, Path(artifact), Path(gguf)))
    load_start = round(os.getloadavg()[0], 2)
    started = time.time()
    data = {}
    for name, artifact, gguf in pairs:
        key = f"{name} vs {gguf.stem}"
        data[key] = {"artifact": str(artifact), "gguf": gguf.name, "results": run_pair(key, artifact, gguf, args)}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "server_defaults_partial.json").write_text(json.dumps(data, indent=1))  # a crash keeps these
    table, ratios = summarize(data)
    meta = {"concurrency": args.concurrency, "tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
            "llmx_args": args.llmx_args, "llama_args": args.llama_args, "sampling": SAMPLING, "date": time.strftime("%Y-%m-%d %H:%M"),
            "cpus": os.cpu_count(), "load_avg_1m_at_start": load_start,
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "wall_s": round(time.time() - started),
            "command": " ".join(["python", *sys.argv])}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"server_defaults_{time.strftime('%Y-%m-%d_%H%M')}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "ratios": ratios, "pairs": data}, indent=1))
    (args.out / "server_defaults_partial.json").unlink(missing_ok=True)
    tuned = f"; llmx {' '.join(args.llmx_args)}" * bool(args.llmx_args) + f"; llama {' '.join(args.llama_args)}" * bool(args.llama_args)
    asked = "greedy" if not SAMPLING["temperature"] else f"temperature {SAMPLING['temperature']}, top_p {SAMPLING['top_p']}"
    header = (f"{args.threads} threads each, {args.rounds} interleaved rounds, {args.tokens} tokens per stream, {asked}, "
              f"defaults{tuned}; load average {load_start} -> {meta['load_avg_1m_at_end']} on {os.cpu_count()} CPUs; "
              f"{meta['wall_s']} s\n\n")
    stem.with_suffix(".md").write_text(header + table)
    plot(ratios, stem.with_suffix(".png"))
    print(header + table)
    log(f"wrote {stem}.json/.md/.png")


if __name__ == "__main__":
    main()
