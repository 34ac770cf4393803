"""A small ONNX graph builder: nodes, initializers and IO declared in a few calls (onnx.helper).

The optimized graphs are written node by node from the model's spec rather than rewritten from
the exported graph, so what each node does is in the code that emits it, not in a pattern.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS_DOMAIN = "com.microsoft"
OPSET = 20  # the portable graphs' opset: both kinds of graph read the same standard ops
IR_VERSION = 10

DTYPES = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "int32": TensorProto.INT32}


class GraphBuilder:
    def __init__(self, name: str, prefix: str = ""):
        self.name = name
        self.prefix = prefix  # of every fresh name: nodes added to an existing graph (calibration) keep clear of its own
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._ids = itertools.count()

    # -- values ---------------------------------------------------------------------------

    def fresh(self, hint: str) -> str:
        return f"{self.prefix}{hint}_{next(self._ids)}"

    def input(self, name: str, dtype: str, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, DTYPES[dtype], list(shape)))
        return name

    def output(self, name: str, dtype: str, shape: Sequence[int | str]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, DTYPES[dtype], list(shape)))

    def weight(self, tensor: onnx.TensorProto) -> str:
        """Use an existing initializer (its external-data reference is kept as is)."""
        if tensor.name not in self.initializers:
            self.initializers[tensor.name] = tensor
        return tensor.name

    def const(self, value: np.ndarray | int | float | list, name: str | None = None, dtype=None) -> str:
        array = np.asarray(value, dtype=dtype)
        name = name or self.fresh("const")
        self.initializers[name] = numpy_helper.from_array(array, name)
        return name

    # -- nodes ----------------------------------------------------------------------------

    def op(self, op_type: str, inputs: Sequence[str], outputs: int | Sequence[str] = 1, domain: str = "",
           **attrs) -> list[str]:
        """Add a node; returns its output names (fresh ones unless given). ``""`` skips an optional input."""
        names = [self.fresh(op_type.lower()) for _ in range(outputs)] if isinstance(outputs, int) else list(outputs)
        node = helper.make_node(op_type, list(inputs), names, name=self.fresh(op_type), domain=domain or None, **attrs)
        self.nodes.append(node)
        return names

    def op1(self, op_type: str, inputs: Sequence[str], domain: str = "", **attrs) -> str:
        return self.op(op_type, inputs, 1, domain, **attrs)[0]

    # -- model ----------------------------------------------------------------------------

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, list(self.initializers.values()))
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="llmx-optimize")
        model.ir_version = IR_VERSION
        return model
