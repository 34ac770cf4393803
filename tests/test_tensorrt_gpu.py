"""On a GPU: real TensorRT engines, real CUDA, ONNX Runtime's CUDA and TensorRT providers.

Every test here is marked ``gpu`` (conftest skips them without CUDA); the TensorRT ones also
skip when the ``tensorrt`` package is missing. On a GPU box:

    pip install -e '.[gpu,tensorrt,export,test]' tensorrt-cu12
    pytest -m gpu -v tests/test_tensorrt_gpu.py

Tolerances: fp32 engines must continue greedily exactly like ONNX Runtime CPU; fp16 engines
must stay within fp16 error of the fp32 CPU logits (2 % of the logits' range).
"""

from __future__ import annotations

import numpy as np
import pytest

from llmx.engine.tensorrt import build_artifact, plan_build
from llmx.artifact.tensorrt import BuildLimits
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["def fibonacci(n):", "import json\nclass Encoder(json.JSONEncoder):", "x = "]
FP16_TOLERANCE = 2e-2  # of max |logit|
SMOLLM_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def smollm_shape_checkpoint(directory):
    """HuggingFaceTB/SmolLM-135M's shape with random weights (speed and numerics depend on shapes)."""
    import torch
    import transformers

    from checkpoints import train_tokenizer

    train_tokenizer(directory)  # a small vocabulary: prompts use ids below 320 of the model's 49152
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM_135M)).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def trt():
    return pytest.importorskip("tensorrt", reason="TensorRT needs a wheel matching the GPU's CUDA (docs/tensorrt.md)")


@pytest.fixture(scope="module")
def built(trt, llama_artifact, tmp_path_factory):
    """Engines for the tiny llama by (precision, layout), built once per module."""
    from llmx.engine.trt_build import PolygraphyBuilder

    root, cache = tmp_path_factory.mktemp("engines"), {}

    def get(precision: str, layout: str = "split", src=None):
        key = (precision, layout, str(src))
        if key not in cache:
            source = src or llama_artifact
            plan = plan_build(source, precision, layout, BuildLimits(max_batch=4, max_seq_len=256))
            out = root / f"{precision}-{layout}-{len(cache)}"
            build_artifact(source, out, plan, lambda: PolygraphyBuilder(timing_cache=root / "timing.cache"), log=print)
            cache[key] = out
        return cache[key]

    return get


