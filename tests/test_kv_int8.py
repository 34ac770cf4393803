"""INT8 KV cache: the rewritten graphs against the float32 artifact they came from.

Stated tolerance: over a prefill and 16 decode steps that read the int8 cache, every logit
within 0.05 of float32 (logits here span ~2.5) and the same argmax at every step; every cached
value within half a quantization step of its float32 value. The cache is a quarter of the bytes.
"""

from __future__ import annotations

import inspect
import json
import textwrap

import numpy as np
import onnx
import pytest

from llmx.calibration.kv_int8 import QMAX, kv_names, quantize_kv_artifact
from llmx.errors import ArtifactError, InputError
from llmx.artifact.manifest import load_manifest
from llmx.runtime.engine import Engine
from llmx.runtime.generate import generate
from llmx.runtime.sampling import SamplingParams

TOL = 0.05
PROMPT = "class Wrapper(object):\n    def __init__(self, width"


def windows(engine, width: int = 128, count: int = 8) -> list[list[int]]:
    ids = engine.encode(inspect.getsource(textwrap))
    return [ids[i : i + width] for i in range(0, len(ids) - width, width)][:count]


@pytest.fixture(scope="module")
def pair(store, tmp_path_factory):
    """(float32 engine, int8-KV engine) per variant, quantized once."""
    made = {}

    def get(variant: str):
        """``variant``, or ``variant-fused`` for its ``llmx optimize`` graphs (GroupQueryAttention)."""
        if variant not in made:
            name, fused = variant.removesuffix("-fused"), variant.endswith("-fused")
            source = store.optimized(name) if fused else store.artifact(name)
            fp32 = Engine.load(source, threads=1)
            out = tmp_path_factory.mktemp("kv8") / variant
            quantize_kv_artifact(source, out, windows(fp32))
            made[variant] = fp32, Engine.load(out, threads=1)
        return made[variant]

    return get


def logits_along(engine, prompt: list[int], tokens: list[int]) -> tuple[np.ndarray, object]:
    cache = engine.backend.new_cache(1, len(prompt) + len(tokens))
    out = [engine.backend.prefill(cache, [0], [prompt])[0].copy()]
    for t in tokens:
        out.append(engine.backend.decode(cache, np.array([[t]]))[0, 0].copy())
    return np.stack(out), cache


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral", "gpt2", "llama-fused", "mistral-fused"])
def test_logits_within_tolerance_of_float32(pair, variant):
    fp32, int8 = pair(variant)
    prompt = fp32.encode(PROMPT)
    greedy = fp32.generate([PROMPT], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))[0].output_ids
    ref, ref_cache = logits_along(fp32, prompt, greedy)
    ours, cache = logits_along(int8, prompt, greedy)
    assert np.abs(ours - ref).max() <= TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert 0 < np.abs(ours[1:] - ref[1:]).max()  # decode really read a quantized cache
    manifest = load_manifest(int8.artifact.root)
    scales = manifest.kv.quantization
    assert cache.buffers[0].dtype == np.int8 and cache.nbytes() * 4 == ref_cache.nbytes()
    assert scales["dtype"] == "int8" and scales["scale_max"] > 0
    if variant.endswith("-fused"):  # the cache is GroupQueryAttention's own, no dequantized window
        decode = onnx.load(str(int8.artifact.root / "decode.onnx"), load_external_data=False)
        assert {n.op_type for n in decode.graph.node}.isdisjoint({"ScatterElements", "DequantizeLinear"})
        assert manifest.graphs["decode"].ops == "onnxruntime"


def test_a_fused_decode_graph_whose_attention_skips_the_cache_is_refused(store):
    from llmx.calibration.kv_int8 import rewrite_decode

    manifest = load_manifest(store.optimized("llama"))
    past, present = kv_names(manifest)
    scales = [np.ones((manifest.model.num_kv_heads, manifest.model.head_dim), np.float32)] * len(present)
    path = store.optimized("llama") / "decode.onnx"

    def attention(model):
        return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]

    unbound = onnx.load(str(path), load_external_data=False)
    attention(unbound)[0].input[3] = ""  # reads no past: not the in-place cache update
    with pytest.raises(ArtifactError, match="does not update the KV cache in place"):
        rewrite_decode(unbound, past, present, scales)
    short = onnx.load(str(path), load_external_data=False)
    short.graph.node.remove(attention(short)[-1])  # the last layer's cache written by nothing
    with pytest.raises(ArtifactError, match=f"does not write {present[-2]}"):
        rewrite_decode(short, past, present, scales)


@pytest.mark.parametrize("variant", ["llama", "llama-fused"])
def test_cached_values_are_within_half_a_step(pair, variant):
    fp32, int8 = pair(variant)
    model = onnx.load(str(int8.artifact.root / "decode.onnx"))
    scale = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.name.startswith("kv_int8.scale.")}
    prompt = fp32.encode(PROMPT)
    new = [5, 6, 7]
    _, ref = logits_along(fp32, prompt, new)
    _, q = logits_along(int8, prompt, new)
    _, present = kv_names(int8.manifest)
    # The prompt's slots are written by prefill. The decoded tokens' slots are written by the decode
    # graph; those of layer 0 depend on the tokens alone (no cache read before them), so they too
    # are float32's within half a step (later layers' read the quantized cache first).
    width = len(prompt) + len(new)
    for i, (name, a, b) in enumerate(zip(present, ref.buffers, q.buffers)):
        slots = width if i < 2 else len(prompt)
        s = scale[f"kv_int8.scale.{name}"].reshape(a.shape[1], 1, a.shape[3])  # [Hkv, 1, D]
        values = a[0, :, :slots]
        inside = np.abs(values) <= QMAX * s  # calibrated range; beyond it values saturate at +-127
        error = np.abs(b[0, :, :slots].astype(np.float32) * s - values)
        assert (error[inside] <= s.repeat(slots, axis=1)[inside] / 2 + 1e-6).all()
        assert inside.mean() > 0.99


