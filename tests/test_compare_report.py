"""benchmarks/compare_cpu.py's bookkeeping: engine groups, precision baselines and per-round ratios.

The peers' numbers in the README and the closing notes come out of this arithmetic; it runs here
on synthetic runs (no peer engine needed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare_cpu  # noqa: E402
from report import markdown, summarize  # noqa: E402


def _run(ttft_s: float, step_s: float, steps: int = 4) -> dict:
    return {"ttft_s": ttft_s, "steps_s": [step_s] * steps, "token_ids": [1] * (steps + 1)}


def _results(step_ms: dict[str, list[float]]) -> dict:
    return {e: {"runs": [_run(0.1, ms / 1e3) for ms in steps], "peak_rss_mb": 100.0, "load_s": 1.0}
            for e, steps in step_ms.items()}


def test_groups_expand_in_order_once_and_unknown_names_fail():
    assert compare_cpu.select("llmx-w8,genai-int8,llmx-w8") == ["llmx-w8", "genai-int8"]
    quantized = compare_cpu.select("quantized")
    assert {"llmx-w8", "genai-int8", "llmx-w4", "genai-int4", "genai"} <= set(quantized)
    with pytest.raises(SystemExit, match="unknown engines"):
        compare_cpu.select("llmx,nonsense")


@pytest.mark.parametrize("engine, precision, twin", [
    ("llmx-w8", "int8", "genai-int8"), ("llamacpp-q4", "int4", "genai-int4"), ("genai-int8-2t", "int8", "genai-int8"),
    ("llmx", "fp32", "genai"), ("llamacpp", "fp32", "genai"),
])
def test_each_engine_is_paired_with_genai_of_its_precision(engine, precision, twin):
    assert compare_cpu.precision(engine) == precision
    assert compare_cpu.GENAI_OF[precision] == twin


def test_ratios_are_taken_round_by_round_against_both_baselines():
    # Round 2 is slow for everyone (background load): per-round ratios cancel it out.
    results = _results({"llmx-w8": [5.0, 10.0, 5.0], "genai-int8": [6.0, 12.0, 6.0], "genai": [20.0, 40.0, 20.0]})
    summary = summarize(results, "genai", prompt_len=8, same_precision={"llmx-w8": "genai-int8", "genai-int8": "genai-int8"})
    row = summary["llmx-w8"]
    assert row["decode_x_same_precision_by_round"] == pytest.approx([1.2, 1.2, 1.2])
    assert row["decode_x_same_precision"] == pytest.approx(1.2)
    assert row["decode_x_baseline"] == pytest.approx(4.0)
    assert row["decode_tokens_per_s"] == pytest.approx(200.0)
    assert "same_precision_baseline" not in summary["genai"]

    meta = {"model": {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 16}, "prompt_len": 8, "new_tokens": 5,
            "rounds": 3, "contexts": [64, 128], "baseline": "genai", "date": "2026-01-01 00:00",
            "load_avg_1m_at_start": 0, "load_avg_1m_at_end": 0,
            "precision": {"llmx-w8": "int8", "genai-int8": "int8", "genai": "fp32"}}
    md = markdown(summary, meta)
    w8_line = next(line for line in md.splitlines() if line.startswith("| llmx w8"))
    assert "| 1.20 |" in w8_line and "| 4.00 |" in w8_line
    assert "llmx-w8 / genai-int8 decode, per round: 1.20, 1.20, 1.20 (median **1.20**)" in md
