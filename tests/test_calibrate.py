"""``llmx calibrate``: every scheme end to end on a tiny model, the report's numbers, SmoothQuant's
equivalence, TensorRT tables, decode calibrated on real KV, and bad input refused cleanly."""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from llmx.calibration import CalibrationOptions, calibrate_artifact
from llmx.artifact import Artifact
from llmx.artifact.manifest import load_manifest
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams
from test_cli import error_line, leftovers, run

FAST = dict(samples=4, seq_len=32, eval_samples=4, threads=1)
SCHEMES = {
    "w8a8-entropy-smoothquant": dict(scheme="w8a8", method="entropy", smoothquant=0.5),
    "w8a8-percentile-per-tensor": dict(scheme="w8a8", method="percentile", per_channel=False),
    "w8-asymmetric": dict(scheme="w8", symmetric=False, block_size=16),
    "w4": dict(scheme="w4", block_size=32),
}


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(inspect.getsource(argparse))
    return path


@pytest.fixture(scope="module")
def quantized(store, calib_text, tmp_path_factory):
    """Calibrated artifacts of the tiny Llama, one per entry of SCHEMES, built on first use."""
    root, built = tmp_path_factory.mktemp("quantized"), {}

    def get(name: str) -> Path:
        if name not in built:
            options = CalibrationOptions(**SCHEMES[name], **FAST)
            calibrate_artifact(store.artifact("llama"), root / name, calib_text, options)
            built[name] = root / name
        return built[name]

    return get


def op_types(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load_model(str(path), load_external_data=False).graph.node}


