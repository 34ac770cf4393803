"""Where the server's time goes: cProfile on the scheduler thread while C clients stream.

    python benchmarks/server_profile.py ARTIFACT [--streams 32] [--tokens 64] [--top 25]

Serves ARTIFACT in this process (the app ``llmx serve`` runs, on werkzeug's threaded server,
loopback), profiles the scheduler thread only, and prints: the split of its wall time between
graph runs (backend decode/prefill) and Python (sampling, detokenizing, publishing), the
CPU time of the whole process (HTTP threads included), and the top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from server_peers import concurrent_streams, prompts

    from llmx.runtime.engine import Engine
    from llmx.serve.app import create_app
    from llmx.serve.http_server import make_server
    from llmx.serve.scheduler import Scheduler

    profile, measuring, on = cProfile.Profile(), threading.Event(), [False]
    gauges = Scheduler._gauges

    def toggle(self):  # runs once per turn in the scheduler thread: cProfile follows one thread
        gauges(self)
        if measuring.is_set() != on[0]:
            profile.enable() if measuring.is_set() else profile.disable()
            on[0] = measuring.is_set()

    Scheduler._gauges = toggle
    engine = Engine.load(args.artifact, threads=args.threads)
    app = create_app(engine=engine, max_batch=args.streams, prefix_cache_mb=0)
    server = make_server("127.0.0.1", 0, app)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    vocab = engine.manifest.model.vocab_size
    concurrent_streams(url, prompts(args.streams, args.prompt_len, vocab, 1), args.tokens)  # warm-up
    measuring.set()
    cpu0, t0 = time.process_time(), time.perf_counter()
    result = concurrent_streams(url, prompts(args.streams, args.prompt_len, vocab, 2), args.tokens)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    measuring.clear()
    time.sleep(0.5)  # the idle scheduler wakes for nothing: one more request turns profiling off
    concurrent_streams(url, prompts(1, args.prompt_len, vocab, 3), 2)
    stats = pstats.Stats(profile)
    graph = sum(v[3] for k, v in stats.stats.items() if k[2] in ("run_with_iobinding", "run") and "onnxruntime" in k[0])
    print(f"{args.streams} streams x {args.tokens} tokens: {result['tok_s']:.1f} tok/s aggregate, wall {wall:.2f} s, "
          f"process CPU {cpu:.2f} s ({cpu / wall:.2f} cores)")
    print(f"scheduler thread: graph runs {graph:.2f} s = {graph / wall:.0%} of wall; the rest is Python or waiting")
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    server.shutdown()


if __name__ == "__main__":
    main()
