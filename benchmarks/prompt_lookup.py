"""Prompt lookup on by default: batch-1 decode with ``--speculative auto`` against plain decoding.

    python benchmarks/prompt_lookup.py --artifact ART [--artifact ART2 ...] [--rounds 3] [--tokens 128]
    python benchmarks/prompt_lookup.py --artifact ART --server      # the same, through two `llmx serve`s

Four chat workloads on a real instruct model (its chat template, greedy, one request at a time):
code editing (a stdlib function to copy with one rename), a retrieval-augmented answer (a stdlib
docstring passage to quote from), JSON rewriting (a record to rewrite, under a json_object
constraint) and plain chat (nothing to copy: what speculation must not cost). Per artifact and
workload, plain decoding (``off``) and ``auto`` take turns for --rounds rounds in one process;
decode tok/s is (tokens - 1) / (time after the first token); the ratio auto / off is taken
within each round, then the median. The outputs of the two must be token-identical (checked).

``--server`` measures the same through the HTTP path instead: two ``llmx serve`` processes on the
artifact, one ``--speculative off`` and one on its defaults, each asked in turn for the same
streamed chat completion (greedy; ``response_format`` json_object for the JSON rewrite); decode
tok/s is (completion tokens - 1) / (last chunk - first chunk), and the texts must be identical.

Prints a table, writes benchmarks/results/prompt_lookup_<date>.json (``_server`` with
``--server``) and a .png (matplotlib).
Run it alone: it times decode steps on a 2-core box.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

from llmx.runtime.chat import render_chat
from llmx.runtime.constraints import ConstraintSpec, compile_constraint
from llmx.runtime.drafters import make_drafter
from llmx.runtime.engine import Engine
from llmx.runtime.generate import generate
from llmx.runtime.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"


def workloads() -> dict[str, tuple[str, bool]]:
    """name -> (user message, JSON-constrained); every text comes from the standard library."""
    code = inspect.getsource(textwrap.dedent)
    passage = " ".join(json.__doc__.split("\n\n")[0:2])
    record = {"name": "textwrap", "kind": "module", "functions": ["wrap", "fill", "shorten", "dedent", "indent"],
              "since": "2.3", "pure_python": True, "lines": 494, "maintainers": ["core"], "tags": ["text", "format"]}
    return {
        "code editing": (f"Rename the variable `margin` to `common` in this function and show the whole function:\n\n{code}", False),
        "RAG answer": (f"Passage:\n{passage}\n\nUsing only the passage, what does the json module do? "
                       "Quote the passage's own sentences.", False),
        "JSON rewrite": ("Rewrite this JSON object with the same keys and values, adding \"checked\": true at the end:\n"
                         + json.dumps(record), True),
        "plain chat": ("Write a short story about a lighthouse keeper who finds a message in a bottle.", False),
    }


def run_once(engine, ids: list[int], params: SamplingParams, method: str) -> dict:
    drafter = make_drafter(method, engine)
    first: list[float] = []
    start = time.perf_counter()
    seq = generate(engine.backend, engine.tokenizer, [ids], params, drafter=drafter,
                   on_event=lambda _e: first or first.append(time.perf_counter()))[0]
    end = time.perf_counter()
    n = len(seq.output_ids)
    stats = drafter.stats.summary() if drafter else {}
    return {"tokens": n, "decode_tok_s": (n - 1) / (end - first[0]) if n > 1 else 0.0, "ids": seq.output_ids,
            "acceptance": stats.get("acceptance_rate"), "tokens_per_step": stats.get("tokens_per_step")}


def bench(artifact: str, rounds: int, tokens: int) -> dict:
    engine = Engine.load(artifact, threads=2)
    out = {}
    for name, (message, constrained) in workloads().items():
        ids = engine.tokenizer.encode(render_chat(engine.tokenizer, [{"role": "user", "content": message}]),
                                      add_special_tokens=False)
        constraint = (compile_constraint(ConstraintSpec.json_object(), engine.tokenizer, engine.manifest.model.vocab_size)
                      if constrained else None)
        params = SamplingParams(max_new_tokens=tokens, temperature=0, constraint=constraint)
        run_once(engine, ids, params, "off")  # warm-up
        runs = {"off": [], "auto": []}
        for r in range(rounds):
            for method in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
                runs[method].append(run_once(engine, ids, params, method))
        identical = all(a["ids"] == b["ids"] for a, b in zip(runs["off"], runs["auto"]))
        ratio = statistics.median(a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(runs["auto"], runs["off"]))
        out[name] = {
            "prompt_tokens": len(ids), "new_tokens": runs["off"][0]["tokens"], "identical": identical,
            "off_tok_s": statistics.median(x["decode_tok_s"] for x in runs["off"]),
            "auto_tok_s": statistics.median(x["decode_tok_s"] for x in runs["auto"]),
            "ratio": ratio, "acceptance": runs["auto"][0]["acceptance"],
            "tokens_per_step": runs["auto"][0]["tokens_per_step"],
        }
        row = out[name]
        print(f"  {Path(artifact).name:24s} {name:14s} prompt {row['prompt_tokens']:4d}  new {row['new_tokens']:4d}  "
              f"off {row['off_tok_s']:6.1f}  auto {row['auto_tok_s']:6.1f} tok/s  x{row['ratio']:.2f}  "
              f"accept {row['acceptance'] or 0:.0%}  {row['tokens_per_step'] or 1:.2f} tok/step  "
              f"{'identical' if identical else 'DIFFERENT'}", flush=True)
    return out


def stream_chat(url: str, message: str, constrained: bool, tokens: int) -> dict:
    import requests

    body = {"messages": [{"role": "user", "content": message}], "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            **({"response_format": {"type": "json_object"}} if constrained else {})}
    text, first, last, n = [], None, None, 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=(10, 600)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            for c in chunk["choices"]:
                if c["delta"].get("content"):
                    text.append(c["delta"]["content"])
                    first = now if first is None else first
                    last = now
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return {"tokens": n, "text": "".join(text),
            "decode_tok_s": (n - 1) / (last - first) if n > 1 and last > first else 0.0}


def bench_server(artifact: str, rounds: int, tokens: int) -> dict:
    from load_test import Server  # benchmarks/ is on sys.path when this runs as a script

    servers = {"off": Server(Path(artifact), 8, 64, 2, extra=("--speculative", "off")),
               "auto": Server(Path(artifact), 8, 64, 2)}
    out = {}
    try:
        for name, (message, constrained) in workloads().items():
            for server in servers.values():
                stream_chat(server.url, message, constrained, tokens)  # warm-up
            runs = {"off": [], "auto": []}
            for r in range(rounds):
                for method in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
                    runs[method].append(stream_chat(servers[method].url, message, constrained, tokens))
            identical = all(a["text"] == b["text"] for a, b in zip(runs["off"], runs["auto"]))
            ratio = statistics.median(a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(runs["auto"], runs["off"]))
            out[name] = {"new_tokens": runs["off"][0]["tokens"], "identical": identical,
                         "off_tok_s": statistics.median(x["decode_tok_s"] for x in runs["off"]),
                         "auto_tok_s": statistics.median(x["decode_tok_s"] for x in runs["auto"]), "ratio": ratio,
                         "ratios": [round(a["decode_tok_s"] / b["decode_tok_s"], 3) for a, b in zip(runs["auto"], runs["off"])]}
            row = out[name]
            print(f"  {Path(artifact).name:24s} {name:14s} serve  new {row['new_tokens']:4d}  off {row['off_tok_s']:6.1f}  "
                  f"auto {row['auto_tok_s']:6.1f} tok/s  x{row['ratio']:.2f}  rounds {row['ratios']}  "
                  f"{'identical' if identical else 'DIFFERENT'}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return out


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(results)
    for i, (art, rows) in enumerate(results.items()):
        ax.bar([x + i * width for x in range(len(names))], [rows[n]["ratio"] for n in names], width, label=art)
    ax.axhline(1.5, color="green", linestyle="--", linewidth=1, label="1.5x (copy-heavy target)")
    ax.axhline(0.97, color="red", linestyle=":", linewidth=1, label="0.97x (plain chat floor)")
    ax.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(names))], names)
    ax.set_ylabel("decode tok/s, auto / off")
    ax.set_title("Prompt lookup on by default (batch 1, greedy, 2 threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--server", action="store_true", help="through two `llmx serve` processes (off / defaults)")
    args = ap.parse_args()
    run = bench_server if args.server else bench
    results = {Path(a).name: run(a, args.rounds, args.tokens) for a in args.artifact}
    stamp = datetime.now().strftime("%Y-%m-%d_%H%M") + ("_server" if args.server else "")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"prompt_lookup_{stamp}.json"
    out.write_text(json.dumps({"rounds": args.rounds, "tokens": args.tokens, "server": args.server,
                               "load_avg_1m": round(os.getloadavg()[0], 2), "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
