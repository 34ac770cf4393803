"""``llmx serve`` against llama.cpp's llama-server and onnxruntime-genai's batched generator.

    python benchmarks/server_peers.py                 # SmolLM-135M shape, fp32, 3 interleaved rounds
    python benchmarks/server_peers.py --quick         # 1 round, C = 1, 8, 16 tokens, 1k prompts
    python benchmarks/server_peers.py --shape tinyllama --concurrency 1,8 --long 2048

One checkpoint (random weights, benchmarks/smollm_shape.py's shape with 8,704 positions so an
8k prompt fits) feeds all three engines: llmx (``llmx export`` + ``llmx optimize``, served by
``llmx serve``), llama-server (F32 GGUF from llama.cpp's own converter, built by
benchmarks/build_llama_server.sh from the llama-cpp-python version the peers venv pins) and
onnxruntime-genai (its model builder, fp32, 2 intra-op threads, driven in-process in the peers
venv). Every engine gets 2 threads and the same token ids.

1. Concurrency: C = 1, 8, 32 clients each stream one completion of ``--tokens`` tokens (greedy,
   EOS ignored) at once; aggregate tok/s = C x tokens / (last stream done - first request sent).
   llmx runs with ``--max-batch C`` and llama-server with ``-np C`` (continuous batching), so both
   have C slots; genai generates one batch of C. Each round uses new prompts (no prefix-cache hits).
2. Long prompts: time to the first token of a ``--long`` (2k, 8k) token prompt, alone on the
   one-slot servers (llmx ``--max-batch 1``; llama-server ``-np 1 -c 8704``), and genai's append
   + first token (a batch of one).
3. llmx decode step time at 8k context vs 128 (in-process, one row, the served artifact).

Engines take turns within each round (the order rotates), so a shared host's background load falls
on all alike; ratios are taken per round, then the median. Writes
benchmarks/results/server_<date>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMA_SERVER = HERE / ".peers-build" / "llama-server"
CONTEXT = 8704  # positions: an 8k prompt plus room to generate
WARM_UP_TOKENS = 4
SHAPES = {
    # benchmarks/smollm_shape.py's SmolLM-135M, and TinyLlama-1.1B's shape (random weights)
    "smollm": {},
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- models --------------------------------------------------------------------------------------

def build_checkpoint(directory: Path, shape: str) -> Path:
    if (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file():
        return directory
    import torch
    import transformers
    from smollm_shape import SMOLLM_135M, write_tokenizer

    config = {**SMOLLM_135M, **SHAPES[shape], "max_position_embeddings": CONTEXT}
    log(f"checkpoint {shape} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']})")
    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, config["vocab_size"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval().save_pretrained(directory)
    return directory


def build_models(cache: Path, shape: str, engines: list[str]) -> dict[str, Path]:
    from peers import build_genai, build_gguf

    llmx = str(Path(sys.executable).with_name("llmx"))
    ckpt = build_checkpoint(cache / f"{shape}-8k-ckpt", shape)
    paths = {"ckpt": ckpt}
    art, opt = cache / f"{shape}-8k-art", cache / f"{shape}-8k-art-opt"
    if not (opt / "llmx.json").is_file():
        if not (art / "llmx.json").is_file():
            log("llmx export")
            subprocess.run([llmx, "export", str(ckpt), "-o", str(art)], check=True)
        log("llmx optimize")
        subprocess.run([llmx, "optimize", str(art), "-o", str(opt)], check=True)
    paths["llmx"] = opt
    if "llama-server" in engines:
        paths["gguf"] = build_gguf(ckpt, cache / f"{shape}-8k-f32.gguf", log)
    if "genai" in engines:
        paths["genai"] = build_genai(ckpt, cache / f"{shape}-8k-genai-fp32", log, "fp32")
    return paths


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(8, vocab, size=(n, length)).tolist()  # ids below 8 are the specials


# -- servers -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An OpenAI-compatible completion server in a subprocess, on a free loopback port."""

    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str):
        self.name, self.port, self.ready_path = name, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        # A file, not a pipe: nobody reads a pipe while the server runs, and a server that logs
        # every request (llama-server does) blocks mid-stream once the pipe's 64 KiB are full.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 600) -> None:
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited: {self.log.read().decode(errors='replace')[-2000:]}")
            try:
                if requests.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def llmx_server(artifact: Path, slots: int, threads: int, extra: list[str]) -> Server:
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("llmx")), "serve", str(artifact), "--port", str(port), "--max-batch",
           str(slots), "--max-queue", "64", "--threads", str(threads), "--quiet", "--prefix-cache-mb", "0", *extra]
    return Server(f"llmx C={slots}", cmd, port, "/ready")


