"""llmx build on the CPU: profiles, precision choice, version/GPU records, calibration tables,
the manifest a build writes (with a fake engine builder) and the errors without TensorRT.

What needs a real GPU is in test_tensorrt_gpu.py (marked ``gpu``)."""

from __future__ import annotations

import json
import struct

import polygraphy  # noqa: F401  (llmx build's loader library: installed with the test extras, never skipped)
import pytest

from fake_gpu import FakeBuilder
from llmx.errors import ArtifactError, InputError
from llmx.artifact import Artifact
from llmx.artifact.manifest import load_manifest
from llmx.engine.tensorrt import ArtifactFacts, build_artifact, plan_build, resolve_precision
from llmx.engine.trt_profiles import engine_specs
from llmx.engine.trt_records import (check_precision_supported, default_timing_cache, find_calibration_table,
                                     read_calibration_table)
from llmx.artifact.tensorrt import BuildLimits, check_engine_compatible, default_prefill_chunk, graph_profile, ort_trt_profile_options, TensorRTRecord
from test_cli import error_line, run

# -- profiles ---------------------------------------------------------------------------------------


def test_split_layout_profiles_cover_prefill_and_decode_shapes(llama_artifact):
    manifest = load_manifest(llama_artifact)  # tiny llama: 2 layers, 2 KV heads, head_dim 16, max 256
    limits = BuildLimits(max_batch=8, max_seq_len=128, max_decode_tokens=4, opt_batch=2).resolve(manifest.model)
    prefill, decode = engine_specs(manifest, limits, "split")
    assert (prefill.file, decode.file) == ("prefill.engine", "decode.engine")
    (p,), (d,) = prefill.profiles, decode.profiles
    assert p.shapes["input_ids"] == [[1, 1], [2, 128], [8, 128]]
    assert p.shapes.keys() == {"input_ids", "attention_mask", "position_ids"}
    assert d.shapes["input_ids"] == [[1, 1], [2, 1], [8, 4]]  # decode steps: 1..max_decode_tokens new tokens
    assert d.shapes["attention_mask"] == [[1, 1], [2, 128], [8, 128]]  # total length up to max_seq_len
    assert d.shapes["past_key_values.1.value"] == [[1, 2, 1, 16], [2, 2, 128, 16], [8, 2, 128, 16]]  # heads/dim fixed
    assert len([n for n in d.shapes if n.startswith("past_key_values")]) == 4


def test_shared_layout_is_one_engine_with_a_prefill_and_a_decode_profile(llama_artifact):
    manifest = load_manifest(llama_artifact)
    limits = BuildLimits(max_batch=4, max_seq_len=64, prefill_chunk=32).resolve(manifest.model)
    (engine,) = engine_specs(manifest, limits, "shared")
    assert (engine.file, engine.graph) == ("model.engine", "decode")
    prefill, decode = engine.profiles
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert prefill.range_of("input_ids", 1) == (1, 32) and decode.range_of("input_ids", 1) == (1, 8)
    assert prefill.range_of("past_key_values.0.key", 2) == decode.range_of("past_key_values.0.key", 2) == (1, 64)


def test_an_unknown_dynamic_axis_is_a_clear_error(llama_artifact):
    graph = load_manifest(llama_artifact).graphs["decode"]
    graph.inputs[0].shape = ["batch", "mystery"]
    with pytest.raises(ArtifactError, match="dynamic axis 'mystery'"):
        graph_profile("decode", graph, {"batch": (1, 1, 2)})


@pytest.mark.parametrize("limits, message", [
    (BuildLimits(max_seq_len=4096), "between 2 and the model's maximum 256"),
    (BuildLimits(max_seq_len=64, max_decode_tokens=65), "--max-decode-tokens"),
    (BuildLimits(max_batch=2, opt_batch=3), "--opt-batch"),
    (BuildLimits(max_seq_len=64, prefill_chunk=65), "--prefill-chunk"),
])
def test_limits_out_of_range_are_refused(llama_artifact, limits, message):
    with pytest.raises(InputError, match=message):
        limits.resolve(load_manifest(llama_artifact).model)


