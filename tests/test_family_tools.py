"""The MoE families past export: ``llmx calibrate --scheme w8`` on a Mixtral artifact.

calibrate rewrites MatMuls whose weight is a 2-D constant; the experts' stacked 3-D weights stay
float32 (docs/models.md says so), everything else becomes MatMulNBits, and the result still
generates and reports its quality against the fp32 graphs.
"""

from __future__ import annotations

import argparse
import inspect
import json

import onnx

from llmx.calibration import CalibrationOptions, calibrate_artifact
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams


def test_calibrate_w8_on_an_moe_model(store, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text(inspect.getsource(argparse))
    out = tmp_path / "w8"
    options = CalibrationOptions(scheme="w8", samples=2, seq_len=32, eval_samples=2, threads=1)
    calibrate_artifact(store.artifact("mixtral"), out, data, options)
    for graph in ("prefill", "decode"):
        model = onnx.load(str(out / f"{graph}.onnx"), load_external_data=False)
        ops = {n.op_type for n in model.graph.node}
        weights = {t.name: t.data_type for t in model.graph.initializer}
        assert "MatMulNBits" in ops
        assert weights["model.layers.0.mlp.gate_up"] == onnx.TensorProto.FLOAT  # experts stay float32
        assert "model.layers.0.attn.qkv.weight" not in weights  # quantized away
    report = json.loads((out / "quality.json").read_text())
    assert 0.8 < report["perplexity_ratio"] < 1.25 and report["top1_agreement"] > 0.6
    seq = Engine.load(out, threads=1).generate(["def main():"], SamplingParams(max_new_tokens=8, temperature=0,
                                                                             ignore_eos=True))[0]
    assert len(seq.output_ids) == 8


def test_optimize_refuses_moe_experts_the_fused_op_cannot_run(store, tmp_path, capsys):
    """ONNX Runtime's MoE op runs SwiGLU experts only: other expert MLPs are refused in one line."""
    from test_cli import leftovers, optimize_with_model_field

    code, error = optimize_with_model_field(store.artifact("mixtral"), "activation", "gelu", tmp_path, capsys)
    assert code != 0 and "MoE experts with a gated gelu MLP have no fused kernel" in error
    assert leftovers(tmp_path) == ["changed"]
