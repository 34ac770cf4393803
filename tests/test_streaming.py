"""Streaming export (export/streaming.py, export/fused.py, export/onnx_export.py): weights from the
memory-mapped checkpoint one tensor at a time, portable graphs traced on fake weights, fused graphs
written directly, w8/w4 quantized on the way.

Each is held to the path it shortcuts: the streamed weights are bit for bit what the torch
loader makes (every family); the default (portable) export is the trace of the loaded model (the
same nodes, initializers bit for bit; tests/test_parity.py holds every family's streamed artifact
to transformers); ``export --graphs fused`` is ``export`` + ``optimize`` (same IO and manifest
sections, logits within 1e-5 over prefill and 16 decode steps, greedy identical);
``export --precision w8|w4`` is ``calibrate --no-search`` on that (identical MatMulNBits
weights, scales and nodes).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from conftest import VARIANTS
from llmx.artifact.manifest import load_manifest
from llmx.export import checkpoint as checkpoint_module
from llmx.export.checkpoint import load_model, map_weights, open_checkpoint, read_state_dict
from llmx.export.onnx_export import GRAPHS, export_decoder
from llmx.export.streaming import stream_weights
from llmx.export.tensors import CheckpointTensors
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams
from llmx.weight_names import graph_name
from test_cli import error_line, leftovers, run
from test_optimize import steps
from test_parity import PROMPTS

PORTABLE_TOL = 1e-5  # fused against fused: same kernels, same weights
GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fused(store):
    """variant -> `llmx export --graphs fused` of its checkpoint (streamed weights, fp32)."""
    return lambda variant: store.once(f"fused/{variant}", lambda path: _export(store.checkpoint(variant), path, "--graphs", "fused"))


def _export(checkpoint, out, *flags) -> None:
    from llmx.cli import main

    try:
        main(["export", str(checkpoint), "-o", str(out), *flags])
    except SystemExit as exc:
        assert not exc.code, f"export {' '.join(flags)} failed"


def _streamed_arrays(spec, files, tmp_path) -> dict[str, np.ndarray]:
    weights = stream_weights(spec, CheckpointTensors(files), tmp_path)
    return {name: numpy_helper.to_array(t, base_dir=str(tmp_path)) for name, t in weights.tensors.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_streamed_weights_are_the_loaders_bit_for_bit(variant, store, tmp_path):
    checkpoint = open_checkpoint(store.checkpoint(variant))
    expected = map_weights(checkpoint.spec, read_state_dict(checkpoint.weight_files))
    streamed = _streamed_arrays(checkpoint.spec, checkpoint.weight_files, tmp_path)
    assert list(streamed) == [graph_name(name) for name in expected]
    for name, tensor in expected.items():
        np.testing.assert_array_equal(streamed[graph_name(name)], tensor.numpy(), err_msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharded_half_precision_checkpoint_streams_as_loaded(dtype, store, tmp_path):
    """An index over several shards, in bf16/fp16: the same fp32 conversions as the torch loader."""
    from safetensors.torch import save_file

    src = store.checkpoint("qwen2")
    ckpt = tmp_path / "sharded"
    shutil.copytree(src, ckpt, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {k: v.to(dtype) for k, v in read_state_dict(open_checkpoint(src).weight_files).items()}
    names = sorted(tensors)
    shards = {f"model-{i + 1:05d}-of-00003.safetensors": names[i::3] for i in range(3)}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(ckpt / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    checkpoint = open_checkpoint(ckpt)
    assert len(checkpoint.weight_files) == 3
    expected = map_weights(checkpoint.spec, tensors)
    streamed = _streamed_arrays(checkpoint.spec, checkpoint.weight_files, tmp_path)
    for name, tensor in expected.items():
        np.testing.assert_array_equal(streamed[graph_name(name)], tensor.numpy(), err_msg=name)


def _graph(artifact, graph: str) -> list[tuple]:
    model = onnx.load_model(str(artifact / f"{graph}.onnx"), load_external_data=False)
    return [(n.op_type, list(n.input), list(n.output), [onnx.helper.get_attribute_value(a) for a in n.attribute])
            for n in model.graph.node]


# Norms of ones (merged by the exporter), folded Gemma norms and soft-caps, learned positions,
# LongRoPE's two buffers, MoE experts: the cases where a trace could differ from the loaded one's.
TRACED = ["llama", "gemma2", "gpt2", "phi3", "qwen3_moe-dense-layer"]


@pytest.mark.parametrize("variant", TRACED)
def test_portable_export_is_the_loaded_models_trace(variant, store, tmp_path):
    """The default export (weights streamed, graphs traced on fake weights) writes what tracing
    the loaded fp32 model writes: the same nodes and the same initializers, bit for bit."""
    export_decoder(load_model(open_checkpoint(store.checkpoint(variant))), tmp_path)
    ours = store.artifact(variant)
    for graph in GRAPHS:
        assert _graph(ours, graph) == _graph(tmp_path, graph), graph
        a, b = _initializers(ours, graph), _initializers(tmp_path, graph)
        assert sorted(a) == sorted(b), graph
        for name in a:
            assert a[name].dtype == b[name].dtype, name
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_portable_export_never_loads_the_model_but_verify_does(store, tmp_path, capsys, monkeypatch):
    loads = []
    monkeypatch.setattr(checkpoint_module, "read_state_dict", lambda files: loads.append(files) or read_state_dict(files))
    code, _, err = run(["export", str(store.checkpoint("llama")), "-o", str(tmp_path / "a")], capsys)
    assert code == 0, err
    assert loads == [] and "streaming llama weights" in err
    code, _, err = run(["export", str(store.checkpoint("llama")), "-o", str(tmp_path / "b"), "--verify"], capsys)
    assert code == 0, err
    assert len(loads) == 1 and "loading llama weights" in err and "verified: max |diff|" in err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_export_is_export_then_optimize(variant, fused, store):
    """Same IO and manifest sections; logits within 1e-5 over prefill and 16 decode steps; greedy identical."""
    ours, theirs = load_manifest(fused(variant)), load_manifest(store.optimized(variant))
    for section in ("kind", "model", "graphs", "tokenizer", "precision", "kv"):
        assert getattr(ours, section) == getattr(theirs, section), section
    assert ours.stage_applied("export").details["graphs"] == "fused"
    a, b = Engine.load(fused(variant), threads=1), Engine.load(store.optimized(variant), threads=1)
    for prompt in PROMPTS:
        (ours_logits, ours_tokens), (their_logits, their_tokens) = (
            steps(e.backend, e.encode(prompt), 16) for e in (a, b))
        assert ours_tokens == their_tokens
        assert max(np.abs(x - y).max() for x, y in zip(ours_logits, their_logits)) <= PORTABLE_TOL
    greedy = [e.generate(PROMPTS, GREEDY) for e in (a, b)]
    assert [r.output_ids for r in greedy[0]] == [r.output_ids for r in greedy[1]]


def _tables(artifact, graph: str, checkpoint) -> list[onnx.TensorProto]:
    """The graph's float initializers shaped like the token table, either way round."""
    config = json.loads((checkpoint / "config.json").read_text())
    shape = sorted([config["vocab_size"], config.get("hidden_size") or config["n_embd"]])
    model = onnx.load_model(str(artifact / f"{graph}.onnx"), load_external_data=False)
    return [t for t in model.graph.initializer if sorted(t.dims) == shape and t.data_type == onnx.TensorProto.FLOAT]


