"""benchmarks/server_peers.py's bookkeeping and its client: per-round ratios, and the streamed
aggregate measured against a real ``llmx serve`` app (the tiny test artifact, no peer needed)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import server_peers  # noqa: E402


def test_ratios_are_per_round_medians_and_ttft_is_lower_is_better():
    data = {"results": {
        "c8": {"llmx": [{"tok_s": 200}, {"tok_s": 100}, {"tok_s": 300}],
               "llama-server": [{"tok_s": 100}, {"tok_s": 100}, {"tok_s": 100}]},
        "ttft2048": {"llmx": [{"ttft_s": 1.0}, {"ttft_s": 2.0}, {"ttft_s": 3.0}],
                     "llama-server": [{"ttft_s": 2.0}, {"ttft_s": 2.0}, {"ttft_s": 2.0}]}},
        "decode_step_ms": {128: 40.0, 8192: 90.0}}
    table, ratios = server_peers.summarize(data, ["llmx", "llama-server"])
    assert ratios == {"c8": {"llama-server": 2.0}, "ttft2048": {"llama-server": 1.0}}
    assert "| C=8 aggregate tok/s | 200 | 100 | 2.00x |" in table
    assert "8192 context 90.0 ms" in table


def test_streams_against_llmx_serve_count_every_token(llama_artifact):
    from llmx.runtime.engine import Engine
    from llmx.serve.app import create_app
    from llmx.serve.http_server import make_server

    engine = Engine.load(llama_artifact, threads=1)
    server = make_server("127.0.0.1", 0, create_app(engine=engine, max_batch=4, prefix_cache_mb=0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        while requests.get(url + "/ready", timeout=5).status_code != 200:
            time.sleep(0.1)
        assert engine.max_seq_len > 8 + 6
        ids = server_peers.prompts(3, 8, engine.manifest.model.vocab_size, seed=1)
        result = server_peers.concurrent_streams(url, ids, tokens=6)
        assert result["tok_s"] == pytest.approx(3 * 6 / result["wall_s"])
        assert 0 < result["ttft_s"] < result["wall_s"]
        assert server_peers.time_to_first_token(url, ids[0], {}) > 0
    finally:
        server.shutdown()
