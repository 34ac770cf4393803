"""fp16 / bf16 graphs: one pass that lowers the ONNX graph's dtypes and keeps the numerically
fragile parts in fp32. Used by ``llmx build`` (an fp32 artifact's graphs, for engines) and by
``llmx export --precision fp16|bf16`` (the traced graphs, their weights streamed already lowered).

TensorRT 11 builds only strongly typed networks (precision comes from tensor dtypes, not
builder flags), so an fp16 engine needs an fp16 graph. ONNX Runtime's ``float16`` converter
handles fp16 only and blocks by op type, which cannot say "keep the RoPE angles fp32";
NVIDIA's ModelOpt AutoCast pins onnx/onnxruntime-gpu versions that conflict with llmx's. The
rules here, applied once over the topologically sorted nodes:

- weights (float initializers of rank >= 2) and float graph inputs (the KV cache) become the
  low dtype: they are what makes decoding memory-bound;
- norms, softmax, reductions, exp/log (``KEEP_FP32``) compute in fp32: x**2 averaged over
  the hidden size overflows fp16 once |x| > 256, and softmax wants an fp32 max and sum;
- a node whose float inputs are all fp32 stays fp32: this keeps position math (RoPE angles
  are position * inv_freq, and position 2000 has a resolution of 2 in fp16) and a norm's
  epsilon / sqrt / reciprocal tail in fp32;
- any other node with a low-precision input runs in the low dtype; small constants follow the
  node that reads them (converted once, clamped to the low dtype's finite range, so masking
  with float32's minimum becomes the low dtype's minimum rather than -inf);
- Q/DQ graphs: DequantizeLinear outputs the low dtype (its scale is converted), a
  QuantizeLinear's scale follows its input;
- logits stay an fp32 graph output (sampling wants fp32; it is a [B,T,V] cast).
A Cast is inserted where an fp32 value meets a low-precision node or the reverse, once per tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmx.errors import ArtifactError, InputError, require

LOW_DTYPES = ("float16", "bfloat16")
KEEP_FP32 = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization",
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp",
    "Pow", "Sqrt", "Reciprocal", "Exp", "Log", "Cos", "Sin", "CumSum",
})
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
FP32, LOW, FLEX = "fp32", "low", "flex"  # states of float tensors; FLEX = a constant that follows its reader


def _onnx():
    return require("onnx", "converting ONNX graphs to fp16/bf16", "export")


def _np_dtype(dtype: str):
    if dtype == "float16":
        return np.dtype(np.float16)
    import ml_dtypes  # an onnx dependency; numpy has no bfloat16

    return np.dtype(ml_dtypes.bfloat16)


@dataclass
class _Pass:
    """State of one conversion: tensor states, converted copies, the rebuilt node list."""

    model: "onnx.ModelProto"
    dtype: str
    base_dir: Path | None
    states: dict[str, str] = field(default_factory=dict)
    elem: dict[str, int] = field(default_factory=dict)
    converted: dict[tuple[str, str], str] = field(default_factory=dict)
    nodes: list = field(default_factory=list)
    stored_low: dict = field(default_factory=dict)  # weight name -> its TensorProto, already in the low dtype

    def __post_init__(self):
        onnx = _onnx()
        self.FLOAT = onnx.TensorProto.FLOAT
        self.LOW = onnx.helper.np_dtype_to_tensor_dtype(_np_dtype(self.dtype))
        self.inits = {i.name: i for i in self.model.graph.initializer}

    # -- values ----------------------------------------------------------------------------

    def array(self, name: str) -> np.ndarray:
        onnx = _onnx()
        return onnx.numpy_helper.to_array(self.inits[name], base_dir=str(self.base_dir or ""))

    def lowered(self, array: np.ndarray) -> np.ndarray:
        low = _np_dtype(self.dtype)
        limit = _finfo_max(low)
        return np.clip(array, -limit, limit).astype(low)

    def add_initializer(self, name: str, array: np.ndarray) -> None:
        onnx = _onnx()
        init = onnx.numpy_helper.from_array(array, name)
        self.model.graph.initializer.append(init)
        self.inits[name] = init

    def as_state(self, name: str, want: str) -> str:
        """The name of ``name`` in state ``want`` (fp32 or low): a converted constant or a Cast."""
        have = self.states[name]
        if have == want or (have == FLEX and want == FP32):
            return name
        key = (name, want)
        if key not in self.converted:
            suffix = self.dtype if want == LOW else "float32"
            new = f"{name}.{suffix}"
            if name in self.inits and have == FLEX:
                self.add_initializer(new, self.lowered(self.array(name)))
            else:
                onnx = _onnx()
                to = self.LOW if want == LOW else self.FLOAT
                self.nodes.append(onnx.helper.make_node("Cast", [name], [new], to=to, name=f"cast_{new}"))
            self.states[new] = want
            self.converted[key] = new
        return self.converted[key]


def _finfo_max(dtype) -> float:
    import ml_dtypes  # its finfo knows bfloat16 and defers to numpy's for float16

    return float(ml_dtypes.finfo(dtype).max)


def convert_graph(model, dtype: str, base_dir: str | Path | None = None, fp32_outputs: tuple[str, ...] = ("logits",),
                  lowered: Mapping[str, "onnx.TensorProto"] | None = None):
    """Lower ``model``'s float compute to ``dtype`` in place (see the module docstring); returns it.

    ``base_dir`` is where external weights live (graphs loaded without their data). ``lowered``
    gives weights already stored in ``dtype`` (a streamed export wrote them so): they replace
    the graph's float32 initializers of those names, whose data is then never read.
    """
    onnx = _onnx()
    if dtype not in LOW_DTYPES:
        raise InputError(f"precision conversion targets one of {', '.join(LOW_DTYPES)}, got {dtype!r}")
    bad = sorted({n.op_type for n in model.graph.node} & CONTROL_FLOW)
    if bad:
        raise ArtifactError(f"cannot convert a graph with control flow ({', '.join(bad)}) to {dtype}")
    p = _Pass(model, dtype, Path(base_dir) if base_dir else None, stored_low=dict(lowered or {}))
    _constants_to_initializers(p)
    _collect_types(p)
    _seed_states(p)
    originals = list(model.graph.node)
    for node in originals:
        _convert_node(p, node)
        p.nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(p.nodes)
    _retype_outputs(p, fp32_outputs)
    _drop_unused_initializers(model)
    del model.graph.value_info[:]  # stale float32 types; consumers infer their own
    return model


def _constants_to_initializers(p: _Pass) -> None:
    """Float Constant nodes become initializers, so one rule handles every constant."""
    onnx = _onnx()
    keep = []
    for node in p.model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            if "value" in attrs and attrs["value"].t.data_type == p.FLOAT:
                p.add_initializer(node.output[0], onnx.numpy_helper.to_array(attrs["value"].t))
                continue
            if "value_float" in attrs or "value_floats" in attrs:
                value = attrs["value_float"].f if "value_float" in attrs else list(attrs["value_floats"].floats)
                p.add_initializer(node.output[0], np.asarray(value, np.float32))
                continue
        keep.append(node)
    del p.model.graph.node[:]
    p.model.graph.node.extend(keep)


def _collect_types(p: _Pass) -> None:
    """Element type of every tensor, from shape inference on the weightless graph."""
    onnx = _onnx()
    graph = p.model.graph
    typed = onnx.shape_inference.infer_shapes(p.model, data_prop=False)
    for v in [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]:
        p.elem[v.name] = v.type.tensor_type.elem_type
    for init in graph.initializer:
        p.elem[init.name] = init.data_type
    _propagate_types(p, graph)
    missing = [y for n in graph.node for y in n.output if y and y not in p.elem]
    if missing:
        raise ArtifactError(f"shape inference gave no type for {len(missing)} tensors (first: {missing[0]}); cannot convert")


# The float32 statistics outputs of ONNX Runtime's norms (mean, inv_std_var): the rest of a
# contrib op's float outputs take its first input's type (MatMulNBits: A's, GroupQueryAttention:
# the query's, a skip norm's output and residual sum: the input's), as each op's schema says.
FLOAT32_STATS = {"LayerNormalization": (1, 2), "SimplifiedLayerNormalization": (1,),
                 "SkipLayerNormalization": (1, 2), "SkipSimplifiedLayerNormalization": (1, 2)}


def _propagate_types(p: _Pass, graph) -> None:
    """Types ONNX's shape inference left out: it stops at ONNX Runtime's contrib ops (the fused
    graphs' MatMulNBits, GroupQueryAttention, skip norms) and at everything they feed."""
    onnx = _onnx()
    opsets = {o.domain: o.version for o in p.model.opset_import}
    for node in graph.node:  # topologically sorted
        if all(not y or y in p.elem for y in node.output):
            continue
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain == "" and onnx.defs.has(node.op_type, domain):
            schema = onnx.defs.get_schema(node.op_type, opsets.get("", 21), domain)
            known = {x: onnx.helper.make_tensor_type_proto(p.elem[x], None) for x in node.input if x in p.elem}
            try:
                inferred = onnx.shape_inference.infer_node_outputs(schema, node, known, opset_imports=list(p.model.opset_import))
            except onnx.shape_inference.InferenceError:
                continue  # left missing: convert_graph names it
            p.elem.update((y, t.tensor_type.elem_type) for y, t in inferred.items() if t.tensor_type.elem_type)
        elif node.input and node.input[0] in p.elem:
            first = p.elem[node.input[0]]
            stats = FLOAT32_STATS.get(node.op_type, ())
            p.elem.update((y, p.FLOAT if i in stats else first) for i, y in enumerate(node.output) if y and y not in p.elem)


def _seed_states(p: _Pass) -> None:
    """Weights and the KV-cache inputs start low; small constants follow their readers."""
    onnx = _onnx()
    for init in list(p.model.graph.initializer):
        if init.data_type != p.FLOAT:
            continue
        if init.name in p.stored_low:
            stored = p.stored_low[init.name]
            if tuple(stored.dims) != tuple(init.dims) or stored.data_type != p.LOW:
                raise ArtifactError(f"internal error: the stored {init.name} does not match the graph's weight")
            init.CopyFrom(stored)
            p.states[init.name] = LOW
        elif len(init.dims) >= 2:
            new = onnx.numpy_helper.from_array(p.lowered(p.array(init.name)), init.name)
            init.CopyFrom(new)
            p.states[init.name] = LOW
        else:
            p.states[init.name] = FLEX
    for value in p.model.graph.input:
        if value.type.tensor_type.elem_type == p.FLOAT:
            value.type.tensor_type.elem_type = p.LOW
            p.states[value.name] = LOW


def _convert_node(p: _Pass, node) -> None:
    floats_in = [i for i, x in enumerate(node.input) if x and p.elem.get(x) == p.FLOAT]
    floats_out = [y for y in node.output if y and p.elem.get(y) == p.FLOAT]
    if not floats_in and not floats_out:
        return
    if node.op_type == "Cast":
        _convert_cast(p, node, floats_in)
        return
    mode = _mode(p, node, floats_in)
    for i in floats_in:
        node.input[i] = p.as_state(node.input[i], mode)
    stats = {node.output[i] for i in FLOAT32_STATS.get(node.op_type, ()) if i < len(node.output)}
    for y in floats_out:
        p.states[y] = FP32 if y in stats else mode


def _mode(p: _Pass, node, floats_in: list[int]) -> str:
    """The precision a node computes in (see the module docstring)."""
    if node.op_type == "DequantizeLinear":
        return LOW
    if node.op_type == "QuantizeLinear":
        return p.states.get(node.input[0], FP32) if 0 in floats_in else FP32
    if node.op_type in KEEP_FP32:
        return FP32
    return LOW if any(p.states.get(node.input[i]) == LOW for i in floats_in) else FP32


def _convert_cast(p: _Pass, node, floats_in: list[int]) -> None:
    """float->float casts pass their input's precision through; int->float starts fp32 math."""
    to = next(a for a in node.attribute if a.name == "to")
    if to.i != p.FLOAT:
        return  # float -> int/bool: reads any float dtype
    if floats_in:
        state = p.states[node.input[0]]
        state = FP32 if state == FLEX else state
        to.i = p.LOW if state == LOW else p.FLOAT
        p.states[node.output[0]] = state
    else:
        p.states[node.output[0]] = FP32


def _retype_outputs(p: _Pass, fp32_outputs: tuple[str, ...]) -> None:
    """Graph outputs: ``fp32_outputs`` float32, every other float output the low dtype."""
    onnx = _onnx()
    for out in p.model.graph.output:
        if p.elem.get(out.name) != p.FLOAT:
            continue
        want = FP32 if out.name in fp32_outputs else LOW
        if p.states.get(out.name, FP32) != want:
            inner = f"{out.name}.{p.dtype if want == FP32 else 'float32'}"
            _rename_tensor(p.model.graph, out.name, inner)
            to = p.FLOAT if want == FP32 else p.LOW
            p.model.graph.node.append(onnx.helper.make_node("Cast", [inner], [out.name], to=to, name=f"cast_{out.name}"))
        out.type.tensor_type.elem_type = p.FLOAT if want == FP32 else p.LOW


def _rename_tensor(graph, old: str, new: str) -> None:
    for node in graph.node:
        for i, x in enumerate(node.input):
            if x == old:
                node.input[i] = new
        for i, y in enumerate(node.output):
            if y == old:
                node.output[i] = new


def _drop_unused_initializers(model) -> None:
    used = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def lowered_precision(precision, dtype: str, weights: bool = True):
    """The manifest's ``precision`` section once ``convert_graph`` lowered the graphs to ``dtype``:
    the float math runs in it and, unless they stay int8 Q/DQ (``weights`` False), so do the
    weights and activations."""
    if weights:
        # w8/w4 blocks (MatMulNBits) keep their integers: their scales and activations go low
        stored = precision.weights if precision.weights in ("int8", "int4") else dtype
        precision = dataclasses.replace(precision, weights=stored, activations=dtype)
    return dataclasses.replace(precision, compute_dtype=dtype)


# -- reading what a graph holds ---------------------------------------------------------------


def float_dtypes(model) -> dict[str, str]:
    """Dtype name of each float initializer and graph input/output (for reports and tests)."""
    onnx = _onnx()

    def name(t: int) -> str:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t)).name

    out = {i.name: name(i.data_type) for i in model.graph.initializer}
    for v in [*model.graph.input, *model.graph.output]:
        out[v.name] = name(v.type.tensor_type.elem_type)
    return out


QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def qdq_summary(model, base_dir: str | Path | None = None) -> dict[str, int]:
    """Q/DQ nodes by quantized type ("int8", "fp8"); refuses what TensorRT cannot run.

    TensorRT reads standard-domain Q/DQ only, and its INT8 is symmetric: signed int8 with
    zero points of 0 (uint8 or a nonzero zero point is asymmetric quantization).
    """
    onnx = _onnx()
    nodes = [n for n in model.graph.node if n.op_type in QDQ_OPS]
    if not nodes:
        return {}
    elem = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    inits = {i.name: i for i in model.graph.initializer}
    elem.update({i.name: i.data_type for i in model.graph.initializer})
    names = {onnx.TensorProto.INT8: "int8", onnx.TensorProto.FLOAT8E4M3FN: "fp8", onnx.TensorProto.UINT8: "uint8"}
    counts: dict[str, int] = {}
    for node in nodes:
        where = f"{node.op_type} {node.name or node.output[0]}"
        if node.domain not in ("", "ai.onnx"):
            raise ArtifactError(f"{where} is in domain {node.domain!r}; TensorRT reads only standard ONNX Q/DQ")
        quantized = node.output[0] if node.op_type == "QuantizeLinear" else node.input[0]
        kind = names.get(elem.get(quantized), f"type {elem.get(quantized)}")
        if kind not in ("int8", "fp8"):
            raise ArtifactError(f"{where} quantizes to {kind}; TensorRT needs symmetric int8 (or fp8) Q/DQ")
        zero_point = node.input[2] if len(node.input) > 2 else ""
        if zero_point in inits and np.any(onnx.numpy_helper.to_array(inits[zero_point], base_dir=str(base_dir or "")).astype(np.float32)):
            raise ArtifactError(f"{where} has a nonzero zero point; TensorRT INT8 is symmetric (zero point 0)")
        counts[kind] = counts.get(kind, 0) + 1
    return counts
