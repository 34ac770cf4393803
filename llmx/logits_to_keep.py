"""The decode graph's ``logits_to_keep`` input: how many of the last positions get logits.

A prompt prefilled on the decode graph (one prompt, or a chunk of a long one) uses only its last
position's logits, yet the LM head is the largest matmul of a small model (SmolLM-135M: vocab
49152 x hidden 576, a quarter of a prefill's work) and its [B,T,V] output a 25-50 MB buffer.
Semantics as in transformers: 0 keeps every position, k > 0 the last min(k, T); logits are
[B, kept, V]. The input is an overridable initializer (a graph input with an initializer of
the same name) whose value is 0, so a caller that does not feed it (older runtimes, the device
and TensorRT backends) gets every position, as before the input existed.

Both kinds of decode graph (export's, and optimize's fused one) slice the hidden states right
before the LM head's MatMul, with the nodes below; the final norm and softcap are per-position,
so only the norm (H values per position) still runs on every position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the runtime reads NAME on edge boxes without the onnx package
    import onnx

NAME = "logits_to_keep"
KEPT_AXIS = "kept_tokens"  # the logits' dynamic axis 1 once the input exists
HIDDEN = f"{NAME}/hidden"  # the exported decode graph's sliced hidden states, the LM head's input
_END = np.iinfo(np.int64).max


def default_value() -> "onnx.TensorProto":
    """The input's initializer: 0, every position."""
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array(0, np.int64), NAME)


def value_info() -> "onnx.ValueInfoProto":
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(NAME, TensorProto.INT64, [])


def slice_nodes(hidden: str, kept: str) -> tuple[list["onnx.NodeProto"], list["onnx.TensorProto"]]:
    """Nodes and constants for ``kept`` = hidden[:, -logits_to_keep:]; Slice clamps, so 0 (start -0)
    and k > T keep every position."""
    from onnx import helper, numpy_helper

    one, end = f"{kept}/one", f"{kept}/end"  # [1] is the axis
    constants = [numpy_helper.from_array(np.array([1], np.int64), one), numpy_helper.from_array(np.array([_END], np.int64), end)]
    # start = [batch] - [batch] - k = [-k]: derived from a Shape output so that ONNX Runtime's CUDA
    # provider keeps it on the host, where Slice reads its starts. Computed from the input alone,
    # it would run on the GPU and be copied back every step, a copy that bars CUDA-graph capture
    # (measured on an H100: ort_cuda_graph.py refused every portable decode graph).
    nodes = [
        helper.make_node("Shape", [hidden], [f"{kept}/batch"], end=1),
        helper.make_node("Sub", [f"{kept}/batch", f"{kept}/batch"], [f"{kept}/zero"]),
        helper.make_node("Sub", [f"{kept}/zero", NAME], [f"{kept}/start"]),  # [1] - [] -> [1]
        helper.make_node("Slice", [hidden, f"{kept}/start", end, one], [kept]),
    ]
    return nodes, constants


def add_to_decode_graph(model: "onnx.ModelProto", lm_head: str) -> None:
    """Give a decode graph the input: slice the input of the MatMul that reads ``lm_head``."""
    graph = model.graph
    at, head = next(((i, n) for i, n in enumerate(graph.node) if n.op_type == "MatMul" and n.input[1] == lm_head),
                    (None, None))
    if head is None:
        raise ValueError(f"no MatMul reads {lm_head}: cannot find the decode graph's LM head")
    nodes, constants = slice_nodes(head.input[0], HIDDEN)
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)
    head.input[0] = HIDDEN
    graph.input.append(value_info())
    graph.initializer.extend([default_value(), *constants])
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].ClearField("dim_value")
    logits.type.tensor_type.shape.dim[1].dim_param = KEPT_AXIS

