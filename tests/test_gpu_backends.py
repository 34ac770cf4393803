"""The GPU backends' own logic on the CPU, through the fakes in fake_gpu.py: a host-memory
device and a TensorRT runtime whose engines run their ONNX graph on ONNX Runtime CPU.

These check what llmx does around TensorRT and CUDA (device KV cache, binding by address,
past == present in place, prefill into rows, both engine layouts, CUDA-graph replay,
compaction, capacity growth, limits) by demanding the same tokens and logits as the
ONNX Runtime CPU backend on the same graphs. They cannot check TensorRT's numerics: see
test_tensorrt_gpu.py."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from fake_gpu import FakeBuilder, HostDevice, make_fake_tensorrt
from llmx.errors import ArtifactError, InputError, LlmxError
from llmx.artifact import Artifact
from llmx.artifact.manifest import load_manifest
from llmx.engine.tensorrt import build_artifact, plan_build
from llmx.artifact.tensorrt import BuildLimits
from llmx.runtime.device_cache import DeviceKVCache
from llmx.runtime.engine import Engine
from llmx.runtime.generate import generate
from llmx.runtime.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "import json\nclass Encoder", "x"]
PARAMS = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (12, 5, 9)]  # rows finish at different steps


@pytest.fixture
def device(monkeypatch) -> HostDevice:
    """A fake GPU for every GPU backend, and a fake ``tensorrt`` module."""
    from llmx.runtime import ort_device_backend, tensorrt_backend

    device = HostDevice()
    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt())
    monkeypatch.setattr(tensorrt_backend, "open_device", lambda index=0: device)
    monkeypatch.setattr(ort_device_backend, "open_device", lambda index=0: device)
    return device


@pytest.fixture(scope="module")
def built(llama_artifact, tmp_path_factory):
    """Built artifacts by (precision, layout); shared prefill in chunks of 4 to exercise chunking."""
    root, cache = tmp_path_factory.mktemp("built"), {}

    def get(precision: str, layout: str):
        if (precision, layout) not in cache:
            limits = BuildLimits(max_batch=4, max_seq_len=128, max_decode_tokens=4, prefill_chunk=4 if layout == "shared" else None)
            plan = plan_build(llama_artifact, precision, layout, limits)
            out = root / f"{precision}-{layout}"
            build_artifact(llama_artifact, out, plan, FakeBuilder)
            cache[(precision, layout)] = out
        return cache[(precision, layout)]

    return get


@pytest.fixture(scope="module")
def qdq_artifact(llama_artifact, tmp_path_factory):
    from qdq_artifact import make_qdq_artifact

    return make_qdq_artifact(llama_artifact, tmp_path_factory.mktemp("qdq") / "int8")


def tokens(engine: Engine, padding: str = "right") -> list[list[int]]:
    return [s.output_ids for s in engine.generate(PROMPTS, PARAMS, padding=padding)]


@pytest.mark.parametrize("precision, layout", [("fp32", "split"), ("fp16", "split"), ("fp32", "shared"), ("fp16", "shared")])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_tensorrt_backend_generates_what_onnx_runtime_cpu_does(built, device, precision, layout, padding):
    art = built(precision, layout)
    trt = Engine.load(art, backend="tensorrt")
    assert tokens(trt, padding) == tokens(Engine.load(art, threads=1), padding)
    ctx = trt.backend.decode_ctx
    assert ctx.replays > 0 and device.launches == ctx.replays  # steady decode steps replay a CUDA graph
    assert ctx.executions <= 3  # one execution (then capture) per batch size: 3, 2, 1 rows


@pytest.mark.parametrize("layout", ["split", "shared"])
def test_tensorrt_logits_match_the_cpu_backend_step_by_step(built, device, layout):
    art = built("fp32", layout)
    trt, cpu = Engine.load(art, backend="tensorrt").backend, Engine.load(art, threads=1).backend
    prompts = [Engine.load(art).encode(p) for p in PROMPTS[:2]]
    caches = [trt.new_cache(2, 16), cpu.new_cache(2, 16)]  # rounded up to 64 slots; decode must grow it
    a, b = trt.prefill(caches[0], [0, 1], prompts), cpu.prefill(caches[1], [0, 1], prompts)
    np.testing.assert_allclose(a, b, atol=1e-4)
    ids = np.array([[5], [7]])
    for step in range(64):
        a, b = trt.decode(caches[0], ids), cpu.decode(caches[1], ids)
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"step {step}")
        ids = a[:, -1].argmax(-1)[:, None]
    assert caches[0].capacity == 128 and caches[0].version == 1  # grown on the device, graphs recaptured
    for x, y in zip(caches[0].read(1), caches[1].read(1)):
        np.testing.assert_allclose(x, y, atol=1e-5)


@pytest.mark.parametrize("layout", ["split", "shared"])
def test_copy_back_instead_of_in_place_gives_the_same_tokens(built, device, layout):
    art = built("fp16", layout)
    copy_back = Engine.load(art, backend="tensorrt", kv_in_place=False)
    assert tokens(copy_back) == tokens(Engine.load(art, threads=1))
    assert copy_back.backend.decode_ctx.replays > 0


def test_multi_token_decode_steps_and_no_graphs(built, device):
    art = built("fp16", "split")
    trt = Engine.load(art, backend="tensorrt", cuda_graphs=False).backend
    cpu = Engine.load(art, threads=1).backend
    prompt = [Engine.load(art).encode(PROMPTS[0])]
    caches = [trt.new_cache(1, 32), cpu.new_cache(1, 32)]
    trt.prefill(caches[0], [0], prompt), cpu.prefill(caches[1], [0], prompt)
    ids = np.array([[3, 4, 5, 6]])  # T = 4: a speculative draft checked in one step
    np.testing.assert_allclose(trt.decode(caches[0], ids), cpu.decode(caches[1], ids), atol=1e-3)
    assert device.launches == 0
    with pytest.raises(InputError, match="built for 1..4"):
        trt.decode(caches[0], np.zeros((1, 5), np.int64))


def test_engine_limits_are_clear_errors(built, device):
    trt = Engine.load(built("fp32", "split"), backend="tensorrt")
    with pytest.raises(InputError, match="--max-batch 4"):
        trt.backend.new_cache(5, 16)
    assert trt.max_seq_len == 128
    with pytest.raises(InputError, match="maximum context length is 128"):
        trt.generate(["word " * 200], SamplingParams(max_new_tokens=2))


def test_engines_from_another_tensorrt_or_gpu_are_refused_at_load(built, device, monkeypatch):
    art = built("fp32", "split")
    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt("10.8.0"))
    with pytest.raises(ArtifactError, match="built with TensorRT 10.99.0, this machine has 10.8.0"):
        Engine.load(art, backend="tensorrt")
    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt())
    device.cc = "9.0"
    with pytest.raises(ArtifactError, match="rebuild them here"):
        Engine.load(art, backend="tensorrt")


def test_int8_qdq_artifact_builds_and_runs(qdq_artifact, device, tmp_path):
    plan = plan_build(qdq_artifact, "auto", "split", BuildLimits(max_batch=2, max_seq_len=64))
    assert (plan.precision, plan.int8_source, plan.kv_dtype) == ("int8", "qdq", "float16")
    build_artifact(qdq_artifact, tmp_path / "trt8", plan, FakeBuilder)
    trt, cpu = Engine.load(tmp_path / "trt8", backend="tensorrt"), Engine.load(tmp_path / "trt8", threads=1)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    assert [s.output_ids for s in trt.generate(PROMPTS[:2], params)] == [s.output_ids for s in cpu.generate(PROMPTS[:2], params)]


# -- ONNX Runtime on a device ---------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_ort_device_backend_generates_what_the_cpu_backend_does(built, device, precision):
    from llmx.runtime.ort_device_backend import OrtDeviceBackend

    art = built(precision, "split")
    cpu = Engine.load(art, threads=1)
    backend = OrtDeviceBackend(Artifact.open(art), provider="cpu", threads=1)  # the device path, on the CPU provider
    prompts = [cpu.encode(p) for p in PROMPTS]
    for padding in ("right", "left"):
        got = [s.output_ids for s in generate(backend, cpu.tokenizer, prompts, PARAMS, padding)]
        assert got == [s.output_ids for s in generate(cpu.backend, cpu.tokenizer, prompts, PARAMS, padding)]


def test_chunked_and_prefix_cached_prompts_join_from_a_device_cache(built, device):
    """The server's long and prefix-cached prompts run in a one-row cache of their own
    (ChunkedPrefill) and join the batch with that row's keys and values, read back through the
    cache: on a GPU backend too, whose buffers are device addresses (on a lent H200, ort-cuda's
    first prefix-cache hit answered 500). Same KV and logits as the CPU backend, chunked and
    resumed from a cached prefix."""
    from llmx.runtime.chunked_prefill import ChunkedPrefill
    from llmx.runtime.ort_device_backend import OrtDeviceBackend
    from llmx.runtime.sequence import Sequence

    art = built("fp32", "split")
    cpu = Engine.load(art, threads=1)
    gpu = OrtDeviceBackend(Artifact.open(art), provider="cpu", threads=1)
    ids = cpu.encode(PROMPTS[0] + PROMPTS[1])
    runs = {}
    for name, backend in (("cpu", cpu.backend), ("device", gpu)):
        whole = ChunkedPrefill(backend, Sequence(ids, PARAMS[0], cpu.tokenizer, 128), chunk=5)
        while not whole.finished:
            whole.step()
        prefix = (4, [e[:, :4] for e in whole.entries()])
        warm = ChunkedPrefill(backend, Sequence(ids, PARAMS[0], cpu.tokenizer, 128), len(ids) - 4, prefix)
        warm.step()
        runs[name] = [(p.entries(), p.logits) for p in (whole, warm)]
    for (cpu_kv, cpu_logits), (dev_kv, dev_logits) in zip(runs["cpu"], runs["device"]):
        assert len(dev_kv) == len(cpu_kv) and dev_kv[0].shape == cpu_kv[0].shape == (dev_kv[0].shape[0], len(ids), dev_kv[0].shape[2])
        for a, b in zip(cpu_kv, dev_kv):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dev_logits, cpu_logits, rtol=1e-4, atol=1e-4)


def test_captured_decode_steps_generate_what_the_cpu_backend_does(built, device, monkeypatch):
    """The CUDA-graph decode path (fixed buffers per shape, a mask over the whole capacity), run
    on the CPU provider: same tokens as plain decoding, one buffer set per shape, and evicted
    shapes free their buffers."""
    from llmx.runtime import ort_cuda_graph
    from llmx.runtime.ort_device_backend import OrtDeviceBackend

    monkeypatch.setattr(ort_cuda_graph, "MAX_GRAPHS", 2)
    art = built("fp32", "split")
    cpu = Engine.load(art, threads=1)
    backend = OrtDeviceBackend(Artifact.open(art), provider="cpu", threads=1, cuda_graph=True)
    assert backend.cuda_graph is not None and backend.sessions["decode"] is backend.cuda_graph.session
    prompts = [cpu.encode(p) for p in PROMPTS]
    for padding in ("right", "left"):
        got = [s.output_ids for s in generate(backend, cpu.tokenizer, prompts, PARAMS, padding)]
        assert got == [s.output_ids for s in generate(cpu.backend, cpu.tokenizer, prompts, PARAMS, padding)]
    steps = backend.cuda_graph.steps
    assert len(steps) == 2 and backend.cuda_graph.next_id > 2  # rows finishing changed the shape; old ones evicted
    live = set(device.allocations)
    assert all(ptr in live for step in steps.values() for ptr in (*step.inputs.values(), step.logits_ptr))


@pytest.mark.parametrize("spin", [None, False, True])
def test_the_device_backend_takes_every_option_bench_and_serve_pass(llama_artifact, device, spin):
    """`llmx bench --backend ort-cuda` crashed on a GPU: engine_options passed `spin`, which the
    device backend did not take."""
    from llmx.runtime.engine import engine_options
    from llmx.runtime.ort_device_backend import OrtDeviceBackend

    options = engine_options("ort-cuda", 1, False, spin)
    backend = OrtDeviceBackend(Artifact.open(llama_artifact), provider="cpu", **options)
    assert backend.sessions["decode"].get_session_options().intra_op_num_threads == 1


def test_cuda_graphs_are_refused_for_fused_graphs(llama_artifact, device, tmp_path):
    from llmx.optimize.fuse import optimize_artifact
    from llmx.runtime.ort_device_backend import OrtDeviceBackend

    optimized = tmp_path / "opt"
    optimize_artifact(llama_artifact, optimized)
    with pytest.raises(InputError, match="portable"):
        OrtDeviceBackend(Artifact.open(optimized), provider="cpu", threads=1, cuda_graph=True)
    assert OrtDeviceBackend(Artifact.open(optimized), provider="cpu", threads=1).cuda_graph is None


def test_a_refused_capture_decodes_with_plain_steps_unless_asked_for_by_name(llama_artifact, device, monkeypatch, caplog):
    """ONNX Runtime refuses to capture a step that copies between host and GPU (seen on an H100):
    the default then falls back to plain steps with one warning; --cuda-graph by name fails."""
    from llmx.errors import ArtifactError
    from llmx.runtime import ort_device_backend
    from llmx.runtime.ort_device_backend import OrtDeviceBackend

    def refused(*args, **kwargs):
        raise ArtifactError("ONNX Runtime cannot capture decode.onnx as a CUDA graph: (a copy)")

    monkeypatch.setattr(OrtDeviceBackend, "_wants_cuda_graph", lambda self, provider, requested: True)
    monkeypatch.setattr(ort_device_backend, "CudaGraphDecode", refused)
    with caplog.at_level("WARNING"):
        backend = OrtDeviceBackend(Artifact.open(llama_artifact), provider="cpu", threads=1)
    assert backend.cuda_graph is None and "plain steps" in caplog.text
    cache = backend.new_cache(1, 16)
    assert backend.prefill(cache, [0], [[5, 9, 23]]).shape[-1] == backend.vocab_size
    with pytest.raises(ArtifactError, match="cannot capture"):
        OrtDeviceBackend(Artifact.open(llama_artifact), provider="cpu", threads=1, cuda_graph=True)


def test_ort_cuda_with_gpu_onnxruntime_but_no_gpu_is_a_clear_error(llama_artifact, monkeypatch):
    import onnxruntime

    from llmx.runtime.ort_device_backend import OrtDeviceBackend

    # onnxruntime-gpu lists its CUDA provider even on a machine without a GPU
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(LlmxError, match="no CUDA runtime found|no CUDA GPU is visible|needs polygraphy"):
        OrtDeviceBackend(Artifact.open(llama_artifact), provider="cuda")


def test_tensorrt_provider_options_come_from_the_build_record(built, monkeypatch, tmp_path):
    from llmx.runtime.ort_device_backend import tensorrt_provider_options

    manifest = load_manifest(built("fp16", "split"))
    options = tensorrt_provider_options(manifest, "decode", tmp_path)
    assert options["trt_profile_max_shapes"].startswith("input_ids:4x4,attention_mask:4x128,position_ids:4x4,")
    assert options["trt_engine_cache_enable"] == "True"
    other = tensorrt_provider_options(load_manifest(built("fp32", "split")), "decode", tmp_path)
    assert options["trt_engine_cache_path"] != other["trt_engine_cache_path"]  # keyed by graph checksum


# -- the device KV cache -------------------------------------------------------------------------------


def host_entries(rng, n, heads=2, dim=16, dtype=np.float16):
    return [rng.standard_normal((heads, n, dim)).astype(dtype) for _ in range(4)]


def test_device_cache_write_read_grow_move_reorder():
    device, rng = HostDevice(), np.random.default_rng(0)
    cache = DeviceKVCache(device, num_layers=2, kv_heads=2, head_dim=16, rows=3, capacity=5, max_capacity=256, dtype="float16")
    assert cache.capacity == 64 and all(cache.row_ptr(b, r) % 256 == 0 for b in range(4) for r in range(3))
    a, b = host_entries(rng, 7), host_entries(rng, 3)
    cache.write(0, a)
    cache.write(2, b)
    cache.ensure_capacity(100)  # new buffers, old slots copied
    assert cache.capacity == 128 and cache.version == 1
    for got, want in zip(cache.read(0), a):
        np.testing.assert_array_equal(got, want)
    cache.move_row(2, 1)
    assert list(cache.lengths) == [7, 3, 0]
    for got, want in zip(cache.read(1), b):
        np.testing.assert_array_equal(got, want)
    cache.reorder(np.array([1, 0]))
    assert list(cache.lengths[:2]) == [3, 7]
    for got, want in zip(cache.read(1), a):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(InputError, match="exceeds the maximum length 256"):
        cache.ensure_capacity(300)
    cache.close()
    assert device.allocations == {}  # every buffer freed


def test_device_cache_starts_zeroed():
    # Attention multiplies masked slots by exactly 0; 0 * NaN from uninitialized memory is NaN.
    device = HostDevice()
    cache = DeviceKVCache(device, 1, 2, 16, rows=2, capacity=64, max_capacity=64, dtype="float32")
    assert all(not np.any(x) for x in cache.read(1, 0, 64))