@pytest.mark.parametrize("variant,copies", [("llama-tied-llama3rope-bias", 1), ("gemma", 1), ("gpt2", 1),
                                            ("granite", 2), ("llama", 2)])
def test_a_tied_fp32_table_is_stored_once_as_the_head(variant, copies, fused, store):
    """The lookup gathers the tied head's columns (Gemma's sqrt(hidden) multiplied after it), so
    the largest tensor is written once; exactness against the optimized graphs, which keep two
    tables, is test_fused_export_is_export_then_optimize's. Granite folds its logit scale into the
    head, which then no longer holds the table; an untied llama has two."""
    for artifact in (fused(variant), store.optimized(variant)):  # `llmx optimize` checks rows, then shares too
        for graph in GRAPHS:
            assert len(_tables(artifact, graph, store.checkpoint(variant))) == copies, (artifact, graph)


def test_optimize_keeps_a_table_that_is_not_the_head(store, tmp_path):
    """`llmx optimize` shares a tied table only where the portable artifact's two copies agree (exactly,
    on rows spread over the vocabulary): one changed row keeps both."""
    from llmx.optimize.fuse import optimize_artifact

    variant = "llama-tied-llama3rope-bias"
    portable = tmp_path / "portable"
    shutil.copytree(store.artifact(variant), portable)
    (table,) = [t for t in _tables(portable, "decode", store.checkpoint(variant)) if t.dims[0] > t.dims[1]]
    info = {e.key: e.value for e in table.external_data}
    values = np.memmap(portable / info["location"], np.float32, "r+", int(info["offset"]), tuple(table.dims))
    values[0] += 1.0
    values.flush()
    del values
    optimize_artifact(portable, tmp_path / "opt")
    assert len(_tables(tmp_path / "opt", "decode", store.checkpoint(variant))) == 2


