"""The decode graph's ``logits_to_keep`` input (llmx/logits_to_keep.py): the LM head runs on the
kept positions only, the default keeps them all, the runtime feeds 1 where it reads the last
position only, and artifacts whose decode graph lacks the input still run."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from llmx import logits_to_keep
from llmx.artifact import Artifact
from llmx.artifact.manifest import load_manifest
from llmx.artifact.onnx_files import describe_graph
from llmx.runtime.chunked_prefill import ChunkedPrefill
from llmx.runtime.engine import Engine
from llmx.runtime.generate import generate
from llmx.runtime.onnx_backend import OrtBackend
from llmx.runtime.sampling import SamplingParams
from llmx.runtime.sequence import Sequence

VARIANTS = ("llama", "gemma2")  # gemma2: final soft-cap after the LM head
PROMPT = [1, 17, 42, 99, 7, 230, 5, 64, 12, 3]


@pytest.fixture(scope="module")
def artifacts(store):
    """(variant, kind) -> artifact: the exported (portable) one and its `llmx optimize` output."""
    out = {}
    for variant in VARIANTS:
        out[variant, "portable"] = store.artifact(variant)
        out[variant, "optimized"] = store.optimized(variant)
    return out


def run_decode(artifact, ids: list[int], keep: int | None) -> np.ndarray:
    """One decode call of ``ids`` after an empty past, straight on ONNX Runtime; logits [1, kept, V]."""
    manifest = load_manifest(artifact)
    kv, t = manifest.kv, len(ids)
    session = ort.InferenceSession(str(artifact / "decode.onnx"), providers=["CPUExecutionProvider"])
    feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, t), np.int64),
            "position_ids": np.arange(t, dtype=np.int64)[None]}
    for name in kv.past_names():
        feed[name] = np.zeros((1, kv.num_kv_heads, t, kv.head_dim), np.float32)
    if keep is not None:
        feed[logits_to_keep.NAME] = np.array(keep, np.int64)
    return session.run(["logits"], feed)[0]


@pytest.mark.parametrize("kind", ["portable", "optimized"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_kept_logits_are_the_last_rows_of_all_logits(variant, kind, artifacts):
    artifact = artifacts[variant, kind]
    graph = load_manifest(artifact).graphs["decode"]
    assert graph.input(logits_to_keep.NAME).shape == []
    assert graph.output("logits").shape[1] == logits_to_keep.KEPT_AXIS
    every = run_decode(artifact, PROMPT, None)  # not fed: the initializer's 0
    assert every.shape[:2] == (1, len(PROMPT))
    np.testing.assert_array_equal(run_decode(artifact, PROMPT, 0), every)
    for keep in (1, 3):
        kept = run_decode(artifact, PROMPT, keep)
        assert kept.shape == (1, keep, every.shape[-1])
        np.testing.assert_allclose(kept, every[:, -keep:], rtol=1e-5, atol=1e-5)
    assert run_decode(artifact, PROMPT, 50).shape == every.shape  # more than T: all of them


def test_portable_graph_slices_before_the_lm_head(artifacts):
    """The saving is real: the LM head's MatMul reads the sliced hidden states."""
    graph = onnx.load(str(artifacts["llama", "portable"] / "decode.onnx"), load_external_data=False).graph
    head = next(n for n in graph.node if n.op_type == "MatMul" and n.input[1] == "model.lm_head.weight")
    producer = next(n for n in graph.node if head.input[0] in n.output)
    assert producer.op_type == "Slice"


def host_values(graph) -> set[str]:
    """What ONNX Runtime's CUDA provider computes on the host (its CPU fallback for shape math):
    Shape outputs, and the outputs of nodes that read one of those and otherwise only host
    values, initializers or graph inputs (onnxruntime/core/framework/fallback_cpu_capability.cc)."""
    host = {o for n in graph.node if n.op_type == "Shape" for o in n.output}
    fixed = {i.name for i in graph.initializer} | {i.name for i in graph.input}
    for node in graph.node:  # topologically sorted
        inputs = [x for x in node.input if x]
        if node.op_type != "Shape" and any(x in host for x in inputs) and all(x in host or x in fixed for x in inputs):
            host.update(node.output)
    return host