def test_default_limits_follow_the_model(llama_artifact):
    limits = BuildLimits().resolve(load_manifest(llama_artifact).model)
    assert (limits.max_seq_len, limits.opt_seq_len, limits.max_batch) == (256, 256, 8)


def test_default_prefill_chunk_bounds_the_logits_buffer():
    chunk = default_prefill_chunk(max_batch=8, vocab_size=49152, max_seq_len=2048)  # SmolLM-135M's vocab
    assert chunk == 128 and 8 * chunk * 49152 * 4 <= 256 << 20 < 8 * 2 * chunk * 49152 * 4
    assert default_prefill_chunk(1, 320, 256) == 256  # tiny vocab: the whole sequence at once


def test_ort_tensorrt_provider_profile_syntax(llama_artifact):
    manifest = load_manifest(llama_artifact)
    (spec,) = engine_specs(manifest, BuildLimits(max_batch=2, max_seq_len=32).resolve(manifest.model), "split")[:1]
    options = ort_trt_profile_options(spec.profiles[0])
    assert options["trt_profile_min_shapes"] == "input_ids:1x1,attention_mask:1x1,position_ids:1x1"
    assert options["trt_profile_max_shapes"] == "input_ids:2x32,attention_mask:2x32,position_ids:2x32"


def test_profiles_become_polygraphy_profiles(llama_artifact):
    from llmx.engine.trt_build import polygraphy_profile

    manifest = load_manifest(llama_artifact)
    spec = engine_specs(manifest, BuildLimits(max_batch=2, max_seq_len=32).resolve(manifest.model), "split")[1]
    profile = polygraphy_profile(spec.profiles[0])
    shape = profile["past_key_values.0.key"]
    assert (tuple(shape.min), tuple(shape.opt), tuple(shape.max)) == ((1, 2, 1, 16), (1, 2, 32, 16), (2, 2, 32, 16))


# -- precision ---------------------------------------------------------------------------------------

FLOAT = ArtifactFacts("float32", None, {}, None)
QDQ = ArtifactFacts("float32", "w8a8", {"int8": 40}, None)
TABLE = ArtifactFacts("float32", "w8a8", {}, "calibration.cache")
FP16 = ArtifactFacts("float16", None, {}, None)


@pytest.mark.parametrize("requested, facts, expected", [
    ("auto", FLOAT, ("fp16", "float16", None)),
    ("fp32", FLOAT, ("fp32", None, None)),
    ("tf32", FLOAT, ("tf32", None, None)),
    ("bf16", FLOAT, ("bf16", "bfloat16", None)),
    ("auto", QDQ, ("int8", "float16", "qdq")),  # Q/DQ graph; other float math in fp16
    ("int8", QDQ, ("int8", "float16", "qdq")),
    ("auto", TABLE, ("int8", None, "calibration_table")),  # TensorRT 10 implicit INT8
    ("auto", FP16, ("fp16", None, None)),  # already converted: nothing to do
    ("auto", ArtifactFacts("float32", "fp8", {"fp8": 10}, None), ("fp8", "float16", "qdq")),
])
def test_precision_resolution(requested, facts, expected):
    assert resolve_precision(requested, facts) == expected


@pytest.mark.parametrize("requested, facts, message", [
    ("fp16", QDQ, "holds INT8 Q/DQ graphs"),
    ("int8", FLOAT, "run `llmx calibrate` first"),
    ("fp8", QDQ, "holds INT8 Q/DQ graphs"),
    ("bf16", FP16, "already float16"),
    ("fp64", FLOAT, "--precision must be one of"),
])
def test_impossible_precisions_are_refused(requested, facts, message):
    with pytest.raises(InputError, match=message):
        resolve_precision(requested, facts)