def _lookup_rows(artifact, graph: str, ids: np.ndarray) -> tuple[np.ndarray, set[str]]:
    """What the graph's token lookup gives for ``ids`` (the subgraph from input_ids to the first
    layer's input), and the op types it runs."""
    import onnxruntime as ort

    from llmx.runtime.rebuilt_weights import _producers

    model = onnx.load_model(str(artifact / f"{graph}.onnx"))
    norm = next(n for n in model.graph.node if n.op_type.endswith("LayerNormalization"))
    part = _producers(model, [norm.input[0]])
    used = {i for n in part for i in n.input}
    graph_ = onnx.helper.make_graph(
        part, "lookup", [onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, None)],
        [onnx.helper.make_tensor_value_info(norm.input[0], onnx.TensorProto.FLOAT, None)],
        [t for t in model.graph.initializer if t.name in used])
    lookup = onnx.helper.make_model(graph_, opset_imports=model.opset_import, ir_version=model.ir_version)
    session = ort.InferenceSession(lookup.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0], {n.op_type for n in part}


@pytest.mark.parametrize("flags,from_blocks", [(["--scheme", "w4", "--awq"], True),
                                               (["--scheme", "w8a8", "--smoothquant", "0.8"], False)])
def test_calibrating_a_tied_head_keeps_its_lookup_the_table(flags, from_blocks, fused, store, calib_text, tmp_path, capsys):
    """AWQ and SmoothQuant scale the head's rows by s and the quantizers replace it. The lookup gets
    its own copy first (calibration/matmuls.py untie_weights); w8/w4 then point it at the head's
    blocks divided by s (calibration/weight_only.py lookups_from_blocks), w8a8 keeps the exported
    fp32 table bit for bit. Either way it looks up the table, not the rescaled head."""
    variant = "llama-tied-llama3rope-bias"
    source, out = fused(variant), tmp_path / "calibrated"
    code, _, err = run(["calibrate", str(source), "--data", str(calib_text), *flags, "--no-search",
                        "--samples", "2", "--seq-len", "32", "--eval-samples", "2", "--threads", "1",
                        "-o", str(out)], capsys)
    assert code == 0, err
    (head,) = _tables(source, "decode", store.checkpoint(variant))
    table = numpy_helper.to_array(head, base_dir=str(source)).T
    ids = np.array([[0, 5, 17, 250, 319]])
    for graph in GRAPHS:
        rows, ops = _lookup_rows(out, graph, ids)
        if from_blocks:
            assert "MatMul" not in ops and not _tables(out, graph, store.checkpoint(variant))  # no fp32 table left
            error = np.sqrt(((rows - table[ids]) ** 2).mean() / (table[ids] ** 2).mean())
            assert error < 0.1, error  # the head's 4-bit rounding (0.17 with the rescaled rows undivided)
        else:
            np.testing.assert_array_equal(rows, table[ids])


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory):
    import argparse
    import inspect

    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(inspect.getsource(argparse))
    return path


def _initializers(artifact, graph: str) -> dict[str, np.ndarray]:
    model = onnx.load_model(str(artifact / f"{graph}.onnx"))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _nodes(artifact, graph: str) -> list[tuple]:
    """The MatMulNBits nodes by what they read and do (activation and node names are the
    builder's: a lookup from blocks adds nodes before them)."""
    model = onnx.load_model(str(artifact / f"{graph}.onnx"), load_external_data=False)
    return [(n.op_type, list(n.input[1:]), [onnx.helper.get_attribute_value(a) for a in n.attribute])
            for n in model.graph.node if n.op_type == "MatMulNBits"]


@pytest.mark.parametrize("variant,scheme,block", [("llama", "w4", "32"), ("llama", "w8", "16"),
                                                  ("qwen3_moe-dense-layer", "w4", "32"),
                                                  ("llama-tied-llama3rope-bias", "w4", "32"), ("gemma", "w8", "16")])
