"""Finding a portable artifact's weights by their llmx names (``model.layers.3.attn.qkv.weight``).

Exported graphs keep each parameter's name on its initializer, with one exception: the
exporter's optimizer merges initializers with identical content into one (on random or fresh
checkpoints every RMSNorm weight is all ones and every bias all zeros, so they collapse into
the first one's name). A name that is missing is therefore found where it is used: a norm's
weight feeds the matmul that follows the norm, a bias is added to its matmul's output. Only
those two anchors are followed, and a weight that cannot be found is an error, never a guess.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from llmx import logits_to_keep
from llmx.errors import ArtifactError
from llmx.artifact.onnx_files import load_graph


class SourceWeights:
    """The initializers of one exported graph (external data stays on disk, referenced)."""

    def __init__(self, artifact: Path, graph_file: str):
        self.artifact = Path(artifact)
        model = load_graph(Path(artifact) / graph_file)
        self.tensors = {t.name: t for t in model.graph.initializer}
        self.producer = {out: node for node in model.graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in model.graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> onnx.TensorProto:
        if name not in self.tensors:
            raise ArtifactError(f"the artifact has no weight {name!r}; re-export it with this llmx")
        return self.tensors[name]

    def array(self, name: str) -> "np.ndarray":
        """The weight ``name``'s values (read from the artifact's external data when stored there)."""
        return numpy_helper.to_array(self.get(name), base_dir=str(self.artifact))

    def _mapped(self, name: str) -> "np.ndarray":
        """2-D float32 weight ``name``, memory-mapped from external data: indexing reads what it takes."""
        tensor = self.get(name)
        if tensor.data_location != onnx.TensorProto.EXTERNAL or tensor.data_type != onnx.TensorProto.FLOAT:
            return self.array(name)
        info = {e.key: e.value for e in tensor.external_data}
        return np.memmap(self.artifact / info["location"], np.float32, "r", int(info.get("offset", 0)), tuple(tensor.dims))

    def head_holds_table(self, table: str, head: str, scale: float, samples: int = 64) -> bool:
        """Whether the [hidden, vocab] ``head`` is the [vocab, hidden] ``table`` transposed, the
        table times ``scale`` (the embedding's factor, folded into it at export): checked exactly
        on ``samples`` rows spread over the vocabulary, read alone (a 4B model's table is 1.6 GB)."""
        if not (self.has(table) and self.has(head)):
            return False
        a, b = self.get(table), self.get(head)
        if len(a.dims) != 2 or list(a.dims) != list(b.dims)[::-1] or a.data_type != b.data_type:
            return False
        index = np.unique(np.linspace(0, a.dims[0] - 1, samples).astype(np.int64))
        columns = np.array(self._mapped(head)[:, index]).T
        expected = columns if scale == 1.0 else columns * np.float32(scale)
        return np.array_equal(np.array(self._mapped(table)[index]), expected)

    def _matmul_of(self, weight: str) -> onnx.NodeProto:
        node = next((n for n in self.consumers.get(weight, []) if n.op_type == "MatMul" and n.input[1] == weight), None)
        if node is None:
            raise ArtifactError(f"the exported graph has no MatMul with weight {weight!r}")
        return node

    def norm_before(self, matmul_weight: str, name: str, index: int = 0) -> onnx.TensorProto:
        """The norm weight (index 0) or bias (1) ``name``, found as the norm feeding ``matmul_weight``'s MatMul."""
        if name in self.tensors:
            return self.tensors[name]
        node = self.producer.get(self._matmul_of(matmul_weight).input[0])
        if node is not None and node.output[0] == logits_to_keep.HIDDEN:  # decode's LM head reads the final norm through it
            node = self.producer.get(node.input[0])
        found = None
        if node is not None and node.op_type == "LayerNormalization" and len(node.input) > 1 + index:
            found = node.input[1 + index]
        elif node is not None and node.op_type == "Mul" and index == 0:
            found = next((i for i in node.input if i in self.tensors), None)
        if found is None or found not in self.tensors:
            raise ArtifactError(f"cannot find {name!r} in the exported graph (expected a norm before {matmul_weight!r})")
        return _renamed(self.tensors[found], name)

    def bias_after(self, matmul_weight: str, name: str) -> onnx.TensorProto | None:
        """The bias ``name`` added to ``matmul_weight``'s output, or None if the matmul has no bias."""
        if name in self.tensors:
            return self.tensors[name]
        out = self._matmul_of(matmul_weight).output[0]
        for node in self.consumers.get(out, []):
            if node.op_type == "Add":
                other = [i for i in node.input if i != out]
                if other and other[0] in self.tensors:
                    return _renamed(self.tensors[other[0]], name)
        return None


def _renamed(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    copy.name = name
    return copy
