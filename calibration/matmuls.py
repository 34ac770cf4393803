"""The graph facts every scheme relies on: MatMul nodes whose weight is a constant initializer.

Calibration touches only these nodes (and, for SmoothQuant, the norms feeding them), so it
works on any artifact with the same IO: the portable export and the ``optimize`` stage's graphs
with fused attention alike. Attention's own MatMuls (activation x activation) are never
quantized: both of their inputs change with every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

QUANTIZED_OPS = {"QuantizeLinear", "DequantizeLinear", "MatMulNBits", "QLinearMatMul", "MatMulInteger",
                 "DynamicQuantizeLinear", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}


@dataclass
class WeightMatMul:
    node: "onnx.NodeProto"
    activation: str  # input 0: the tensor that gets quantized (w8a8) or smoothed
    weight: str  # input 1: the constant [in, out] initializer


def initializers(model) -> dict[str, "onnx.TensorProto"]:
    return {init.name: init for init in model.graph.initializer}


def weight_matmuls(model) -> list[WeightMatMul]:
    inits = initializers(model)
    found = []
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.input[1] in inits:
            if len(inits[node.input[1]].dims) == 2:
                found.append(WeightMatMul(node, node.input[0], node.input[1]))
    return found


def consumers(model) -> dict[str, list["onnx.NodeProto"]]:
    users: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    return users


def producers(model) -> dict[str, "onnx.NodeProto"]:
    return {out: node for node in model.graph.node for out in node.output}


def is_quantized(model) -> bool:
    return any(node.op_type in QUANTIZED_OPS for node in model.graph.node)


def name_nodes(model) -> None:
    """Give every unnamed node a unique name (quantizers select nodes by name)."""
    taken = {n.name for n in model.graph.node if n.name}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


# The source artifact's weights.bin, linked into the prepared fp32 directory of a model calibrated
# a layer at a time (pipeline.prepare_fp32).
SHARED_WEIGHTS = "source-weights.bin"


def read_array(init, base_dir: Path) -> np.ndarray:
    """An initializer's values, read from the artifact's weights.bin when stored outside (read here:
    onnx's reader refuses the symbolic link pipeline.prepare_fp32 reads a big source's weights through)."""
    from onnx import TensorProto, helper, numpy_helper

    if init.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(init)
    info = {e.key: e.value for e in init.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
    count = int(np.prod(init.dims, dtype=np.int64))
    values = np.fromfile(Path(base_dir) / info["location"], dtype, count, offset=int(info.get("offset", 0)))
    return values.reshape(tuple(init.dims))


def replace_initializer(model, name: str, array: np.ndarray) -> None:
    """Swap an initializer's content (same name, dtype and shape), stored inline until saved."""
    from onnx import numpy_helper

    for i, init in enumerate(model.graph.initializer):
        if init.name == name:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array), name))
            return
    raise KeyError(name)


def add_initializer(model, name: str, array: np.ndarray) -> None:
    from onnx import numpy_helper

    model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), name))


LOOKUP, ROW_SCALES = ".lookup", ".row_scales"  # a weight's untied lookup copy; the s its rows were scaled by


def untie_weights(model) -> int:
    """Give every other reader of a MatMul weight (a tied model's lookup, which gathers the head's
    columns: llmx/fused/embedding.py) its own reference to the stored values, so what the
    schemes do to the weight (quantize it, scale its rows) leaves the lookup as it was. The copy
    is a second name on the same external bytes until saved. Returns how many were untied."""
    inits = initializers(model)
    weights = {mm.weight for mm in weight_matmuls(model)}
    copies: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type == "MatMul":
            continue
        for i, name in enumerate(node.input):
            if name in weights:
                if name not in copies:
                    copies[name] = name + LOOKUP
                    model.graph.initializer.append(inits[name])
                    model.graph.initializer[-1].name = copies[name]
                node.input[i] = copies[name]
    return len(copies)


def drop_unused_initializers(model) -> None:
    used = {name for node in model.graph.node for name in node.input}
    for init in [i for i in model.graph.initializer if i.name not in used]:
        model.graph.initializer.remove(init)


def declare_activation_types(model) -> None:
    """Give weight-MatMul inputs their weight's type where the graph lacks one.

    ONNX's shape inference stops at contrib ops (GroupQueryAttention, QuickGelu, ...), and ORT's
    calibrators and quantizer skip tensors whose type they cannot see.
    """
    import onnx

    known = {v.name for v in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    inits = initializers(model)
    for mm in weight_matmuls(model):
        if mm.activation not in known:
            known.add(mm.activation)
            elem_type = inits[mm.weight].data_type  # MatMul's inputs share one type
            model.graph.value_info.append(onnx.helper.make_tensor_value_info(mm.activation, elem_type, None))