def test_quantized_export_is_calibrate_no_search(variant, scheme, block, store, calib_text, tmp_path, capsys):
    """Identical MatMulNBits nodes, blocks and scales; the same precision section; the same logits.
    A tied table is looked up from the head's blocks by both (no float table is stored)."""
    ours = tmp_path / "streamed"
    code, _, err = run(["export", str(store.checkpoint(variant)), "-o", str(ours), "--precision", scheme,
                        "--block-size", block], capsys)
    assert code == 0, err
    theirs = tmp_path / "calibrated"
    code, _, err = run(["calibrate", str(store.optimized(variant)), "--data", str(calib_text), "--scheme", scheme,
                        "--no-search", "--block-size", block, "--samples", "2", "--seq-len", "32",
                        "--eval-samples", "2", "--threads", "1", "-o", str(theirs)], capsys)
    assert code == 0, err
    for graph in ("prefill", "decode"):
        nodes = _nodes(ours, graph)
        assert nodes and nodes == _nodes(theirs, graph)
        a, b = _initializers(ours, graph), _initializers(theirs, graph)
        quantized = {name for _, inputs, _ in nodes for name in inputs}
        for name in quantized:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    tied = json.loads((store.checkpoint(variant) / "config.json").read_text()).get("tie_word_embeddings", False)
    for artifact in (ours, theirs):
        assert len(_tables(artifact, "decode", store.checkpoint(variant))) == (0 if tied else 1)
    m_ours, m_theirs = load_manifest(ours), load_manifest(theirs)
    assert m_ours.precision == type(m_theirs.precision)(**{**m_theirs.precision.__dict__, "data": None})
    assert m_ours.graphs == m_theirs.graphs
    assert "no quality report" in m_ours.stage_applied("export").details["quantized"]
    a, b = Engine.load(ours, threads=1), Engine.load(theirs, threads=1)
    (ours_logits, ours_tokens), (their_logits, their_tokens) = (steps(e.backend, e.encode(PROMPTS[0]), 8) for e in (a, b))
    assert ours_tokens == their_tokens
    assert max(np.abs(x - y).max() for x, y in zip(ours_logits, their_logits)) <= PORTABLE_TOL


@pytest.fixture(scope="module")
def half(store):
    """precision -> `llmx export --precision fp16|bf16` of the llama checkpoint."""
    return lambda precision: store.once(f"half/{precision}", lambda path: _export(store.checkpoint("llama"), path,
                                                                                 "--precision", precision))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_export_is_builds_lowering_of_the_fp32_export(precision, half, store, capsys):
    """``export --precision fp16|bf16`` writes what ``llmx build`` lowers the fp32 artifact to
    (llmx/low_precision.py): the same nodes, the same initializers bit for bit, the same
    manifest sections, with the weights streamed lowered (weights.bin about half the fp32 one's)."""
    from llmx.artifact.onnx_files import load_graph
    from llmx.low_precision import convert_graph

    dtype = {"fp16": "float16", "bf16": "bfloat16"}[precision]
    low, fp32 = half(precision), store.artifact("llama")
    for graph in GRAPHS:
        expected = convert_graph(onnx.load_model(str(fp32 / f"{graph}.onnx")), dtype)
        ours = load_graph(low / f"{graph}.onnx")
        assert [(n.op_type, list(n.input), list(n.output)) for n in ours.graph.node] == \
               [(n.op_type, list(n.input), list(n.output)) for n in expected.graph.node], graph
        a = _initializers(low, graph)
        b = {t.name: numpy_helper.to_array(t) for t in expected.graph.initializer}
        assert sorted(a) == sorted(b), graph
        for name in a:
            assert a[name].dtype == b[name].dtype, name
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    manifest = load_manifest(low)
    assert manifest.kv.dtype == dtype and manifest.precision.weights == dtype
    assert manifest.stage_applied("export").details["precision"] == precision
    size = lambda art: (art / "weights.bin").stat().st_size  # noqa: E731
    assert 0.45 < size(low) / size(fp32) < 0.55
    if precision == "bf16":  # ONNX Runtime's CPU provider has no bf16 kernels: said before it tries
        code, _, err = run(["generate", str(low), "hi", "--max-new-tokens", "2"], capsys)
        assert code != 0 and "no kernels for" in error_line(err) and "ort-cuda" in error_line(err)


def test_fp16_export_runs_on_cpu_close_to_fp32(half, store):
    """ONNX Runtime's CPU provider computes fp16 graphs in fp32 (it inserts the casts): the
    artifact runs, and its logits stay within fp16 rounding of the fp32 artifact's."""
    a, b = Engine.load(half("fp16"), threads=1), Engine.load(store.artifact("llama"), threads=1)
    (low, _), (full, _) = (steps(e.backend, e.encode(PROMPTS[0]), 4) for e in (a, b))
    scale = max(np.abs(x).max() for x in full)
    assert max(np.abs(x - y).max() for x, y in zip(low, full)) <= 2e-2 * scale