def greedy(engine: Engine, n: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return [s.output_ids for s in engine.generate(PROMPTS, params)]


def step_logits(backend, prompts: list[list[int]], steps: int = 16, follow: list[np.ndarray] | None = None
                ) -> list[np.ndarray]:
    """Prefill logits, then ``steps`` greedy decode steps' logits (copied: backends reuse buffers).
    With ``follow`` (another backend's result) each step is fed that backend's greedy tokens: a near
    tie that rounding flips would otherwise compare two different continuations (measured on an
    H100: a top-2 gap of 0.2 % of the logit range, CUDA's 4-bit kernel 1 % off, errors of 60 %)."""
    cache = backend.new_cache(len(prompts), max(map(len, prompts)) + steps + 1)
    out = [backend.prefill(cache, list(range(len(prompts))), prompts).copy()]
    for step in range(steps):
        ids = (follow or out)[step].argmax(-1)[:, None]
        out.append(backend.decode(cache, ids)[:, -1].copy())
    return out


@pytest.mark.parametrize("layout", ["split", "shared"])
def test_engines_build_and_record_this_gpu_and_tensorrt(trt, built, layout):
    from llmx.cuda import open_device
    from llmx.artifact.manifest import load_manifest

    art = built("fp16", layout)
    record = load_manifest(art).tensorrt
    assert record["version"] == trt.__version__
    assert record["device"]["name"] == open_device().record()["name"]
    assert all((art / e["file"]).stat().st_size > 0 for e in record["engines"].values())


@pytest.mark.parametrize("layout", ["split", "shared"])
def test_fp16_engine_logits_match_onnx_runtime_cpu_fp32(built, llama_artifact, layout):
    trt = Engine.load(built("fp16", layout), backend="tensorrt")
    cpu = Engine.load(llama_artifact, threads=2)
    prompts = [cpu.encode(p) for p in PROMPTS]
    ref = step_logits(cpu.backend, prompts)
    ours = step_logits(trt.backend, prompts, follow=ref)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert np.abs(a - b).max() <= FP16_TOLERANCE * np.abs(b).max(), f"step {step}"


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("layout", ["split", "shared"])
def test_fp32_engines_continue_greedily_like_the_cpu_backend(built, llama_artifact, precision, layout):
    trt = Engine.load(built(precision, layout), backend="tensorrt")
    assert greedy(trt) == greedy(Engine.load(llama_artifact, threads=2))


def test_cuda_graph_replay_equals_plain_execution(built):
    art = built("fp32")
    with_graphs = Engine.load(art, backend="tensorrt")
    tokens = greedy(with_graphs)
    assert with_graphs.backend.decode_ctx.replays > 0
    assert tokens == greedy(Engine.load(art, backend="tensorrt", cuda_graphs=False))


def test_decode_updates_the_device_cache_in_place(built, llama_artifact):
    # past and present are bound to the same buffer: the engine's scatter must write into it
    trt, cpu = Engine.load(built("fp32"), backend="tensorrt").backend, Engine.load(llama_artifact, threads=2).backend
    prompt = [Engine.load(llama_artifact).encode(PROMPTS[0])]
    caches = [trt.new_cache(1, 64), cpu.new_cache(1, 64)]
    for backend, cache in zip((trt, cpu), caches):
        backend.prefill(cache, [0], prompt)
        for token in (11, 12, 13):
            backend.decode(cache, np.array([[token]]))
    for ours, ref in zip(caches[0].read(0), caches[1].read(0)):
        np.testing.assert_allclose(ours, ref, atol=1e-3)


def test_int8_engine_from_a_qdq_artifact(built, llama_artifact, tmp_path):
    from qdq_artifact import make_qdq_artifact

    qdq = make_qdq_artifact(llama_artifact, tmp_path / "int8")
    trt = Engine.load(built("int8", src=qdq), backend="tensorrt")
    cpu = Engine.load(qdq, threads=2)  # the Q/DQ graph on ONNX Runtime CPU (fp32 elsewhere)
    prompts = [cpu.encode(p) for p in PROMPTS]
    ref = step_logits(cpu.backend, prompts, steps=4)
    ours = step_logits(trt.backend, prompts, steps=4, follow=ref)
    for a, b in zip(ours, ref):  # int8 kernels round differently than ORT's Q/DQ emulation
        assert np.abs(a - b).max() <= 0.1 * np.abs(b).max()


@pytest.mark.slow
def test_smollm_135m_shape_builds_and_matches_onnx_runtime_cpu(trt, tmp_path):
    from llmx.export import export_checkpoint
    from llmx.engine.trt_build import PolygraphyBuilder

    ckpt = smollm_shape_checkpoint(tmp_path / "ckpt")
    export_checkpoint(ckpt, tmp_path / "art")
    plan = plan_build(tmp_path / "art", "fp16", "split", BuildLimits(max_batch=8, max_seq_len=2048))
    build_artifact(tmp_path / "art", tmp_path / "trt", plan, lambda: PolygraphyBuilder(), log=print)
    trt_engine, cpu = Engine.load(tmp_path / "trt", backend="tensorrt"), Engine.load(tmp_path / "art", threads=4)
    prompts = [cpu.encode(p) for p in PROMPTS]
    ref = step_logits(cpu.backend, prompts, 8)
    for a, b in zip(step_logits(trt_engine.backend, prompts, 8, follow=ref), ref):
        assert np.abs(a - b).max() <= FP16_TOLERANCE * np.abs(b).max()


def onnx_only(src, out, precision: str = "fp16"):
    """``llmx build --onnx-only``: the converted graphs, no TensorRT needed."""
    build_artifact(src, out, plan_build(src, precision, engines=False))
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_ort_cuda_backend_matches_the_cpu_backend(llama_artifact, precision, tmp_path):
    art = llama_artifact if precision == "fp32" else onnx_only(llama_artifact, tmp_path / "fp16")
    gpu = Engine.load(art, backend="ort-cuda")
    cpu = Engine.load(llama_artifact, threads=2)
    prompts = [cpu.encode(p) for p in PROMPTS]
    if precision == "fp32":
        assert greedy(gpu) == greedy(cpu)
    ref = step_logits(cpu.backend, prompts)
    for a, b in zip(step_logits(gpu.backend, prompts, follow=ref), ref):
        assert np.abs(a - b).max() <= (1e-3 if precision == "fp32" else FP16_TOLERANCE) * np.abs(b).max()


def test_ort_cuda_runs_w4_blocks_with_float32_and_float16_activations_like_the_cpu(store, tmp_path):
    """The fused w4 graphs (MatMulNBits, GroupQueryAttention) on CUDA, as exported (float32
    activations) and converted by --onnx-only (float16 activations, scales and KV cache)."""
    from llmx.export import export_checkpoint

    w4 = tmp_path / "w4"
    export_checkpoint(store.checkpoint("llama"), w4, precision="w4")
    assert_cuda_follows_the_cpu_as_is_and_in_fp16(w4, tmp_path)


def assert_cuda_follows_the_cpu_as_is_and_in_fp16(art, tmp_path) -> None:
    """``art`` on ort-cuda as it is and converted to float16 activations (--onnx-only), step by
    step within FP16_TOLERANCE of the CPU backend's logits. CUDA's MatMulNBits does not reproduce
    the CPU kernel's float32 sums: 1.0 % of the logit range on the tiny llama, 0.5 % on the demo
    model (H100, onnxruntime-gpu 1.31.1)."""
    cpu = Engine.load(art, threads=2)
    prompts = [cpu.encode(p) for p in PROMPTS]
    reference = step_logits(cpu.backend, prompts)
    for converted in (art, onnx_only(art, tmp_path / f"{art.name}-fp16")):
        gpu = Engine.load(converted, backend="ort-cuda")
        for a, b in zip(step_logits(gpu.backend, prompts, follow=reference), reference):
            assert np.abs(a - b).max() <= FP16_TOLERANCE * np.abs(b).max()


def test_ort_cuda_runs_a_calibrated_mixed_artifact_with_a_tied_lookup_like_the_cpu(store, tmp_path):
    """What `llmx calibrate --scheme w4` writes: AWQ-scaled, importance-rounded 4-bit blocks, some
    MatMuls kept at 8 bits, and a tied table looked up from the head's blocks (Gather on packed
    codes); on CUDA as calibrated (float32 activations) and converted to float16."""
    import argparse
    import inspect

    import onnx

    from llmx.calibration.calibrate import calibrate_artifact
    from llmx.calibration.matmuls import weight_matmuls
    from llmx.calibration.options import CalibrationOptions

    source = store.optimized("llama-tied-llama3rope-bias")
    weights = [mm.weight for mm in weight_matmuls(onnx.load_model(str(source / "decode.onnx"), load_external_data=False))]
    text = tmp_path / "calib.txt"
    text.write_text(inspect.getsource(argparse))
    w4 = tmp_path / "w4"
    options = CalibrationOptions(scheme="w4", awq=True, fallback=tuple(weights[1::3]), samples=2, seq_len=32,
                                 eval_samples=2, threads=2)
    calibrate_artifact(source, w4, text, options)
    decode = onnx.load_model(str(w4 / "decode.onnx"), load_external_data=False)
    bits = {a.i for n in decode.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {4, 8}
    assert_cuda_follows_the_cpu_as_is_and_in_fp16(w4, tmp_path)


def test_ort_cuda_graph_decode_equals_plain_steps(llama_artifact):
    """ort-cuda captures portable decode steps as CUDA graphs by default; they must give what
    plain steps give (checked on an H100 with benchmarks/gpu_verify.py, 2026-11-23)."""
    from llmx.artifact import Artifact
    from llmx.runtime.ort_device_backend import OrtDeviceBackend

    artifact = Artifact.open(llama_artifact)
    graphs = OrtDeviceBackend(artifact, provider="cuda")
    plain = OrtDeviceBackend(artifact, provider="cuda", cuda_graph=False)
    assert graphs.cuda_graph is not None and plain.cuda_graph is None
    cpu = Engine.load(llama_artifact, threads=2)
    prompts = [cpu.encode(p) for p in PROMPTS]
    ref = step_logits(plain, prompts)
    for a, b in zip(step_logits(graphs, prompts, follow=ref), ref):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_ort_tensorrt_backend_matches_the_cpu_backend(trt, llama_artifact, monkeypatch, tmp_path):
    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path))  # engine cache lands here
    gpu = Engine.load(llama_artifact, backend="ort-tensorrt")
    cpu = Engine.load(llama_artifact, threads=2)
    prompts = [cpu.encode(p) for p in PROMPTS]
    ref = step_logits(cpu.backend, prompts)
    for a, b in zip(step_logits(gpu.backend, prompts, follow=ref), ref):
        assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max()  # TensorRT may use TF32
    assert list((tmp_path / "ort-tensorrt").iterdir())  # engines cached for the next load
