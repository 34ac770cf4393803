"""Issue 14's families beyond the shared parity tables (tests/test_parity.py, tests/test_optimize.py
run every FAMILY_VARIANTS entry through prefill + 16 decode steps, 32 greedy tokens and padded
batches, portable and fused): what those tables cannot show, and the docs that list the families."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from conftest import FAMILY_VARIANTS
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams
from llmx.spec import FAMILIES
from test_cli import run

ROOT = Path(__file__).resolve().parents[1]
DECODERS = [name for name, row in FAMILIES.items() if row.get("kind", "decoder") == "decoder"]


def test_every_family_is_listed_in_help_readme_and_models_doc(capsys):
    code, out, _ = run(["export", "--help"], capsys)
    assert code == 0
    help_text = " ".join(out.split())
    readme = (ROOT / "README.md").read_text()
    models = (ROOT / "docs" / "models.md").read_text()
    for family in DECODERS:
        assert family in help_text, family
        assert f"| `{family}` |" in readme, family
        assert f"| `{family}` |" in models, family
    assert {v[0] for v in FAMILY_VARIANTS.values()} <= set(DECODERS)


def test_longrope_switches_to_long_factors_mid_generation_like_transformers(store, reference):
    """A prompt shorter than original_max_position_embeddings (16) whose continuation crosses it:
    transformers changes factor sets at the crossing for the new tokens only; so must both graphs."""
    variant = "phi3-longrope-crossing"
    model = reference(variant)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    for art in (store.artifact(variant), store.optimized(variant)):
        engine = Engine.load(art, threads=1)
        ids = engine.encode("import json")
        assert len(ids) < 16 < len(ids) + 24
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert engine.generate(["import json"], params)[0].output_ids == ref[0, len(ids):].tolist()


def test_calibrate_w8_on_a_new_family(store, tmp_path):
    from llmx.calibration import CalibrationOptions, calibrate_artifact

    data = tmp_path / "calib.txt"
    data.write_text(inspect.getsource(inspect))
    out = tmp_path / "w8"
    calibrate_artifact(store.artifact("gemma2"), out, data,
                       CalibrationOptions(scheme="w8", block_size=16, samples=2, seq_len=32, eval_samples=2, threads=1))
    import onnx

    from llmx.artifact.manifest import load_manifest

    assert load_manifest(out).precision.scheme == "w8"
    decode = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in decode.graph.node) == 4 * 2 + 1  # qkv, o, up, down x 2 + head
    seq = Engine.load(out, threads=1).generate(["def main():"], SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert len(seq.output_ids) == 8


def test_optimize_refuses_a_feature_the_fused_graph_cannot_do(store, tmp_path, capsys):
    """q/k norm as LayerNorm (not RMSNorm) has no fused block: one line naming it, nothing written."""
    from test_cli import leftovers, optimize_with_model_field

    code, error = optimize_with_model_field(store.artifact("qwen3"), "norm", "layer", tmp_path, capsys)
    assert code != 0 and "q/k norm with LayerNorm" in error
    assert leftovers(tmp_path) == ["changed"]


@pytest.mark.parametrize("option", [["--num-beams", "2"], ["--speculative", "ngram", "--temperature", "0"]])
def test_loops_without_the_recompute_refuse_a_longrope_crossing(option, store, capsys):
    """Beam search and speculative decoding do not recompute at LongRoPE's switch: one line, not a different answer."""
    from test_cli import error_line

    art = str(store.artifact("phi3-longrope-crossing"))
    code, _, err = run(["generate", art, "import json", "--max-new-tokens", "24", "--threads", "1", *option], capsys)
    assert code != 0 and "cannot cross LongRoPE" in error_line(err)
    code, out, _ = run(["generate", art, "import json", "--max-new-tokens", "3", "--threads", "1", *option], capsys)
    assert code == 0 and out.strip()