@pytest.mark.parametrize("flags,says", [
    (["--precision", "fp8"], "fp32, fp16, bf16, w8, w4"),
    (["--precision", "fp16", "--graphs", "fused"], "--graphs portable"),
    (["--precision", "bf16", "--verify"], "export fp32 to verify"),
    (["--precision", "w4", "--graphs", "portable"], "--graphs fused"),
    (["--precision", "w4", "--block-size", "24"], "power of two"),
    (["--graphs", "fused", "--verify"], "never loads"),
])
def test_unsupported_options_are_one_error_line(flags, says, store, tmp_path, capsys):
    code, _, err = run(["export", str(store.checkpoint("llama")), "-o", str(tmp_path / "out"), *flags], capsys)
    assert code == 2 and says in error_line(err)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_estimate_sees_the_shapes_the_export_streams(variant, store):
    """The memory estimate runs the weight rules on header shapes (no torch op, no dynamo import)."""
    from llmx.export.checkpoint import iter_weights
    from llmx.export.memory import weight_shapes
    from llmx.export.tensors import CheckpointTensors

    checkpoint = open_checkpoint(store.checkpoint(variant))
    streamed = [(role, tensor.numel()) for role, _, tensor in iter_weights(checkpoint.spec,
                                                                          CheckpointTensors(checkpoint.weight_files))]
    estimated = weight_shapes(checkpoint)
    assert [(role, n) for role, n, _ in estimated] == streamed
    assert all(source > 0 for _, _, source in estimated)


def test_an_export_that_cannot_fit_is_refused_with_the_numbers_and_a_flag_that_fits(store, tmp_path, capsys,
                                                                                    monkeypatch):
    """Refused before it starts, naming what it needs, what there is and the flags that would fit."""
    from llmx import memory_budget
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.memory import export_need, weight_shapes

    checkpoint = open_checkpoint(store.checkpoint("llama"))
    shapes = weight_shapes(checkpoint)
    need = {p: export_need(checkpoint, shapes, "fused", p, 32) for p in ("fp32", "w8", "w4")}
    assert need["w4"].disk < need["w8"].disk < need["fp32"].disk
    portable = export_need(checkpoint, shapes, "portable", "fp32", 32)
    assert portable.memory < export_need(checkpoint, shapes, "portable", "fp32", 32, verify=True).memory
    assert portable.disk == sum(4 * n for _, n, _ in shapes)

    def export(name, *flags):
        code, _, err = run(["export", str(store.checkpoint("llama")), "-o", str(tmp_path / name), *flags], capsys)
        return code, error_line(err) if code else err

    monkeypatch.setattr(memory_budget, "available_memory", lambda: need["fp32"].memory)
    code, line = export("a")
    assert code == 1 and "of memory" in line and "available" in line and "--graphs fused would fit" in line
    monkeypatch.setattr(memory_budget, "free_disk", lambda path: need["w4"].disk)
    code, line = export("b", "--graphs", "fused")
    assert code == 1 and "of disk" in line and "free" in line and "--precision w4 would fit" in line
    assert leftovers(tmp_path) == []
    assert export("c", "--precision", "w4")[0] == 0
    monkeypatch.setattr(memory_budget, "free_disk", lambda path: 0)
    code, line = export("d", "--precision", "w4")
    assert code == 1 and "no option of this command fits" in line


def test_an_artifact_too_big_to_load_is_refused_before_onnx_runtime_starts(store, capsys, monkeypatch):
    """The sessions' own allocations (packed weights; fp32 copies of an fp16 artifact) against
    MemAvailable: one line with the numbers and what would fit, before any session is made."""
    from llmx import memory_budget
    from llmx.artifact.handle import Artifact
    from llmx.runtime.load_memory import load_need

    artifact = Artifact.open(store.artifact("llama"))
    need, lean = load_need(artifact, low_memory=False), load_need(artifact, low_memory=True)
    assert lean < need
    monkeypatch.setattr(memory_budget, "available_memory", lambda: lean)
    code, _, err = run(["generate", str(store.artifact("llama")), "hi", "--max-new-tokens", "2"], capsys)
    assert code != 0 and "of memory beyond its mapped weights" in error_line(err) and "--low-memory would fit" in error_line(err)
    code, _, err = run(["generate", str(store.artifact("llama")), "hi", "--max-new-tokens", "2", "--low-memory"], capsys)
    assert code == 0, err


def test_declaring_the_weights_never_imports_dynamo(store):
    """The fused export's start: building the Decoder on meta parameters (their shapes) skips the
    modules' initialisers, whose meta kernels would import torch._dynamo (~2 s) for nothing."""
    import subprocess
    import sys

    code = ("import sys; from llmx.export.checkpoint import open_checkpoint; "
            "from llmx.export.streaming import declared_shapes; "
            f"shapes = declared_shapes(open_checkpoint({str(store.checkpoint('llama'))!r}).spec); "
            "print(len(shapes), 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 0 and out[1] == "False"