# -- each scheme end to end ------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SCHEMES))
def test_scheme_runs_end_to_end_and_generates(name, quantized, store):
    art = quantized(name)
    manifest = load_manifest(art)
    scheme = SCHEMES[name]["scheme"]
    assert manifest.precision.scheme == scheme and manifest.lineage[-1].stage == "calibrate"
    assert len(manifest.precision.data["sha256"]) == 64
    for graph in ("prefill", "decode"):
        ops = op_types(art / f"{graph}.onnx")
        assert ({"QuantizeLinear", "DequantizeLinear"} <= ops) if scheme == "w8a8" else ("MatMulNBits" in ops)
    seq = Engine.load(art, threads=1).generate(["def main():"], SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert len(seq.output_ids) == 8 and seq.finish_reason == "length"


@pytest.mark.parametrize("name", ["w8a8-percentile-per-tensor", "w4"])
def test_quantized_decode_graph_keeps_logits_to_keep(name, quantized):
    """Quantization keeps the input and its default (llmx/logits_to_keep.py): not fed, every position."""
    from test_logits_to_keep import PROMPT, run_decode

    artifact = quantized(name)
    assert load_manifest(artifact).graphs["decode"].input("logits_to_keep").shape == []
    every = run_decode(artifact, PROMPT, None)
    assert every.shape[1] == len(PROMPT)
    np.testing.assert_allclose(run_decode(artifact, PROMPT, 1), every[:, -1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_report_numbers_are_computed_and_saved(name, quantized, store):
    art = quantized(name)
    report = json.loads((art / "quality.json").read_text())
    assert report == load_manifest(art).extras["quality"]
    fp32, quant = report["fp32"], report["quantized"]
    assert report["perplexity_ratio"] == pytest.approx(quant["perplexity"] / fp32["perplexity"])
    # A sound 8/4-bit quantization of this model stays close to it on held-out text.
    assert 0.8 < report["perplexity_ratio"] < 1.25
    assert 0.6 < report["top1_agreement"] <= 1.0 and 0 <= report["mean_kl"] < 0.1
    assert report["tokens"] == report["windows"] * (FAST["seq_len"] - 1) and report["windows"] == FAST["eval_samples"]
    for graph, size in fp32["graph_bytes"].items():
        assert quant["graph_bytes"][graph] < 0.6 * size


def test_report_matches_an_independent_eval(quantized, store, calib_text, capsys):
    """The held-out perplexities in the report are what `llmx eval` measures on the same windows."""
    from llmx.calibration.data import read_text_data, split_windows, token_windows
    from llmx.runtime.evaluate import perplexity

    art = quantized("w4")
    report = json.loads((art / "quality.json").read_text())
    engine = Engine.load(art, threads=1)
    windows = token_windows(engine.tokenizer, read_text_data(calib_text), FAST["seq_len"])
    held_out = split_windows(windows, FAST["seq_len"], FAST["samples"], FAST["eval_samples"]).evaluation
    assert perplexity(engine.backend, held_out).perplexity == pytest.approx(report["quantized"]["perplexity"], rel=1e-5)
    fp32 = Engine.load(store.artifact("llama"), threads=1)
    assert perplexity(fp32.backend, held_out).perplexity == pytest.approx(report["fp32"]["perplexity"], rel=1e-5)


def test_a_searched_report_reads_the_judges_fp32_reference_instead_of_rerunning_it(store, calib_text, tmp_path,
                                                                                   monkeypatch):
    """After a search, the report's fp32 side is the judge's log-probabilities of the same windows
    (float16 on disk): the fp32 artifact is not opened again, and its perplexity is what an
    independent run measures, to float16's rounding."""
    import llmx.calibration.report as report_module
    from llmx.calibration.data import read_text_data, split_windows, token_windows
    from llmx.calibration.search import SearchSpace
    from llmx.runtime.evaluate import perplexity

    opened = []
    real = report_module.make_backend
    monkeypatch.setattr(report_module, "make_backend", lambda art, *a, **k: opened.append(Path(art.root)) or real(art, *a, **k))
    options = CalibrationOptions(scheme="w8", search=SearchSpace(target=1.5, alphas=(None,), fallback=False), **FAST)
    calibrate_artifact(store.artifact("llama"), tmp_path / "w8", calib_text, options)
    assert len(opened) == 1 and opened[0].resolve() != Path(store.artifact("llama")).resolve()  # the candidate alone
    report = json.loads((tmp_path / "w8" / "quality.json").read_text())
    engine = Engine.load(store.artifact("llama"), threads=1)
    windows = token_windows(engine.tokenizer, read_text_data(calib_text), FAST["seq_len"])
    held_out = split_windows(windows, FAST["seq_len"], FAST["samples"], FAST["eval_samples"]).evaluation
    fp32 = perplexity(engine.backend, held_out).perplexity
    assert report["fp32"]["perplexity"] == pytest.approx(fp32, rel=1e-3) and report["fp32"]["perplexity"] != fp32
    quantized = perplexity(Engine.load(tmp_path / "w8", threads=1).backend, held_out).perplexity
    assert report["quantized"]["perplexity"] == pytest.approx(quantized, rel=1e-5)


@pytest.mark.parametrize("broken", ["prefill", "decode"])
def test_broken_quantization_is_reported_as_a_large_perplexity_increase(broken, store, calib_text, tmp_path,
                                                                         monkeypatch):
    """Absurd weight scales in either graph (prefill alone only corrupts the KV cache decode reads)."""
    import llmx.calibration.pipeline as pipeline
    from llmx.calibration.matmuls import initializers, read_array, replace_initializer

    real = pipeline.quantize_graphs

    def absurd_scales(*args, **kwargs):
        models, weights_dir, record = real(*args, **kwargs)
        for model in [models[broken]]:
            for name, init in initializers(model).items():
                if name.endswith(".weight_scale"):  # per-channel weight scales of the Q/DQ graph
                    replace_initializer(model, name, read_array(init, weights_dir) * 100)
        return models, weights_dir, record

    monkeypatch.setattr(pipeline, "quantize_graphs", absurd_scales)
    options = CalibrationOptions(scheme="w8a8", method="minmax", **FAST)
    report = calibrate_artifact(store.artifact("llama"), tmp_path / "broken", calib_text, options).extras["quality"]
    assert report["perplexity_ratio"] > 3 and report["top1_agreement"] < 0.75 and report["mean_kl"] > 1


def test_weights_of_both_graphs_are_stored_once(quantized):
    art = quantized("w4")

    def external(graph: str) -> dict[str, tuple[str, str]]:
        model = onnx.load_model(str(art / f"{graph}.onnx"), load_external_data=False)
        return {i.name: tuple(e.value for e in i.external_data if e.key in ("offset", "length"))
                for i in model.graph.initializer if i.external_data}

    prefill, decode = external("prefill"), external("decode")
    shared = [name for name in prefill if name.endswith("_Q4")]
    assert shared and all(decode[name] == prefill[name] for name in shared)
    assert (art / "weights.bin").stat().st_size < 1.1 * sum(int(length) for _, length in decode.values())


def test_cli_calibrate_prints_the_report_and_json(store, calib_text, tmp_path, capsys):
    args = ["calibrate", str(store.artifact("llama")), "--data", str(calib_text), "--scheme", "w8", "--samples", "2",
            "--seq-len", "32", "--eval-samples", "2", "--threads", "1"]
    code, out, err = run([*args, "-o", str(tmp_path / "a")], capsys)
    assert code == 0, err
    assert "perplexity" in out and "top-1 agreement" in out and "graph size" in out and "decode" in out
    code, out, err = run([*args, "-o", str(tmp_path / "b"), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out) == json.loads((tmp_path / "b" / "quality.json").read_text())
    code, _, err = run(["inspect", str(tmp_path / "b"), "--check"], capsys)
    assert code == 0, err


@pytest.fixture(scope="module")
def contrib_ops_artifact(store, tmp_path_factory) -> Path:
    """The tiny Llama with com.microsoft ops (ONNX Runtime's own fusions) and no value_info: what
    shape inference cannot see through, as in graphs from the optimize stage."""
    from llmx.artifact.staging import finish
    from llmx.artifact.onnx_files import describe_graph, load_graph, save_graphs

    src, work = store.artifact("llama"), tmp_path_factory.mktemp("ortopt")
    out = work / "art"
    out.mkdir()
    for graph in ("prefill", "decode"):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        opts.optimized_model_filepath = str(work / f"{graph}.onnx")
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{graph}.bin")
        ort.InferenceSession(str(src / f"{graph}.onnx"), opts, providers=["CPUExecutionProvider"])
    models = {g: load_graph(work / f"{g}.onnx") for g in ("prefill", "decode")}
    for model in models.values():
        del model.graph.value_info[:]
    assert any(n.domain == "com.microsoft" for n in models["decode"].graph.node)
    save_graphs(models, out, sources={g: work for g in models})
    shutil.copytree(src / "tokenizer", out / "tokenizer")
    manifest = load_manifest(src)
    manifest.graphs = {g: describe_graph(m, f"{g}.onnx", ops="onnxruntime") for g, m in models.items()}
    finish(out, manifest)
    return out


@pytest.mark.parametrize("settings", [dict(scheme="w8a8", method="minmax", smoothquant=0.5), dict(scheme="w4")])
def test_graphs_with_contrib_ops_quantize_every_weight_matmul(settings, contrib_ops_artifact, calib_text, tmp_path):
    from llmx.calibration.matmuls import weight_matmuls

    options = CalibrationOptions(**settings, **FAST)
    manifest = calibrate_artifact(contrib_ops_artifact, tmp_path / "q", calib_text, options)
    expected = len(weight_matmuls(onnx.load_model(str(contrib_ops_artifact / "decode.onnx"), load_external_data=False)))
    for graph in ("prefill", "decode"):
        nodes = onnx.load_model(str(tmp_path / "q" / f"{graph}.onnx"), load_external_data=False).graph.node
        quantized = [n for n in nodes if n.op_type == ("QuantizeLinear" if settings["scheme"] == "w8a8" else "MatMulNBits")]
        assert len(quantized) == expected == 9
        assert manifest.graphs[graph].ops == "onnxruntime"
    assert 0.8 < manifest.extras["quality"]["perplexity_ratio"] < 1.25


@pytest.mark.slow
@pytest.mark.parametrize("settings, max_ratio", [
    (dict(scheme="w8a8", smoothquant=0.5), 1.02),
    (dict(scheme="w8"), 1.005),
    (dict(scheme="w4"), 1.05),
    (dict(scheme=None, kv_cache="int8"), 1.01),  # the int8 KV cache alone (calibration/kv_int8.py)
])
def test_real_weights_meet_the_quality_targets(settings, max_ratio, demo_artifact, tmp_path):
    """The issue's targets on a trained model: calibrated on training-set modules, graded on
    modules the model never saw (argparse and functools are in its held-out split)."""
    import functools
    import shutil as shutil_module
    import string

    calib, held_out = tmp_path / "calib", tmp_path / "heldout"
    calib.mkdir(), held_out.mkdir()
    for module in (shutil_module, string, inspect):
        (calib / f"{module.__name__}.py").write_text(inspect.getsource(module))
    for module in (argparse, functools):
        (held_out / f"{module.__name__}.py").write_text(inspect.getsource(module))
    options = CalibrationOptions(**settings, samples=16, seq_len=128, eval_samples=24, threads=1)
    report = calibrate_artifact(demo_artifact, tmp_path / "q", calib, options, eval_data=held_out).extras["quality"]
    assert report["fp32"]["perplexity"] < 60  # a trained model, not noise
    assert report["perplexity_ratio"] <= max_ratio and report["top1_agreement"] > 0.85


# -- SmoothQuant -------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["llama", "gpt2"])  # RMSNorm's Mul and LayerNormalization
def test_smoothquant_leaves_fp32_outputs_unchanged(variant, store, calib_text, tmp_path):
    from llmx.calibration.data import read_text_data, token_windows
    from llmx.calibration.feeds import Feeds, decode_feed, prefill_feed
    from llmx.calibration.pipeline import smooth_graphs
    from llmx.runtime.tokenizer import Tokenizer

    src = store.artifact(variant)
    manifest = load_manifest(src)
    windows = token_windows(Tokenizer(Artifact(src, manifest)), read_text_data(calib_text), 24)[:3]
    feeds = Feeds(Artifact(src, manifest), windows, threads=1)
    paths = {g: src / spec.file for g, spec in manifest.graphs.items()}
    work = tmp_path / "fp32"
    shutil.copytree(src, work)
    options = CalibrationOptions(scheme="w8a8", smoothquant=0.8)
    smoothed, record = smooth_graphs({g: work / p.name for g, p in paths.items()}, feeds, options, tmp_path / "smooth")
    counts = record["per_graph"]["decode"]
    assert counts["folded"] >= 1 and counts["inserted"] >= 1  # both kinds of rewrite happened
    window = windows[-1]
    prefill_out = _run(paths["prefill"], prefill_feed(window))
    feed = decode_feed(manifest, window, prefill_out[1:], 12, 4)
    for graph, inputs in (("prefill", prefill_feed(window)), ("decode", feed)):
        before, after = _run(paths[graph], inputs), _run(smoothed[graph], inputs)
        for a, b in zip(before, after):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    changed = onnx.load_model(str(smoothed["decode"]))
    original = {i.name: i for i in onnx.load_model(str(paths["decode"])).graph.initializer}
    qkv = next(i for i in changed.graph.initializer if i.name.endswith("layers.0.attn.qkv.weight"))
    assert not np.allclose(onnx.numpy_helper.to_array(qkv), onnx.numpy_helper.to_array(original[qkv.name]))


def test_smoothquant_flattens_an_activation_outlier(store, calib_text, tmp_path):
    """One input channel 30x louder than the rest sets a per-tensor INT8 range; smoothing tames it."""
    from llmx.calibration.data import read_text_data, token_windows
    from llmx.calibration.feeds import Feeds
    from llmx.calibration.matmuls import replace_initializer
    from llmx.calibration.pipeline import smooth_graphs
    from llmx.calibration.smoothquant import activation_absmax
    from llmx.runtime.tokenizer import Tokenizer

    art = tmp_path / "outlier"
    shutil.copytree(store.artifact("llama"), art)
    paths = {"prefill": art / "prefill.onnx", "decode": art / "decode.onnx"}
    for path in paths.values():  # a loud channel after the first layer's attention norm
        model = onnx.load_model(str(path), load_external_data=False)
        norm = next(i for i in model.graph.initializer if i.name.endswith("layers.0.attn_norm.weight"))
        gamma = onnx.numpy_helper.to_array(norm).copy()
        gamma[7] *= 30
        replace_initializer(model, norm.name, gamma)
        onnx.save_model(model, str(path))
    manifest = load_manifest(art)
    windows = token_windows(Tokenizer(Artifact(art, manifest)), read_text_data(calib_text), 24)[:3]
    feeds = Feeds(Artifact(art, manifest), windows, threads=1)
    before = activation_absmax(paths, feeds)
    smoothed, _ = smooth_graphs(paths, feeds, CalibrationOptions(scheme="w8a8", smoothquant=0.5), tmp_path / "s")
    after = activation_absmax(smoothed, feeds)
    weight = next(w for w in before if w.endswith("layers.0.attn.qkv.weight"))

    def peak_over_median(a: np.ndarray) -> float:
        return float(a.max() / np.median(a))

    assert peak_over_median(before[weight]) > 10
    assert peak_over_median(after[weight]) < peak_over_median(before[weight]) / 3


def _run(path: Path, feed: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


# -- TensorRT tables and Q/DQ layout ----------------------------------------------------------

def test_qdq_graph_is_what_tensorrt_reads(quantized):
    from llmx.calibration.matmuls import initializers

    art = quantized("w8a8-entropy-smoothquant")
    model = onnx.load_model(str(art / "decode.onnx"))
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}  # standard ops only
    assert load_manifest(art).graphs["decode"].ops == "portable"
    inits = initializers(model)
    zero_points = [n.input[2] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    for name in zero_points:  # symmetric INT8 everywhere: TensorRT has no zero points
        assert inits[name].data_type == onnx.TensorProto.INT8 and not onnx.numpy_helper.to_array(inits[name]).any()
    weight_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert weight_dq and all(onnx.helper.get_attribute_value(a) == 1 for n in weight_dq for a in n.attribute
                             if a.name == "axis")
    assert all(inits[n.input[1]].dims[0] > 1 for n in weight_dq)  # per output channel
    quantized_outputs = {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    assert not quantized_outputs & {n.output[0] for n in model.graph.node if n.op_type == "MatMul"}


def test_llmx_build_plans_int8_from_the_calibrated_qdq_graphs(quantized, capsys):
    """The calibrate -> build contract: a w8a8 artifact builds INT8 engines from its Q/DQ nodes,
    and is not mistaken for an artifact that already has engines."""
    from llmx.cli import main
    from llmx.engine.tensorrt import plan_build

    art = quantized("w8a8-entropy-smoothquant")
    plan = plan_build(art)
    assert (plan.precision, plan.int8_source, plan.strongly_typed) == ("int8", "qdq", True)
    assert "tensorrt" not in load_manifest(art).extras  # that key is `llmx build`'s engine record
    with pytest.raises(SystemExit):
        main(["generate", str(art), "x", "--backend", "tensorrt"])
    err = capsys.readouterr().err
    assert "has no TensorRT engines" in err


def test_tensorrt_tables_hold_the_qdq_scales(quantized):
    from onnxruntime.quantization.CalTableFlatBuffers.TrtTable import TrtTable

    from llmx.calibration.static import activation_scales
    from llmx.calibration.tensorrt_cache import read_trt_cache

    art = quantized("w8a8-entropy-smoothquant")
    manifest = load_manifest(art)
    for graph in ("prefill", "decode"):
        folder = art / "tensorrt" / graph
        assert sorted(manifest.extras["calibration"]["tensorrt_tables"][graph]) == sorted(
            f"tensorrt/{graph}/{f.name}" for f in folder.iterdir())
        scales = activation_scales(onnx.load_model(str(art / f"{graph}.onnx"), load_external_data=False), art)
        header, cached = read_trt_cache((folder / "trt10.cache").read_text())
        assert header == "TRT-100000-EntropyCalibration2"
        assert cached.keys() == scales.keys() and len(scales) == 9  # 4 MatMul inputs x 2 layers + lm_head
        for name, scale in scales.items():
            assert cached[name] == pytest.approx(scale, rel=1e-7)
        table = json.loads((folder / "calibration.json").read_text())
        assert table.keys() == scales.keys()
        for name, scale in scales.items():
            assert table[name]["highest"]["data"] == pytest.approx(127 * scale, rel=1e-6)
        flat = TrtTable.GetRootAsTrtTable((folder / "calibration.flatbuffers").read_bytes(), 0)
        keys = {flat.Dict(i).Key().decode() for i in range(flat.DictLength())}
        assert keys == scales.keys()


# -- decode calibrated on real KV --------------------------------------------------------------

def test_decode_feeds_carry_the_real_prefill_cache(store, calib_text):
    from llmx.calibration.data import read_text_data, token_windows
    from llmx.calibration.feeds import Feeds, decode_splits, prefill_feed
    from llmx.runtime.tokenizer import Tokenizer

    src = store.artifact("llama")
    manifest = load_manifest(src)
    windows = token_windows(Tokenizer(Artifact(src, manifest)), read_text_data(calib_text), 32)[:2]
    feeds = list(Feeds(Artifact(src, manifest), windows, threads=1)("decode"))
    splits = decode_splits(32)
    assert len(feeds) == 2 * len(splits) and any(t == 1 for _, t in splits) and any(t > 1 for _, t in splits)
    presents = _run(src / "prefill.onnx", prefill_feed(windows[1]))[1:]
    for feed, (start, count) in zip(feeds[len(splits):], splits):
        assert feed["input_ids"].tolist() == [windows[1][start : start + count]]
        assert feed["position_ids"][0, 0] == start and feed["attention_mask"].shape == (1, start + count)
        past = feed["past_key_values.1.value"]
        np.testing.assert_array_equal(past[:, :, :start], presents[3][:, :, :start])
        assert np.abs(past[:, :, :start]).min() > 0 or start == 0  # real entries, not zeros


# -- bad input ----------------------------------------------------------------------------------

def _bad_inputs(tmp: Path, text: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty.txt").write_text("  \n")
    (tmp / "tiny.txt").write_text("x = 1\n")
    (tmp / "latin1.txt").write_bytes("caf\xe9 = 'd\xe9j\xe0 vu'\n".encode("latin-1"))
    (tmp / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    (tmp / "folder").mkdir()
    (tmp / "folder" / "a.py").write_text(text.read_text())
    (tmp / "folder" / "b.bin").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    return {
        "empty": (["--data", str(tmp / "empty.txt"), "--scheme", "w8"], "is empty"),
        "tiny": (["--data", str(tmp / "tiny.txt"), "--scheme", "w8"], "need at least 2"),
        "non-utf8": (["--data", str(tmp / "latin1.txt"), "--scheme", "w8"], "not UTF-8"),
        "non-utf8-in-folder": (["--data", str(tmp / "folder"), "--scheme", "w8"], "b.bin is not UTF-8"),
        "jsonl": (["--data", str(tmp / "bad.jsonl"), "--scheme", "w8"], 'bad.jsonl:2 has no string "text"'),
        "missing": (["--data", str(tmp / "nope.txt"), "--scheme", "w8"], "does not exist"),
        "scheme": (["--data", str(text), "--scheme", "w3"], "scheme must be one of w8a8, w8, w4"),
        "method": (["--data", str(text), "--scheme", "w8a8", "--method", "kl"], "method must be one of"),
        "block": (["--data", str(text), "--scheme", "w4", "--block-size", "48"], "power of two"),
        "block-word": (["--data", str(text), "--scheme", "w4", "--block-size", "big"], "power of two >= 16 or 'auto'"),
        "alpha": (["--data", str(text), "--scheme", "w8a8", "--smoothquant", "1.5"], "alpha must be in [0, 1]"),
        "sq-and-awq": (["--data", str(text), "--scheme", "w4", "--smoothquant", "0.5", "--awq"], "--smoothquant and --awq"),
        "seq-len": (["--data", str(text), "--scheme", "w8", "--seq-len", "4096"], "maximum length"),
        "eval-data": (["--data", str(text), "--eval-data", str(tmp / "tiny.txt"), "--scheme", "w8"], "--eval-data gives no window"),
    }


@pytest.mark.parametrize("case", ["empty", "tiny", "non-utf8", "non-utf8-in-folder", "jsonl", "missing", "scheme",
                                  "method", "block", "block-word", "alpha", "sq-and-awq", "seq-len", "eval-data"])
def test_bad_input_is_one_clear_error_and_nothing_written(case, store, calib_text, tmp_path, capsys):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    args, words = _bad_inputs(inputs, calib_text)[case]
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    code, out, err = run(["calibrate", str(store.artifact("llama")), "--seq-len", "32", "-o", str(out_parent / "art"),
                          *args], capsys)
    assert code != 0 and words in error_line(err), err
    assert leftovers(out_parent) == [] and out == ""


def test_already_quantized_artifact_is_refused(quantized, calib_text, tmp_path, capsys):
    code, _, err = run(["calibrate", str(quantized("w4")), "--data", str(calib_text), "--scheme", "w8",
                        "-o", str(tmp_path / "again")], capsys)
    assert code != 0 and "already quantized (w4)" in error_line(err)
    assert leftovers(tmp_path) == []


def test_a_calibration_that_cannot_fit_is_refused_naming_the_streaming_export(store, calib_text, tmp_path, capsys,
                                                                              monkeypatch):
    """Checked before anything is read: the memory it needs against MemAvailable, one line, and
    for a weight-only scheme the export that streams the same blocks instead."""
    from llmx import memory_budget

    artifact = store.artifact("llama")  # built before the machine "runs out"
    monkeypatch.setattr(memory_budget, "available_memory", lambda: 1 << 20)
    code, _, err = run(["calibrate", str(artifact), "--data", str(calib_text), "--scheme", "w4",
                        "--no-search", "-o", str(tmp_path / "q")], capsys)
    line = error_line(err)
    assert code != 0 and "of memory, 0.0 GiB available" in line and "--precision w4" in line
    assert leftovers(tmp_path) == []
