"""Optimized (ONNX Runtime fused) artifacts: same results as transformers and as the portable graphs.

Tolerances are those of the portable graphs (1e-4 against transformers): the fused kernels
reorder float sums (RMSNorm, softmax, matmul blocking) but for these sizes the differences
stay below 1e-6 against the portable graphs, which ``test_matches_portable_artifact`` pins at 1e-5.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import onnx
import pytest

from conftest import VARIANTS
from llmx.artifact.manifest import load_manifest
from llmx.runtime.engine import Engine
from test_cli import error_line, leftovers, run
from test_parity import PROMPTS, TOL, hf_logits

# The portable artifacts' parity tests, collected again here: pytest gives them this module's
# `engines` fixture, so they check the optimized artifacts against transformers (1e-4 over
# prefill + 16 decode steps, greedy 32 tokens identical) and padded batches against single prompts.
from test_parity import (  # noqa: E402,F401
    test_greedy_32_tokens_identical_to_transformers_generate,
    test_padded_batch_of_three_equals_each_prompt_alone,
    test_prefill_and_16_decode_steps_match_transformers,
)

PORTABLE_TOL = 1e-5


@pytest.fixture(scope="module")
def optimized(store):
    return store.optimized


@pytest.fixture(scope="module")
def engines(optimized, store):
    cache: dict[tuple[str, bool], Engine] = {}

    def get(variant: str, fused: bool = True) -> Engine:
        key = (variant, fused)
        if key not in cache:
            cache[key] = Engine.load(optimized(variant) if fused else store.artifact(variant), threads=1)
        return cache[key]

    return get


def steps(backend, prompt: list[int], n: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill then ``n`` greedy decode steps; the logits of each and the tokens fed."""
    cache = backend.new_cache(1, len(prompt) + n)
    logits = [backend.prefill(cache, [0], [prompt])[0].copy()]
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(backend.decode(cache, np.array([[tokens[-1]]]))[0, 0].copy())
    return logits, tokens


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("padding", ["left", "right"])
def test_matches_portable_artifact(variant, padding, engines):
    """Padded batch prefill, the KV it writes and 8 batched decode steps equal the portable graphs'."""
    fused, portable = engines(variant).backend, engines(variant, fused=False).backend
    prompts = [engines(variant).encode(p) for p in PROMPTS]
    caches = [b.new_cache(3, 64) for b in (fused, portable)]
    logits = [b.prefill(c, [0, 1, 2], prompts, padding).copy() for b, c in zip((fused, portable), caches)]
    for _ in range(8):
        assert np.abs(logits[0] - logits[1]).max() <= PORTABLE_TOL
        ids = np.argmax(logits[1], -1)[:, None]
        logits = [b.decode(c, ids)[:, 0].copy() for b, c in zip((fused, portable), caches)]
    assert np.abs(logits[0] - logits[1]).max() <= PORTABLE_TOL
    assert (caches[0].lengths == caches[1].lengths).all()
    for row, n in enumerate(caches[1].lengths[:3]):
        for a, b in zip(caches[0].buffers, caches[1].buffers):
            np.testing.assert_allclose(a[row, :, :n], b[row, :, :n], atol=PORTABLE_TOL)


@pytest.mark.parametrize("rows", [1, 2])
def test_multi_token_decode_matches_one_at_a_time(rows, engines):
    """T=3 new tokens per row (speculative verification) equals 3 single steps, also for 2 rows."""
    engine = engines("llama")
    prompts = [engine.encode(p) for p in PROMPTS[:rows]]
    extra = np.array([[5, 17, 42], [7, 8, 9]])[:rows]
    one, many = engine.backend.new_cache(rows, 64), engine.backend.new_cache(rows, 64)
    for cache in (one, many):
        engine.backend.prefill(cache, list(range(rows)), prompts)
    singles = np.stack([engine.backend.decode(one, extra[:, i : i + 1])[:, 0].copy() for i in range(3)], axis=1)
    together = engine.backend.decode(many, extra).copy()
    assert np.abs(singles - together).max() <= TOL
    assert (one.lengths == many.lengths).all()


def test_sliding_window_is_applied(engines, reference):
    """Mistral's window (16) in GroupQueryAttention's terms: prefill and decode past it match transformers."""
    engine, model = engines("mistral"), reference("mistral")
    prompt = engine.encode(PROMPTS[2] * 2)
    assert len(prompt) > 16
    ours, tokens = steps(engine.backend, prompt, 8)
    ref = hf_logits(model, tokens)[len(prompt) - 1 :]
    assert np.abs(np.stack(ours) - ref).max() <= TOL
    model.config.sliding_window = None
    try:
        full = hf_logits(model, tokens)[len(prompt) - 1 :]
    finally:
        model.config.sliding_window = 16
    assert np.abs(np.stack(ours) - full).max() > 1e-3


def test_manifest_and_graphs(optimized, store):
    src, out = store.artifact("llama"), optimized("llama")
    before, after = load_manifest(src), load_manifest(out)
    assert {g.ops for g in after.graphs.values()} == {"onnxruntime"}
    assert {g.ops for g in before.graphs.values()} == {"portable"}  # the source is untouched
    for name in ("prefill", "decode"):
        assert after.graphs[name].inputs == before.graphs[name].inputs
        assert after.graphs[name].outputs == before.graphs[name].outputs
    assert after.kv == before.kv and after.tokenizer == before.tokenizer and after.precision == before.precision
    entry = after.stage_applied("optimize").details
    assert entry["attention"] == "com.microsoft.GroupQueryAttention" and entry["source"] == str(src.absolute())
    assert {g.ort_optimization for g in after.graphs.values()} == {"basic"}  # fused already: ORT's passes only cost time
    decode = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in decode.graph.node)
    layers = after.num_layers
    assert ops["GroupQueryAttention"] == layers and ops["SkipSimplifiedLayerNormalization"] == 2 * layers
    assert ops["MatMul"] == 4 * layers + 1 and "Softmax" not in ops
    assert len(decode.graph.node) <= 10 * layers + 15  # + 4: logits_to_keep's Shape, Sub, Sub, Slice
    assert not (out / "weights.bin").samefile(src / "weights.bin")