@pytest.mark.parametrize("precision, cc, ok", [
    ("bf16", "7.5", False), ("bf16", "8.0", True), ("fp8", "8.6", False), ("fp8", "8.9", True), ("int8", "7.5", True),
    ("tf32", "7.5", False), ("fp16", "7.0", True),
])
def test_precision_needs_a_capable_gpu(precision, cc, ok):
    device = {"name": "Some GPU", "compute_capability": cc}
    if ok:
        check_precision_supported(precision, device)
    else:
        with pytest.raises(InputError, match=f"{precision} needs a GPU of compute capability"):
            check_precision_supported(precision, device)


# -- records -----------------------------------------------------------------------------------------

L4 = {"name": "NVIDIA L4", "compute_capability": "8.9"}
RECORD = TensorRTRecord.parse({
    "version": "10.13.0.35", "device": L4, "precision": "fp16", "layout": "shared",
    "limits": BuildLimits(8, 256, 8, 64, 1, 256).to_dict(), "engines": {"model": {"file": "model.engine", "graph": "decode"}}})


def test_engines_load_only_on_the_tensorrt_version_and_architecture_that_built_them():
    assert check_engine_compatible(RECORD, "10.13.0.35", {"name": "NVIDIA L4", "compute_capability": "8.9"}) == []
    with pytest.raises(ArtifactError, match="built with TensorRT 10.13.0.35, this machine has 10.9.0.34; rebuild"):
        check_engine_compatible(RECORD, "10.9.0.34", L4)
    with pytest.raises(ArtifactError, match=r"built for NVIDIA L4 \(compute capability 8.9\), this GPU is NVIDIA H100 \(9.0\)"):
        check_engine_compatible(RECORD, "10.13.0.35", {"name": "NVIDIA H100", "compute_capability": "9.0"})
    warnings = check_engine_compatible(RECORD, "10.13.0.35", {"name": "NVIDIA RTX 4090", "compute_capability": "8.9"})
    assert warnings and "NVIDIA L4" in warnings[0]


def test_timing_cache_is_per_tensorrt_version_and_architecture(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path))
    path = default_timing_cache("10.13.0.35", {"compute_capability": "8.9"})
    assert path == tmp_path / "tensorrt" / "timing-10.13.0.35-sm89.cache"


def test_calibration_tables_in_every_format_read_as_amax(tmp_path):
    (tmp_path / "calibration.cache").write_text("x 2.5\nmatmul_out -7.0\n")  # ONNX Runtime text
    (tmp_path / "calibration.json").write_text(json.dumps({"x": {"lowest": -3.0, "highest": 2.0}, "y": [[-1.0], [4.0]]}))
    scale = struct.pack(">f", 5.0 / 127).hex()
    (tmp_path / "trt.cache").write_text(f"TRT-100900-EntropyCalibration2\nx: {scale}\n")  # TensorRT's own cache
    assert read_calibration_table(tmp_path / "calibration.cache") == {"x": 2.5, "matmul_out": 7.0}
    assert read_calibration_table(tmp_path / "calibration.json") == {"x": 3.0, "y": 4.0}
    assert read_calibration_table(tmp_path / "trt.cache") == {"x": pytest.approx(5.0)}
    (tmp_path / "bad.cache").write_text("x notanumber\n")
    with pytest.raises(ArtifactError, match="cannot read calibration table"):
        read_calibration_table(tmp_path / "bad.cache")


def test_calibration_table_is_found_from_the_manifest_or_by_name(llama_artifact, tmp_path):
    manifest = load_manifest(llama_artifact)
    assert find_calibration_table(Artifact(tmp_path, manifest)) is None
    (tmp_path / "calib").mkdir()
    (tmp_path / "calib" / "table.json").write_text("{}")
    manifest.extras["calibration"] = {"table": "calib/table.json"}
    assert find_calibration_table(Artifact(tmp_path, manifest)) == tmp_path / "calib" / "table.json"
    manifest.extras = {}
    (tmp_path / "calibration.cache").write_text("")
    assert find_calibration_table(Artifact(tmp_path, manifest)) == tmp_path / "calibration.cache"


