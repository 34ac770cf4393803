"""fp16/bf16 graph conversion for TensorRT's strongly typed engines, checked on the CPU:
valid ONNX, fragile math kept fp32, and numerically close to the fp32 graph when run."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmx.errors import ArtifactError
from llmx.low_precision import KEEP_FP32, convert_graph, float_dtypes, qdq_summary


def converted(artifact, name: str, dtype: str):
    model = onnx.load(str(artifact / f"{name}.onnx"))  # weights loaded
    convert_graph(model, dtype)
    model.ir_version = 10
    return model


def decode_feeds(rng, batch=2, t=3, total=7, capacity=11, layers=2, heads=2, head_dim=16, start=None, dtype=np.float32):
    start = total - t if start is None else start
    feeds = {
        "input_ids": rng.integers(0, 320, (batch, t)),
        "attention_mask": np.ones((batch, total), np.int64),
        "position_ids": np.tile(np.arange(start, start + t), (batch, 1)),
    }
    for i in range(layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, heads, capacity, head_dim)).astype(dtype)
    return feeds


def input_types(model) -> dict[str, int]:
    """Element type of every tensor, by shape inference."""
    typed = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    return types


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_converted_graph_is_valid_and_keeps_fragile_math_in_fp32(llama_artifact, graph, dtype):
    model = converted(llama_artifact, graph, dtype)
    onnx.checker.check_model(model, full_check=True)
    low = helper.np_dtype_to_tensor_dtype(np.dtype(np.float16)) if dtype == "float16" else TensorProto.BFLOAT16
    types = input_types(model)
    fp32_nodes = [n for n in model.graph.node if n.op_type in KEEP_FP32]
    assert {n.op_type for n in fp32_nodes} >= {"Softmax", "ReduceMean", "Pow", "Cos", "Sin"}
    for node in fp32_nodes:  # norms, softmax and RoPE angles compute in float32
        assert all(types[x] == TensorProto.FLOAT for x in node.input if x and types[x] in (TensorProto.FLOAT, low)), node.name
    weights = [i for i in model.graph.initializer if len(i.dims) >= 2]
    assert weights and all(i.data_type == low for i in weights)
    dtypes = float_dtypes(model)
    assert dtypes["logits"] == "float32"  # sampling reads fp32
    assert all(dtypes[v.name] == dtype for v in [*model.graph.input, *model.graph.output] if "present" in v.name or "past" in v.name)


def test_masking_constant_is_clamped_to_the_low_dtypes_range(llama_artifact):
    model = converted(llama_artifact, "decode", "float16")
    lows = [numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == TensorProto.FLOAT16]
    assert all(np.isfinite(a).all() for a in lows)
    assert any((a == np.finfo(np.float16).min).any() for a in lows)  # float32's min became fp16's min, not -inf


@pytest.mark.parametrize("start", [0, 200])  # position 200: RoPE angles must not be computed in fp16
def test_fp16_decode_graph_matches_fp32_on_onnx_runtime(llama_artifact, start):
    rng = np.random.default_rng(0)
    feeds = decode_feeds(rng, total=start + 3, capacity=start + 5, start=start)
    ref = ort.InferenceSession(str(llama_artifact / "decode.onnx")).run(None, feeds)
    model = converted(llama_artifact, "decode", "float16")
    low = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    out = ort.InferenceSession(model.SerializeToString()).run(None, low)
    scale = np.abs(ref[0]).max()
    assert out[0].dtype == np.float32
    assert np.abs(out[0] - ref[0]).max() <= 5e-3 * scale
    assert (out[0].argmax(-1) == ref[0].argmax(-1)).all()
    for o, r in zip(out[1:], ref[1:]):  # the cache update is in fp16 and lands in the right slots
        assert o.dtype == np.float16 and np.abs(o.astype(np.float32) - r).max() <= 5e-3 * max(1.0, np.abs(r).max())


def test_bf16_decode_graph_matches_fp32_on_the_reference_evaluator(llama_artifact):
    import ml_dtypes
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(1)
    feeds = decode_feeds(rng)
    ref = ort.InferenceSession(str(llama_artifact / "decode.onnx")).run(None, feeds)
    model = converted(llama_artifact, "decode", "bfloat16")
    low = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    out = ReferenceEvaluator(model).run(None, low)  # ONNX Runtime CPU has no bf16 MatMul
    assert np.abs(out[0].astype(np.float32) - ref[0]).max() <= 3e-2 * np.abs(ref[0]).max()


def rms_norm_graph():
    """y = x / sqrt(mean(x^2) + eps) * w, as the exporter writes RMSNorm."""
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["std"]),
        helper.make_node("Reciprocal", ["std"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["normed"]),
        helper.make_node("MatMul", ["normed", "w"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"), numpy_helper.from_array(np.array([-1]), "axes"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps"), numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")]
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def test_norm_of_large_activations_does_not_overflow():
    # The reference evaluator computes fp16 in fp16, as a GPU does (ONNX Runtime CPU would
    # silently upcast fp16 ops to fp32 and hide an overflow).
    from onnx.reference import ReferenceEvaluator

    x = np.array([[1000.0, -2000.0, 500.0, 3000.0]], np.float32)  # x**2 overflows fp16 (max 65504)
    ref = ReferenceEvaluator(rms_norm_graph()).run(None, {"x": x})[0]
    model = convert_graph(rms_norm_graph(), "float16", fp32_outputs=("y",))
    out = ReferenceEvaluator(model).run(None, {"x": x.astype(np.float16)})[0]
    np.testing.assert_allclose(out, ref, rtol=2e-3)
    naive = rms_norm_graph()  # every tensor fp16: what a converter without the fp32 rules produces
    for init in naive.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for v in [*naive.graph.input, *naive.graph.output]:
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    with np.errstate(over="ignore"):
        bad = ReferenceEvaluator(naive).run(None, {"x": x.astype(np.float16)})[0]
    assert not np.allclose(bad.astype(np.float32), ref, rtol=0.1)  # the fp32 rules are what make it work


@pytest.mark.parametrize("variant", ["llama", "gpt2"])  # gpt2: LayerNormalization, Gelu, learned positions
def test_onnx_only_fp16_artifact_generates_the_same_greedy_tokens_on_cpu(store, tmp_path, variant, capsys):
    from llmx.cli import main

    src, out = store.artifact(variant), tmp_path / "fp16"
    main(["build", str(src), "-o", str(out), "--onnx-only"])
    tokens = []
    for art in (src, out):
        main(["generate", str(art), "def fibonacci(n):", "--temperature", "0", "--max-new-tokens", "32", "--ignore-eos", "--json"])
        tokens.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert tokens[0] == tokens[1]
    manifest = json.loads((out / "llmx.json").read_text())
    assert manifest["kv"]["dtype"] == "float16" and manifest["precision"]["weights"] == "float16"
    assert manifest["lineage"][-1]["stage"] == "build" and "tensorrt" not in manifest["extras"]
    assert (out / "weights.bin").stat().st_size < 0.6 * (src / "weights.bin").stat().st_size


def test_fused_w4_graphs_convert_to_fp16_activations_keeping_their_blocks(store, tmp_path, capsys):
    """--onnx-only takes ONNX Runtime's fused graphs (ort-cuda runs them): MatMulNBits keeps its
    4-bit codes, its scales and the activations, KV cache and GroupQueryAttention go fp16, the
    first norm stays fp32, and greedy decoding on the CPU matches the float32-activation graphs."""
    from llmx.cli import main
    from llmx.runtime.engine import Engine

    src, w4, out = store.checkpoint("llama"), tmp_path / "w4", tmp_path / "w4-fp16"
    main(["export", str(src), "-o", str(w4), "--precision", "w4"])
    main(["build", str(w4), "-o", str(out), "--onnx-only", "--precision", "fp16"])
    capsys.readouterr()
    manifest = json.loads((out / "llmx.json").read_text())
    assert manifest["kv"]["dtype"] == "float16" and manifest["graphs"]["decode"]["ops"] == "onnxruntime"
    precision = manifest["precision"]
    assert (precision["weights"], precision["activations"], precision["scheme"]) == ("int4", "float16", "w4")
    graph = onnx.load(out / "decode.onnx", load_external_data=False)
    dtypes = float_dtypes(graph)
    inits = {i.name: i.data_type for i in graph.graph.initializer}
    by_op = collections.defaultdict(list)
    for node in graph.graph.node:
        by_op[node.op_type].append(node)
    assert by_op["MatMulNBits"] and all(inits[n.input[1]] == TensorProto.UINT8 and inits[n.input[2]] == TensorProto.FLOAT16
                                        for n in by_op["MatMulNBits"])
    assert all(dtypes.get(n.input[3]) == "float16" for n in by_op["GroupQueryAttention"])  # the past KV inputs
    assert dtypes["logits"] == "float32"
    tokens, logits = [], []
    for art in (w4, out):
        main(["generate", str(art), "def fibonacci(n):", "--temperature", "0", "--max-new-tokens", "16", "--ignore-eos", "--json"])
        tokens.append(json.loads(capsys.readouterr().out)["token_ids"])
        backend = Engine.load(art).backend
        logits.append(np.array(backend.prefill(backend.new_cache(1, 8), [0], [[5, 9, 23, 7]]), np.float32))
    assert tokens[0] == tokens[1]
    assert np.abs(logits[1] - logits[0]).max() <= 2e-2 * np.abs(logits[0]).max()
    assert (out / "weights.bin").stat().st_size < (w4 / "weights.bin").stat().st_size  # scales and norms halve


def test_control_flow_is_refused():
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=then)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    with pytest.raises(ArtifactError, match="control flow"):
        convert_graph(helper.make_model(graph), "float16")


# -- Q/DQ graphs (what llmx calibrate writes) -------------------------------------------------------


def qdq_matmul(zero_point=0, zp_type=TensorProto.INT8, domain=""):
    """y = DQ(Q(x)) @ DQ(w_int8): the pattern TensorRT fuses into an INT8 GEMM."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (8, 4)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w_q"), numpy_helper.from_array(np.array(0.01, np.float32), "w_scale"),
             numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
             helper.make_tensor("zp", zp_type, [], [zero_point]), helper.make_tensor("w_zp", TensorProto.INT8, [], [0])]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "zp"], ["x_q"], domain=domain),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "zp"], ["x_dq"], domain=domain),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], domain=domain),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 4])], inits)
    opsets = [helper.make_opsetid("", 20)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def test_qdq_summary_counts_int8_and_refuses_what_tensorrt_cannot_run():
    assert qdq_summary(qdq_matmul()) == {"int8": 3}
    with pytest.raises(ArtifactError, match="nonzero zero point"):
        qdq_summary(qdq_matmul(zero_point=3))
    with pytest.raises(ArtifactError, match="uint8"):
        qdq_summary(qdq_matmul(zp_type=TensorProto.UINT8))
    with pytest.raises(ArtifactError, match="standard ONNX Q/DQ"):
        qdq_summary(qdq_matmul(domain="com.microsoft"))


def test_qdq_graph_converts_around_quantization_and_still_runs():
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    ref = ort.InferenceSession(qdq_matmul().SerializeToString()).run(None, {"x": x})[0]
    model = convert_graph(qdq_matmul(), "float16")
    onnx.checker.check_model(model, full_check=True)
    counts = collections.Counter(n.op_type for n in model.graph.node)
    assert counts["QuantizeLinear"] == 1 and counts["DequantizeLinear"] == 2 and counts["Cast"] == 1  # only the fp32 logits cast
    scales = {i.name: i.data_type for i in model.graph.initializer if "scale" in i.name}
    assert set(scales.values()) == {TensorProto.FLOAT16}  # DQ outputs fp16 because its scale is fp16
    out = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x.astype(np.float16)})[0]
    assert np.abs(out - ref).max() <= 0.05 * np.abs(ref).max()