def llama_server(gguf: Path, slots: int, threads: int, context: int) -> Server:
    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(context), "-t", str(threads), "-tb", str(threads), "-cb", "--no-warmup"]
    return Server(f"llama-server -np {slots}", cmd, port, "/health")


# llama-server would reuse a slot's KV of an earlier prompt; llmx's prefix cache is off (--prefix-cache-mb 0).
NO_CACHE = {"cache_prompt": False}


def stream_one(url: str, prompt: list[int], tokens: int, start: threading.Barrier, out: dict, extra: dict) -> None:
    import requests

    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True, **extra}
    start.wait()
    out["sent"] = time.perf_counter()
    finish = None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if "first" not in out:
                out["first"] = time.perf_counter()
            if line == b"data: [DONE]":
                break
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
    out["done"] = time.perf_counter()
    out["finish"] = finish


def concurrent_streams(url: str, prompt_ids: list[list[int]], tokens: int, extra: dict | None = None) -> dict:
    """C streams at once; aggregate tok/s over the whole wall time (prefill included)."""
    outs = [{} for _ in prompt_ids]
    barrier = threading.Barrier(len(prompt_ids))
    threads = [threading.Thread(target=stream_one, args=(url, p, tokens, barrier, o, extra or {})) for p, o in zip(prompt_ids, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [o.get("finish") for o in outs if o.get("finish") != "length"]
    if bad:
        raise RuntimeError(f"{url}: {len(bad)} streams did not end by length: {bad[:3]}")
    wall = max(o["done"] for o in outs) - min(o["sent"] for o in outs)
    return {"tok_s": len(outs) * tokens / wall, "wall_s": wall,
            "ttft_s": statistics.median(o["first"] - o["sent"] for o in outs)}


def time_to_first_token(url: str, prompt: list[int], extra: dict) -> float:
    import requests

    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, **extra}
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    return time.perf_counter() - t0


# -- onnxruntime-genai, in the peers venv ----------------------------------------------------------

class GenaiWorker:
    """This file run under the peers' python as ``--genai-worker MODEL``: one JSON line per command."""

    def __init__(self, model: Path, threads: int):
        from peers import PEERS_PYTHON

        cmd = [str(PEERS_PYTHON), __file__, "--genai-worker", str(model), "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask({"cmd": "ping"})

    def ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"genai worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def genai_worker(model: str, threads: int) -> None:
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(model)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    m = og.Model(config)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "batch":  # one batch of equal-length prompts, ``tokens`` new tokens each
            ids = np.asarray(msg["prompts"], dtype=np.int32)
            length = ids.shape[1] + msg["tokens"]
            params = og.GeneratorParams(m)
            params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=len(ids))
            t0 = time.perf_counter()
            gen = og.Generator(m, params)
            gen.append_tokens(ids)
            gen.generate_next_token()
            first = time.perf_counter() - t0
            while not gen.is_done():
                gen.generate_next_token()
            wall = time.perf_counter() - t0
            reply = {"tok_s": ids.size // ids.shape[1] * msg["tokens"] / wall, "wall_s": wall, "ttft_s": first}
        else:
            reply = {"ok": True}
        print(json.dumps(reply), flush=True)


# -- llmx decode step vs context -------------------------------------------------------------------

def decode_step_ms(artifact: Path, threads: int, contexts: list[int], steps: int) -> dict[int, float]:
    """Median decode step of one row whose cache holds ``context`` slots (values don't matter for time)."""
    import numpy as np

    from llmx.runtime.engine import Engine

    backend = Engine.load(artifact, threads=threads).backend
    out = {}
    for context in contexts:
        cache = backend.new_cache(1, context + steps + 1)
        times = []
        for i in range(steps + 2):
            cache.lengths[0] = context
            t0 = time.perf_counter()
            backend.decode(cache, np.asarray([[100 + i]], dtype=np.int64))
            times.append(time.perf_counter() - t0)
        out[context] = round(statistics.median(times[2:]) * 1000, 2)
    return out


# -- the run ---------------------------------------------------------------------------------------

def run(args, paths: dict[str, Path], vocab: int) -> dict:
    engines, levels, results = args.engines, args.concurrency, {}
    started = time.time()
    for c in levels:
        results[f"c{c}"] = {e: [] for e in engines}
    for n in args.long:
        results[f"ttft{n}"] = {e: [] for e in engines}
    servers: dict[tuple[str, int], Server] = {}
    genai = None
    try:
        # One-slot servers also answer the long prompts (their context holds CONTEXT tokens).
        for c in sorted(set(levels) | ({1} if args.long else set())):
            if "llmx" in engines:
                servers["llmx", c] = llmx_server(paths["llmx"], c, args.threads, args.llmx_args)
            if "llama-server" in engines:
                context = CONTEXT if c == 1 else c * (args.prompt_len + args.tokens + 64)
                servers["llama-server", c] = llama_server(paths["gguf"], c, args.threads, context)
        if "genai" in engines:
            genai = GenaiWorker(paths["genai"], args.threads)

        def stream(engine: str, c, ids: list[list[int]], tokens: int = args.tokens) -> dict:
            if engine == "genai":
                return genai.ask({"cmd": "batch", "prompts": ids, "tokens": tokens})
            return concurrent_streams(servers[engine, c].url, ids, tokens, NO_CACHE if engine == "llama-server" else {})

        def ttft(engine: str, ids: list[int]) -> float:
            if engine == "genai":
                return genai.ask({"cmd": "batch", "prompts": [ids], "tokens": 1})["ttft_s"]
            return time_to_first_token(servers[engine, 1].url, ids, NO_CACHE if engine == "llama-server" else {})

        log("warm-up")  # graphs, thread pools, KV buffers of every slot count: a few tokens suffice
        for e in engines:
            for c in levels:
                stream(e, c, prompts(c, args.prompt_len, vocab, 999), WARM_UP_TOKENS)
        for rnd in range(args.rounds):
            order = engines[rnd % len(engines):] + engines[: rnd % len(engines)]
            for c in levels:
                ids = prompts(c, args.prompt_len, vocab, 1000 * rnd + c)
                for e in order:
                    results[f"c{c}"][e].append(stream(e, c, ids))
                log(f"round {rnd + 1}: C={c} " + ", ".join(f"{e} {results[f'c{c}'][e][-1]['tok_s']:.1f}" for e in engines))
            for n in args.long:
                ids = prompts(1, n, vocab, 7000 + 1000 * rnd + n)[0]
                for e in order:
                    results[f"ttft{n}"][e].append({"ttft_s": ttft(e, ids)})
                log(f"round {rnd + 1}: TTFT {n} " + ", ".join(f"{e} {results[f'ttft{n}'][e][-1]['ttft_s']:.2f}s" for e in engines))
    finally:
        for s in servers.values():
            s.close()
        if genai is not None:
            genai.close()
    step = decode_step_ms(paths["llmx"], args.threads, [128, *args.long], 8 if args.quick else 24) if "llmx" in engines else {}
    return {"results": results, "decode_step_ms": step, "wall_s": round(time.time() - started)}


def summarize(data: dict, engines: list[str]) -> tuple[str, dict]:
    """Markdown table and the per-round median ratios llmx / each peer."""
    rows, ratios = [], {}
    peers = [e for e in engines if e != "llmx"]
    for key, per_engine in data["results"].items():
        metric = "tok_s" if key.startswith("c") else "ttft_s"
        med = {e: statistics.median(r[metric] for r in runs) for e, runs in per_engine.items() if runs}
        ratio = {}
        if "llmx" in per_engine:
            for p in peers:
                pairs = zip(per_engine["llmx"], per_engine[p])
                ratio[p] = round(statistics.median(a[metric] / b[metric] for a, b in pairs), 3)
        ratios[key] = ratio
        what = f"C={key[1:]} aggregate tok/s" if metric == "tok_s" else f"TTFT {key[4:]} tokens (s)"
        cells = " | ".join(f"{med[e]:.3g}" if e in med else "-" for e in engines)
        rows.append(f"| {what} | {cells} | " + " | ".join(f"{ratio.get(p, float('nan')):.2f}x" for p in peers) + " |")
    head = ("| measure | " + " | ".join(engines) + " | " + " | ".join(f"llmx / {p}" for p in peers) + " |\n"
            + "|---" * (1 + len(engines) + len(peers)) + "|\n")
    step = data.get("decode_step_ms") or {}
    tail = "\n\nllmx decode step (1 row): " + ", ".join(f"{c} context {ms} ms" for c, ms in step.items()) if step else ""
    return head + "\n".join(rows) + tail + "\n", ratios


def plot(data: dict, engines: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = data["results"]
    conc = [k for k in res if k.startswith("c")]
    long = [k for k in res if k.startswith("ttft")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(engines)
    for ax, keys, metric, title in ((axes[0], conc, "tok_s", "aggregate decode tok/s (C streams)"),
                                    (axes[1], long, "ttft_s", "time to first token (s)")):
        for i, e in enumerate(engines):
            vals = [statistics.median(r[metric] for r in res[k][e]) for k in keys]
            ax.bar([j + i * width for j in range(len(keys))], vals, width, label=e)
        ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"C={k[1:]}" if metric == "tok_s" else f"{k[4:]} tokens" for k in keys])
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="llmx,llama-server,genai")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--long", default="2048,8192", help="prompt lengths for TTFT ('' for none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", action="store_true",
                    help="a neighbour process burns one core for the whole run (started before the engines load)")
    ap.add_argument("--llmx-args", default="", help="extra `llmx serve` flags, e.g. '--spin'")
    ap.add_argument("--quick", action="store_true", help="1 round, C = 1, 8, 16 tokens, a 1k prompt")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--genai-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers it started on the way out
    if args.genai_worker:
        return genai_worker(args.genai_worker, args.threads)
    if args.quick:
        args.rounds, args.concurrency, args.tokens, args.long = 1, "1,8", 16, "1024"
    args.engines = args.engines.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.long = [int(n) for n in args.long.split(",") if n]
    args.llmx_args = args.llmx_args.split()
    sys.path.insert(0, str(HERE))
    from peers import has_module, start_neighbour

    if "llama-server" in args.engines and not LLAMA_SERVER.is_file():
        sys.exit("llama-server is not built: run benchmarks/build_llama_server.sh")
    if "genai" in args.engines and not has_module("onnxruntime_genai"):
        sys.exit("onnxruntime-genai is not in the peers venv: run benchmarks/setup_peers.sh")
    paths = build_models(args.cache, args.shape, args.engines)
    vocab = json.loads((paths["ckpt"] / "config.json").read_text())["vocab_size"]
    load_start = round(os.getloadavg()[0], 2)
    neighbour = start_neighbour() if args.busy else None
    try:
        data = run(args, paths, vocab)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    table, ratios = summarize(data, args.engines)
    meta = {"shape": args.shape, "engines": args.engines, "concurrency": args.concurrency, "tokens": args.tokens,
            "prompt_len": args.prompt_len, "long": args.long, "rounds": args.rounds, "threads": args.threads,
            "llmx_args": args.llmx_args, "host": "busy" if args.busy else "quiet", "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            "load_avg_1m_at_start": load_start, "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "command": " ".join(["python", *sys.argv])}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"server_{time.strftime('%Y%m%d_%H%M')}{'_busy' if args.busy else ''}{'_quick' if args.quick else ''}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "ratios": ratios, **data}, indent=1))
    header = (f"{args.shape} shape, fp32, {args.threads} threads each, {args.rounds} rounds, "
              f"{'a one-core neighbour burning (busy host)' if args.busy else 'no neighbour'}; load average "
              f"{load_start} -> {meta['load_avg_1m_at_end']} on {os.cpu_count()} CPUs; {data['wall_s']} s\n\n")
    stem.with_suffix(".md").write_text(header + table)
    plot(data, args.engines, stem.with_suffix(".png"))
    print(header + table)
    log(f"wrote {stem}.json/.md/.png")


if __name__ == "__main__":
    main()