@pytest.mark.parametrize("kind", ["portable", "optimized"])
def test_the_slice_start_stays_on_the_host_so_cuda_graphs_can_capture_the_step(kind, artifacts):
    """A start computed on the GPU is copied to the host every step, and ONNX Runtime refuses to
    capture a step with a copy in it (seen on an H100: every portable decode graph was refused)."""
    graph = onnx.load(str(artifacts["llama", kind] / "decode.onnx"), load_external_data=False).graph
    start = next(n.output[0] for n in graph.node if logits_to_keep.NAME in n.input)
    kept = next(n for n in graph.node if n.op_type == "Slice" and n.input[1] == start)
    assert kept.input[1] in host_values(graph)


@pytest.mark.parametrize("kind", ["portable", "optimized"])
def test_single_prompt_prefill_keeps_only_the_last_position(kind, artifacts):
    artifact = artifacts["llama", kind]
    backend = OrtBackend(Artifact.open(artifact), threads=1, lazy_prefill=True)
    assert backend.keeps_logits
    cache = backend.new_cache(1, len(PROMPT))
    last = backend.prefill(cache, [0], [PROMPT]).copy()
    assert backend._logits.shape == (1, 1, backend.vocab_size)  # the bound output buffer
    np.testing.assert_allclose(last[0], run_decode(artifact, PROMPT, None)[0, -1], rtol=1e-5, atol=1e-5)
    # A later all-positions call (speculative verification) gets every position again.
    ids = np.array([[5, 6, 7]], np.int64)
    assert backend.decode(cache, ids).shape == (1, 3, backend.vocab_size)


def test_chunked_prefill_feeds_one_and_matches_whole_prefill(artifacts):
    engine = Engine.load(artifacts["llama", "portable"], threads=1)
    backend = engine.backend
    chunked = ChunkedPrefill(backend, Sequence(PROMPT, SamplingParams(), engine.tokenizer, 64), chunk=4)
    while not chunked.finished:
        chunked.step()
        if chunked.done > 4:  # continuation chunks run on the decode graph
            assert backend._logits.shape == (1, 1, backend.vocab_size)
    whole = backend.prefill(backend.new_cache(1, len(PROMPT)), [0], [PROMPT])[0]
    np.testing.assert_allclose(chunked.logits, whole, rtol=1e-4, atol=1e-4)


def strip_logits_to_keep(model: onnx.ModelProto) -> None:
    """Turn a decode graph back into one exported before the input existed."""
    graph = model.graph
    added = [n for n in graph.node if any(o.startswith(f"{logits_to_keep.NAME}/") or o.startswith("kept_") for o in n.output)]
    slice_node = next(n for n in added if n.op_type == "Slice")
    for node in graph.node:
        node.input[:] = [slice_node.input[0] if i == slice_node.output[0] else i for i in node.input]
    for node in added:
        graph.node.remove(node)
    for field in (graph.input, graph.initializer):
        field.remove(next(v for v in field if v.name == logits_to_keep.NAME))
    for constant in [t for t in graph.initializer if t.name.startswith(slice_node.output[0] + "/")]:
        graph.initializer.remove(constant)
    next(o for o in graph.output if o.name == "logits").type.tensor_type.shape.dim[1].dim_param = "new_tokens"


@pytest.mark.parametrize("kind", ["portable", "optimized"])
def test_artifact_without_the_input_generates_the_same_tokens(kind, artifacts, tmp_path):
    source = artifacts["llama", kind]
    old = tmp_path / "old"
    shutil.copytree(source, old)
    model = onnx.load(str(old / "decode.onnx"), load_external_data=False)
    strip_logits_to_keep(model)
    onnx.save(model, str(old / "decode.onnx"))
    manifest = load_manifest(old)
    manifest.graphs["decode"] = describe_graph(model, "decode.onnx", ops=manifest.graphs["decode"].ops)
    manifest.graphs["decode"].ort_optimization = load_manifest(source).graphs["decode"].ort_optimization
    manifest.checksums = {}
    manifest.save(old)
    assert manifest.graphs["decode"].input(logits_to_keep.NAME) is None

    def greedy(artifact) -> tuple[list[int], OrtBackend]:
        engine = Engine.load(artifact, threads=1)
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        return generate(engine.backend, engine.tokenizer, [PROMPT], params)[0].output_ids, engine.backend

    new_tokens, new_backend = greedy(source)
    old_tokens, old_backend = greedy(old)
    assert new_backend.keeps_logits and not old_backend.keeps_logits
    assert old_tokens == new_tokens and len(new_tokens) == 12