def test_build_progress_prints_top_phases_with_times():
    from llmx.engine.trt_build import BuildProgress

    lines = []
    progress = BuildProgress(lines.append)
    progress.phase_start("Building engine", None, 3)
    progress.phase_start("Tactic selection", "Building engine", 10)
    progress.phase_start("Timing layer 7", "Tactic selection", 1)  # too deep to print
    assert progress.step_complete("Tactic selection", 1) is True
    progress.phase_finish("Timing layer 7")
    progress.phase_finish("Tactic selection")
    progress.phase_finish("Building engine")
    assert lines[:2] == ["  Building engine (3 steps)", "    Tactic selection (10 steps)"]
    assert len(lines) == 3 and lines[2].startswith("  Building engine: done in ")


# -- the built artifact (fake engine builder) ------------------------------------------------------------


def test_build_records_tensorrt_gpu_precision_profiles_and_engines(llama_artifact, tmp_path):
    plan = plan_build(llama_artifact, "fp16", "split", BuildLimits(max_batch=4, max_seq_len=128))
    builder = FakeBuilder({"name": "NVIDIA L4", "compute_capability": "8.9", "memory_bytes": 24 << 30})
    manifest = build_artifact(llama_artifact, tmp_path / "trt", plan, lambda: builder)
    assert builder.built == ["prefill", "decode"]
    record = load_manifest(tmp_path / "trt").tensorrt
    assert record.version == "10.99.0" and record.device.name == "NVIDIA L4"
    assert (record.precision, record.layout, record.strongly_typed) == ("fp16", "split", True)
    assert record.limits.max_batch == 4 and record.limits.max_seq_len == 128
    assert {e.file for e in record.engines.values()} == {"prefill.engine", "decode.engine"}
    assert record.engines["decode"].profiles[0].shapes["input_ids"] == [[1, 1], [1, 1], [4, 8]]
    assert manifest.kv.dtype == "float16" and manifest.lineage[-1].details["engines"] == ["prefill.engine", "decode.engine"]
    assert manifest.precision.compute_dtype == "float16"
    assert {"prefill.engine", "decode.engine", "weights.bin", "tokenizer/tokenizer.json"} <= set(manifest.checksums)


def test_inspect_check_passes_on_a_built_artifact(llama_artifact, tmp_path, capsys):
    plan = plan_build(llama_artifact, "fp32", "shared", BuildLimits(max_batch=2, max_seq_len=64))
    build_artifact(llama_artifact, tmp_path / "trt", plan, FakeBuilder)
    code, out, _ = run(["inspect", str(tmp_path / "trt"), "--check"], capsys)
    assert code == 0 and "lineage: export -> build" in out and "model.engine" in out


def test_a_gpu_that_cannot_run_the_precision_leaves_nothing_behind(llama_artifact, tmp_path):
    plan = plan_build(llama_artifact, "bf16", "split", BuildLimits(max_seq_len=64))
    turing = FakeBuilder({"name": "Tesla T4", "compute_capability": "7.5", "memory_bytes": 16 << 30})
    with pytest.raises(InputError, match="bf16 needs a GPU of compute capability 8.0"):
        build_artifact(llama_artifact, tmp_path / "trt", plan, lambda: turing)
    assert list(tmp_path.iterdir()) == []


def test_tensorrt_11_refuses_int8_from_a_calibration_table(llama_artifact, tmp_path):
    import shutil

    src = tmp_path / "calibrated"
    shutil.copytree(llama_artifact, src)
    (src / "calibration.cache").write_text("input_ids 1.0\n")
    data = json.loads((src / "llmx.json").read_text())
    data["precision"]["scheme"] = "w8a8"
    (src / "llmx.json").write_text(json.dumps(data))
    plan = plan_build(src, "auto", "split", BuildLimits(max_seq_len=64))
    assert (plan.int8_source, plan.strongly_typed, plan.calibration_table) == ("calibration_table", False, "calibration.cache")
    with pytest.raises(InputError, match="TensorRT 11 builds INT8 only from Q/DQ graphs"):
        build_artifact(src, tmp_path / "trt", plan, lambda: FakeBuilder(version="11.4.0"))
    manifest = build_artifact(src, tmp_path / "trt10", plan, FakeBuilder)  # TensorRT 10: weakly typed INT8
    assert (tmp_path / "trt10" / "calibration.cache").is_file() and manifest.tensorrt.int8_source == "calibration_table"


