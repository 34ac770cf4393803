"""``llmx bench``: the report's keys and their internal consistency (no timing thresholds here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmx.runtime.bench import bench, context_sweep, prompt_ids, run_once
from test_cli import error_line, run

KEYS = {"ttft_ms", "tpot_ms", "tpot_p50_ms", "tpot_p90_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_mb"}


@pytest.mark.parametrize("batch", [1, 3])
def test_bench_json_keys_and_consistency(llama_artifact, batch, capsys):
    code, out, _ = run(["bench", str(llama_artifact), "--prompt-len", "12", "--new-tokens", "9", "--batch", str(batch),
                        "--repeat", "3", "--threads", "1", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert KEYS <= result.keys()
    assert all(result[k] > 0 for k in KEYS)
    assert (result["prompt_len"], result["new_tokens"], result["batch"], result["repeat"]) == (12, 9, batch, 3)
    assert len(result["runs"]) == 3
    # With an odd number of runs the medians come from one run: tok/s and TPOT must agree.
    assert result["decode_tokens_per_s"] == pytest.approx(batch * 1000 / result["tpot_ms"], rel=5e-3)
    assert result["prefill_tokens_per_s"] == pytest.approx(batch * 12 * 1000 / result["ttft_ms"], rel=5e-3)
    assert result["tpot_p50_ms"] <= result["tpot_p90_ms"]


def test_bench_runs_exact_token_counts(llama_engine):
    prompts = [prompt_ids(10, 320, row) for row in range(2)]
    assert all(len(p) == 10 for p in prompts) and prompts[0] != prompts[1]
    times = run_once(llama_engine.backend, llama_engine.tokenizer, prompts, 7)
    assert len(times.steps_s) == 6 and times.ttft_s > 0  # first token comes with prefill


def test_bench_text_report_and_context_sweep(llama_artifact, capsys):
    code, out, _ = run(["bench", str(llama_artifact), "--prompt-len", "8", "--new-tokens", "4", "--repeat", "1",
                        "--context", "16,64", "--threads", "1"], capsys)
    assert code == 0
    for label in ("TTFT", "TPOT", "prefill", "decode", "peak RSS", "step @     64", "step ratio"):
        assert label in out


def test_context_sweep_times_each_length(llama_engine):
    sweep = context_sweep(llama_engine.backend, llama_engine.tokenizer, [16, 48], steps=4)
    assert list(sweep) == [16, 48] and all(ms > 0 for ms in sweep.values())


def test_bench_results_are_medians_of_runs(llama_engine):
    result = bench(llama_engine.backend, llama_engine.tokenizer, prompt_len=6, new_tokens=5, repeat=3, warmup=0)
    assert result.ttft_ms == pytest.approx(float(np.median([r["ttft_ms"] for r in result.runs])), abs=1e-3)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-len", "250", "--new-tokens", "10"], "maximum length"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--context", "64,abc"], "comma-separated"),
        (["--context", "0"], "positive"),
    ],
)
def test_bench_bad_input(llama_artifact, args, message, capsys):
    code, _, err = run(["bench", str(llama_artifact), "--threads", "1", *args], capsys)
    assert code != 0 and message in error_line(err)


def test_bench_missing_artifact(tmp_path, capsys):
    code, _, err = run(["bench", str(tmp_path / "nope")], capsys)
    assert code != 0 and "does not exist" in error_line(err)