def test_runtime_takes_the_session_level_the_artifact_asks_for(engines):
    import onnxruntime as ort

    fused, portable = engines("llama").backend, engines("llama", fused=False).backend
    level = {name: s.get_session_options().graph_optimization_level for name, s in fused.sessions.items()}
    assert set(level.values()) == {ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}
    assert portable.sessions["decode"].get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_a_later_stage_gets_the_full_session_level_back(optimized, tmp_path):
    """Calibrating an optimized artifact adds Q/DQ nodes that ORT's higher levels fuse."""
    import onnxruntime as ort

    art = tmp_path / "calibrated"
    shutil.copytree(optimized("llama"), art)
    manifest = json.loads((art / "llmx.json").read_text())
    manifest["lineage"].append({"stage": "calibrate", "scheme": "w8a8"})
    for graph in manifest["graphs"].values():  # a stage that rewrites graphs describes them anew
        graph.pop("ort_optimization")
    (art / "llmx.json").write_text(json.dumps(manifest))
    backend = Engine.load(art, threads=1).backend
    assert backend.sessions["decode"].get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_cli_optimize_then_generate_same_text(store, tmp_path, capsys):
    out = tmp_path / "opt"
    code, _, err = run(["optimize", str(store.artifact("qwen2")), "-o", str(out)], capsys)
    assert code == 0 and "wrote" in err
    results = []
    for art in (store.artifact("qwen2"), out):
        code, stdout, _ = run(["generate", str(art), "import json", "--temperature", "0", "--max-new-tokens", "12",
                               "--ignore-eos", "--json", "--threads", "1"], capsys)
        assert code == 0
        results.append(json.loads(stdout)["token_ids"])
    assert results[0] == results[1] and len(results[0]) == 12


def test_refuses_a_directory_that_is_not_an_artifact(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    code, _, err = run(["optimize", str(tmp_path / "src"), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "not an llmx artifact" in error_line(err)
    assert leftovers(tmp_path) == ["src"]


def test_refuses_an_optimized_artifact(optimized, tmp_path, capsys):
    code, _, err = run(["optimize", str(optimized("llama")), "-o", str(tmp_path / "again")], capsys)
    assert code != 0 and "already optimized" in error_line(err)
    assert leftovers(tmp_path) == []


def test_refuses_unknown_options_and_existing_output(store, tmp_path, capsys):
    code, _, err = run(["optimize", str(store.artifact("llama")), "-o", str(tmp_path / "o"), "--level", "9"], capsys)
    assert code != 0 and "--level" in error_line(err)
    (tmp_path / "taken").mkdir()
    code, _, err = run(["optimize", str(store.artifact("llama")), "-o", str(tmp_path / "taken")], capsys)
    assert code != 0 and "already exists" in error_line(err)
    assert leftovers(tmp_path) == ["taken"] and leftovers(tmp_path / "taken") == []


def test_refuses_a_quantized_source(store, tmp_path, capsys):
    src = tmp_path / "int8"
    shutil.copytree(store.artifact("llama"), src)
    manifest = json.loads((src / "llmx.json").read_text())
    manifest["precision"] = {"weights": "int8", "activations": "float32", "scheme": "dynamic"}
    (src / "llmx.json").write_text(json.dumps(manifest))
    code, _, err = run(["optimize", str(src), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "before calibrate" in error_line(err)
    assert leftovers(tmp_path) == ["int8"]


def test_refuses_head_dim_the_fused_attention_cannot_take(store, tmp_path, capsys):
    src = tmp_path / "odd"
    shutil.copytree(store.artifact("llama"), src)
    manifest = json.loads((src / "llmx.json").read_text())
    manifest["model"]["head_dim"] = manifest["kv"]["head_dim"] = 8  # the contract wants them to agree
    (src / "llmx.json").write_text(json.dumps(manifest))
    code, _, err = run(["optimize", str(src), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "multiple of 16" in error_line(err)
    assert leftovers(tmp_path) == ["odd"]


@pytest.mark.parametrize("fused", [True, False])
def test_decode_follows_the_cache_it_is_given(fused, engines):
    """The decode binding is reused between steps; switching caches (or replacing one) must rebind."""
    backend = engines("llama", fused).backend
    prompts = [engines("llama").encode(p) for p in PROMPTS[:2]]

    def alone(prompt):
        return steps(backend, prompt, 6)[0]

    expected = [alone(p) for p in prompts]
    caches = [backend.new_cache(1, 64) for _ in prompts]
    got = [[backend.prefill(c, [0], [p])[0].copy()] for c, p in zip(caches, prompts)]
    for _ in range(6):  # interleave the two sequences step by step
        for c, g in zip(caches, got):
            g.append(backend.decode(c, np.array([[int(np.argmax(g[-1]))]]))[0, 0].copy())
    for g, e in zip(got, expected):
        assert np.abs(np.stack(g) - np.stack(e)).max() <= PORTABLE_TOL
    for _ in range(3):  # same-size caches made and dropped over and over, as `llmx bench` does
        assert np.abs(np.stack(alone(prompts[1])) - np.stack(expected[1])).max() <= PORTABLE_TOL