@pytest.mark.parametrize("variant", ["llama", "llama-fused"])
def test_generation_paths_run_on_the_int8_cache(pair, variant):
    """Batches, beams, speculation and the cache's row moves all handle int8 buffers unchanged."""
    from llmx.runtime.beam import BeamParams, BeamSearch
    from llmx.runtime.drafters import NgramDrafter

    fp32, int8 = pair(variant)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    prompts = [fp32.encode(p) for p in (PROMPT, "import json", "def f(x):\n    return x\n\ndef f(")]
    plain = [s.output_ids for s in generate(int8.backend, int8.tokenizer, prompts, params)]
    fast = generate(int8.backend, int8.tokenizer, prompts, params, drafter=NgramDrafter(4))
    assert [s.output_ids for s in fast] == plain
    assert plain[0] == fp32.generate([PROMPT], params)[0].output_ids  # these 24 greedy tokens survive int8
    beams = BeamSearch(int8.backend, prompts[0], BeamParams(num_beams=3, max_new_tokens=8), []).run()
    assert len(beams) == 3 and beams[0].score >= beams[-1].score


def test_manifest_records_the_int8_cache(pair):
    fp32, int8 = pair("llama")
    m = load_manifest(int8.artifact.root)
    assert m.kv.dtype == "int8" and m.precision.kv_cache == "int8"
    assert m.lineage[-1].stage == "kv-int8" and m.kv.quantization["calibration_windows"] == 8
    past, present = kv_names(m)
    decode = {t.name: t.dtype for t in m.graphs["decode"].inputs}
    assert all(decode[p] == "int8" for p in past)
    assert all(t.dtype == "int8" for t in m.graphs["prefill"].outputs if t.name in present)
    assert json.loads((int8.artifact.root / "llmx.json").read_text())["kv"]["dtype"] == "int8"


def test_refusals(pair, tmp_path):
    _, int8 = pair("llama")
    with pytest.raises(InputError, match="already int8"):
        quantize_kv_artifact(int8.artifact.root, tmp_path / "again", windows(int8))
    assert not (tmp_path / "again").exists()
    fp32, _ = pair("llama")
    with pytest.raises(InputError, match="at least one window"):
        quantize_kv_artifact(fp32.artifact.root, tmp_path / "none", [])
    assert not (tmp_path / "none").exists()


# -- through llmx calibrate ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def calib_text(tmp_path_factory):
    import argparse

    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(inspect.getsource(argparse))
    return path


@pytest.mark.parametrize("scheme, fused", [(None, False), ("w8", False), ("w8", True)])
def test_calibrate_kv_cache_int8_alone_or_with_a_scheme(store, calib_text, tmp_path, capsys, scheme, fused):
    from llmx.cli import main

    out = tmp_path / "art"
    source = store.optimized("llama") if fused else store.artifact("llama")
    args = ["calibrate", str(source), "--data", str(calib_text), "--kv-cache", "int8", "-o", str(out),
            "--samples", "4", "--seq-len", "32", "--eval-samples", "4", "--threads", "1", "--json"]
    main(args + (["--scheme", scheme] if scheme else []))
    report = json.loads(capsys.readouterr().out)
    m = load_manifest(out)
    assert report["label"] == ("w8+kv8" if scheme else "kv8") and report["kv_cache"] == "int8"
    assert m.kv.dtype == "int8" and m.precision.kv_cache == "int8" and m.precision.scheme == scheme
    assert m.lineage[-1].to_dict() == {"stage": "calibrate", "scheme": scheme, "kv_cache": "int8"}
    assert report == m.extras["quality"] and report["top1_agreement"] > 0.9
    if scheme is None:  # the cache is the only change: weights untouched, quality close to float32
        assert report["perplexity_ratio"] == pytest.approx(1.0, abs=0.02)
        assert m.graphs["decode"].ops == "portable"
    decode = {n.op_type for n in onnx.load(str(out / "decode.onnx"), load_external_data=False).graph.node}
    assert ("GroupQueryAttention" in decode) == fused and ("ScatterElements" in decode) != fused
    engine = Engine.load(out, threads=1)
    assert engine.backend.new_cache(1, 8).buffers[0].dtype == np.int8
    assert len(engine.generate(["def main():"], SamplingParams(max_new_tokens=6, temperature=0))[0].output_ids) == 6


def test_calibrate_needs_a_scheme_or_the_kv_cache(store, calib_text, tmp_path, capsys):
    from llmx.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["calibrate", str(store.artifact("llama")), "--data", str(calib_text), "-o", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert exc.value.code != 0 and "--scheme is required" in err and not (tmp_path / "x").exists()