# -- the CLI without TensorRT / CUDA --------------------------------------------------------------------


def test_build_without_tensorrt_is_one_error_naming_what_to_install(llama_artifact, tmp_path, capsys):
    code, _, err = run(["build", str(llama_artifact), "-o", str(tmp_path / "trt")], capsys)
    line = error_line(err)
    assert code != 0 and "needs TensorRT" in line and "pip install" in line and "tensorrt-cu12" in line
    assert list(tmp_path.iterdir()) == []


def test_build_dry_run_prints_the_plan(llama_artifact, tmp_path, capsys):
    code, out, _ = run(["build", str(llama_artifact), "-o", str(tmp_path / "trt"), "--dry-run", "--max-batch", "2",
                        "--max-seq-len", "64", "--layout", "shared", "--precision", "bf16"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["precision"] == "bf16" and plan["kv_dtype"] == "bfloat16"
    assert [p["name"] for p in plan["engines"][0]["profiles"]] == ["prefill", "decode"]
    assert not (tmp_path / "trt").exists()


def test_build_refuses_graphs_with_onnxruntime_only_ops(llama_artifact, tmp_path, capsys):
    import shutil

    src = tmp_path / "optimized"
    shutil.copytree(llama_artifact, src)
    data = json.loads((src / "llmx.json").read_text())
    data["graphs"]["decode"]["ops"] = "onnxruntime"  # what `llmx optimize` writes: com.microsoft fused ops
    (src / "llmx.json").write_text(json.dumps(data))
    code, _, err = run(["build", str(src), "-o", str(tmp_path / "trt")], capsys)
    line = error_line(err)
    assert code != 0 and "build from the artifact before `llmx optimize`" in line and "--onnx-only" in line
    assert list(tmp_path.iterdir()) == [src]  # --onnx-only converts them (for ort-cuda): test_precision.py


def test_build_bad_options_are_one_error_line(llama_artifact, tmp_path, capsys):
    code, _, err = run(["build", str(llama_artifact), "-o", str(tmp_path / "t"), "--max-seq-len", "4096"], capsys)
    assert code == 2 and "model's maximum 256" in error_line(err)
    code, _, err = run(["build", str(tmp_path / "missing"), "-o", str(tmp_path / "t")], capsys)
    assert code != 0 and "does not exist" in error_line(err)


@pytest.mark.parametrize("backend, message", [
    ("tensorrt", "has no TensorRT engines; build them with `llmx build"),
    ("ort-cuda", "needs ONNX Runtime's CUDAExecutionProvider"),
    ("ort-tensorrt", "needs ONNX Runtime's TensorrtExecutionProvider"),
])
def test_gpu_backends_on_a_cpu_machine_are_one_clear_error(llama_artifact, capsys, backend, message):
    code, _, err = run(["generate", str(llama_artifact), "hi", "--backend", backend], capsys)
    assert code != 0 and message in error_line(err)


def test_tensorrt_backend_on_a_built_artifact_without_tensorrt_names_it(llama_artifact, tmp_path, capsys):
    plan = plan_build(llama_artifact, "fp32", "split", BuildLimits(max_seq_len=64))
    build_artifact(llama_artifact, tmp_path / "trt", plan, FakeBuilder)
    code, _, err = run(["generate", str(tmp_path / "trt"), "hi", "--backend", "tensorrt"], capsys)
    assert code != 0 and "--backend tensorrt needs TensorRT, which is not installed" in error_line(err)
