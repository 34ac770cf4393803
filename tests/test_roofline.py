"""benchmarks/roofline.py: the bytes a decode step must read, and the floor they set.

The closing notes' claim that fp32 decode is memory-bound (both engines near the floor) rests on
this arithmetic, so it is checked here on graphs whose byte counts are known by construction.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fast_default  # noqa: E402
from roofline import kv_bytes, step_floor_ms, stream_gb_s, weight_bytes  # noqa: E402


def _graph(tmp_path: Path) -> Path:
    embed = numpy_helper.from_array(np.zeros((100, 8), np.float32), "embed")  # only gathered: one row a step
    tied = numpy_helper.from_array(np.zeros((100, 8), np.float32), "tied")  # gathered and a MatMul weight: read whole
    w = numpy_helper.from_array(np.zeros((8, 16), np.float32), "w")
    packed = helper.make_tensor("packed", TensorProto.UINT8, [16, 1, 16], np.zeros(256, np.uint8).tobytes(), raw=True)
    scales = numpy_helper.from_array(np.zeros(16, np.float16), "scales")
    in_branch = numpy_helper.from_array(np.zeros((4, 4), np.float32), "in_branch")  # read inside an If body
    nibbles = helper.make_tensor("nibbles", TensorProto.UINT4, [5], [0] * 5)  # 5 values in 3 bytes
    branch = helper.make_graph([helper.make_node("Identity", ["in_branch"], ["b"])], "then", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["e"]),
        helper.make_node("Gather", ["tied", "ids"], ["t"]),
        helper.make_node("MatMul", ["e", "w"], ["h"]),
        helper.make_node("MatMulNBits", ["h", "packed", "scales"], ["q"], domain="com.microsoft", K=16, N=16, bits=4,
                         block_size=32),
        helper.make_node("Transpose", ["tied"], ["tt"]),
        helper.make_node("Cast", ["nibbles"], ["n"], to=TensorProto.FLOAT),
        helper.make_node("If", ["cond"], ["o"], then_branch=branch, else_branch=branch),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("q", "t", "tt", "o", "n")],
                              [embed, tied, w, packed, scales, in_branch, nibbles])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="g.bin", size_threshold=0)
    return path


def test_weight_bytes_skips_gather_only_tables_and_counts_everything_else(tmp_path):
    # tied 100x8 fp32 + w 8x16 fp32 + packed 256 uint8 + scales 16 fp16 + in_branch 4x4 fp32
    # + 5 uint4 packed two to a byte; not embed.
    assert weight_bytes(_graph(tmp_path)) == 3200 + 512 + 256 + 32 + 64 + 3


def test_kv_bytes_and_floor():
    # SmolLM-135M: 30 layers, 3 KV heads of 64, fp32, at 192 positions.
    assert kv_bytes(30, 3, 64, 192) == 2 * 30 * 3 * 64 * 192 * 4
    assert kv_bytes(30, 3, 64, 192, itemsize=1) * 4 == kv_bytes(30, 3, 64, 192)
    assert math.isclose(step_floor_ms(538_000_000, 28.0), 19.214, rel_tol=1e-3)


def test_stream_probe_reports_a_finite_speed():
    assert 0.1 < stream_gb_s(1, megabytes=8, rounds=2) < 10_000


def test_fast_default_puts_each_engine_against_the_floor_at_its_thread_count(tmp_path, monkeypatch):
    summary = {"engines": {
        "llmx-fp32": {"decode_tok_s": 50.0, "threads": 2},
        "genai-fp32-1t": {"decode_tok_s": 25.0, "threads": 1},
        "genai-fp32-2t": {"decode_tok_s": 40.0, "threads": 2},
    }}
    monkeypatch.setattr(fast_default, "artifact_step_bytes", lambda path, context: 500_000_000)
    monkeypatch.setattr(fast_default, "genai_step_bytes", lambda path, context: 520_000_000)
    roof = fast_default.roofline(summary, "fp32", {"art-opt": tmp_path, "genai": tmp_path}, {1: 12.5, 2: 25.0}, 192)
    llmx, g1, g2 = (roof["engines"][n] for n in ("llmx-fp32", "genai-fp32-1t", "genai-fp32-2t"))
    assert (llmx["floor_ms"], llmx["step_ms"], llmx["floor_over_step"]) == (20.0, 20.0, 1.0)
    assert (g1["floor_ms"], g1["floor_over_step"]) == (41.6, 1.04)  # 1 thread streams at half the speed
    assert (g2["floor_ms"], g2["floor_over_step"]) == (20.8, 0.832)
    assert roof["step_mb"] == {"llmx": 500.0, "genai": 520.0}
    summary["engines"]["llmx-fp32"]["threads"] = 1  # a busy host: llmx chose one thread
    assert fast_default.roofline(summary, "fp32", {"art-opt": tmp_path, "genai": tmp_path}, {1: 12.5, 2: 25.0},
                                 192)["engines"]["llmx-fp32"]["floor_ms"] == 40.0
