"""Block tensors an artifact stores in fewer bits (llmx/compact_blocks.py), rebuilt once per process.

The graphs compute them from their stored parts with nodes ONNX Runtime's constant folding
evaluates at load, which is correct but holds every intermediate of every tensor until the pass
ends (a 0.9 GB peak for SmolLM2's Q4_K_M, whose rebuilt codes are 0.1 GB; an 8B model's would not
fit). Here the rebuild nodes run in a session of their own, unoptimized, so ONNX Runtime frees each
intermediate once it is used; the results go to the prefill and decode sessions as initializers
(``SessionOptions.add_initializer``: no copy, shared by both), and the graphs they load are the
artifact's without the rebuild nodes. Editing the graph needs the onnx package; without it the
graphs load as they are and ONNX Runtime folds (same values, more memory while loading).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmx.compact_blocks import MARK, rebuilt_tensors

FOLDER = "session.model_external_initializers_file_folder_path"  # weights.bin for a graph loaded from bytes


class RebuiltWeights:
    """The rebuilt tensors of one artifact's graphs, computed on first use and kept for every session."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self._values: dict[str, object] = {}  # the same, as OrtValues over those arrays (no copy)

    def prepare(self, path: Path, opts):
        """(what to give InferenceSession: the graph's path or its edited bytes) for ``path``; adds
        the rebuilt tensors to ``opts`` (onnxruntime.SessionOptions)."""
        try:
            import onnx
        except ImportError:
            return str(path)
        model = onnx.load_model(str(path), load_external_data=False)
        types = rebuilt_tensors(model)
        names = list(types)
        # ONNX Runtime checks that an initializer's file exists, even one add_initializer replaces:
        # the placeholders name the graph's weights file. A graph with none (all inline) is left
        # to ONNX Runtime's folding, which gives the same values.
        location = next((e.value for i in model.graph.initializer for e in i.external_data if e.key == "location"), None)
        if not names or location is None:
            return str(path)
        producers = _producers(model, names)
        missing = [n for n in names if n not in self.arrays]
        if missing:
            self._run(model, producers, {n: types[n] for n in missing}, path.parent)
        rebuilding = {id(n) for n in producers}
        kept = [node for node in model.graph.node if id(node) not in rebuilding]
        del model.graph.node[:]
        model.graph.node.extend(kept)
        used = {i for node in kept for i in node.input}
        for init in [i for i in model.graph.initializer if i.name not in used]:
            model.graph.initializer.remove(init)  # the stored parts: only the rebuild read them
        for name in names:
            model.graph.initializer.append(_placeholder(onnx, name, self.arrays[name], location))
            opts.add_initializer(name, self._values[name])
        for entry in [p for p in model.metadata_props if p.key == MARK]:
            model.metadata_props.remove(entry)
        opts.add_session_config_entry(FOLDER, str(path.parent))
        return model.SerializeToString()

    def _run(self, model, producers: list, types: dict[str, int], folder: Path) -> None:
        import onnx
        import onnxruntime as ort

        used = {i for node in producers for i in node.input}
        inits = [i for i in model.graph.initializer if i.name in used]
        names = list(types)
        outputs = [onnx.helper.make_tensor_value_info(n, t, None) for n, t in types.items()]
        graph = onnx.helper.make_graph(producers, "rebuild", [], outputs, inits)
        rebuild = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
        opts = ort.SessionOptions()
        # Unoptimized: folding would hold every intermediate at once, the very thing avoided here.
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.add_session_config_entry(FOLDER, str(folder))
        opts.log_severity_level = 3
        session = ort.InferenceSession(rebuild.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        for name, array in zip(names, session.run(names, {})):
            self.arrays[name] = np.ascontiguousarray(array)
            self._values[name] = ort.OrtValue.ortvalue_from_numpy(self.arrays[name])


def _producers(model, names: list[str]) -> list:
    """The nodes computing ``names``, and the nodes they read, in graph order."""
    by_output = {o: node for node in model.graph.node for o in node.output}
    needed, todo = set(), list(names)
    while todo:
        node = by_output.get(todo.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            todo.extend(node.input)
    return [node for node in model.graph.node if id(node) in needed]


def _placeholder(onnx, name: str, array: np.ndarray, location: str):
    """An initializer entry that ``add_initializer`` supplies: dims and type; its data is never read."""
    proto = onnx.TensorProto()
    proto.name, proto.data_type = name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    proto.dims.extend(array.shape)
    proto.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(array.nbytes))):
        entry = proto.external_data.add()
        entry.key, entry.value = key, value
    return proto
