"""An fp32 graph run one decoder layer at a time: calibration of a model whose fp32 weights do not fit.

Llama-3.1-8B's fp32 graph is 32 GB of weights on a 24 GiB box: no session can hold it, yet the
search needs its outputs once (the reference the candidates are judged against, the activation
statistics). The graph is cut into **stages** by the layer of the weights its nodes read
(``layers.N.`` in an initializer's name, as every exporter here names them), carried to
everything computed from them: a node's stage is the largest of its inputs' stages. Stage -1 is
what no layer feeds (the mask, the embedding lookup); stage N holds the nodes that read layer N's
weights or what layer N computed, so the final norm and the head join the last layer. A stage is
a small graph whose tensors are references into the source's weights.bin (which ONNX Runtime
maps), and it runs over every input before the next stage's session exists: one layer's weights in
memory at a time (mapped, not packed), plus the tensors crossing from a stage to a later one
for every input (the hidden states: 256 tokens x 4096 x 4 bytes = 4 MiB per tensor per window).

A stage's outputs are the tensors a later stage reads and the ones asked for, so a graph's KV
outputs nobody asked for are never kept. The price is one session per layer per pass instead of
one per model: reading each layer's weights from disk once per pass (the page cache cannot hold
32 GB either).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from llmx.artifact.onnx_files import IR_VERSION, load_graph, stored_bytes

LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def layer_of(name: str) -> int:
    """The decoder layer a weight belongs to, by its name; -1 for any other (embedding, head, rope)."""
    found = LAYER.search(name)
    return int(found.group(1)) if found else -1


@dataclass
class Stage:
    index: int  # the layer (-1: before any)
    nodes: list = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # graph inputs and earlier stages' tensors, in first-use order
    produced: set[str] = field(default_factory=set)
    initializers: list[str] = field(default_factory=list)


@dataclass
class InputInfo:
    """What ``InferenceSession.get_inputs()`` tells of an input that its callers here read."""
    name: str
    shape: list


def node_inputs(node) -> list[str]:
    """Every tensor ``node`` reads, including those its subgraphs (If, Loop, Scan) take from outside."""
    names = [n for n in node.input if n]
    for attribute in node.attribute:
        graphs = list(attribute.graphs) + ([attribute.g] if attribute.HasField("g") else [])
        for graph in graphs:
            inner = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | {
                i.name for i in graph.initializer}
            names += [n for sub in graph.node for n in node_inputs(sub) if n not in inner]
    return names


def cut(model) -> list[Stage]:
    """The graph's stages, in order (see the module doc)."""
    inits = {i.name for i in model.graph.initializer}
    tensor_stage: dict[str, int] = {}
    stages: dict[int, Stage] = {}
    for node in model.graph.node:
        reads = node_inputs(node)
        index = max([layer_of(n) if n in inits else tensor_stage.get(n, -1) for n in reads] + [-1])
        stage = stages.setdefault(index, Stage(index))
        stage.nodes.append(node)
        for name in reads:
            if name in inits:
                if name not in stage.initializers:
                    stage.initializers.append(name)
            elif name not in stage.produced and name not in stage.inputs:
                stage.inputs.append(name)
        for out in node.output:
            if out:
                tensor_stage[out] = index
                stage.produced.add(out)
    return [stages[k] for k in sorted(stages)]


def largest_stage_bytes(model) -> int:
    """The most weight bytes one stage reads: what a layered run holds at once."""
    sizes = {init.name: stored_bytes(init) for init in model.graph.initializer}
    return max((sum(sizes[n] for n in stage.initializers) for stage in cut(model)), default=0)


class LayeredGraph:
    """An fp32 graph file, run stage by stage (see the module doc): ``get_inputs`` as an ONNX
    Runtime session's, ``run_each`` over many inputs at once (one reading of the weights for all)."""

    def __init__(self, path: Path, threads: int | None = None):
        self.path, self.threads = Path(path), threads
        self.model = load_graph(self.path)
        self.stages = cut(self.model)
        self._inits = {i.name: i for i in self.model.graph.initializer}
        self._value_info = {v.name: v for v in self.model.graph.value_info}

    def get_inputs(self) -> list[InputInfo]:
        return [InputInfo(value.name, [d.dim_value if d.HasField("dim_value") else d.dim_param
                                       for d in value.type.tensor_type.shape.dim])
                for value in self.model.graph.input]

    def run_each(self, names: Iterable[str], feeds: Iterable[dict],
                 progress: Callable[[int], None] = lambda n: None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Yields (feed index, {name: value}) for the tensors ``names`` as each stage computes them:
        a stage's values for every feed before the next stage's. ``progress(1)`` after each stage."""
        wanted = set(names)
        env = [dict(feed) for feed in feeds]
        later: list[set[str]] = [set() for _ in self.stages]  # what the stages after each one read
        for k in range(len(self.stages) - 2, -1, -1):
            later[k] = later[k + 1] | set(self.stages[k + 1].inputs)
        for k, stage in enumerate(self.stages):
            outputs = sorted(t for t in stage.produced if t in later[k] or t in wanted)
            if outputs and env:
                session = self._session(stage, outputs, env[0])
                for i, values in enumerate(env):
                    got = dict(zip(outputs, session.run(outputs, {n: values[n] for n in stage.inputs})))
                    values.update((n, v) for n, v in got.items() if n in later[k])
                    for name in [n for n in values if n not in later[k]]:
                        del values[name]
                    found = {n: v for n, v in got.items() if n in wanted}
                    if found:
                        yield i, found
                del session
            progress(1)

    def _session(self, stage: Stage, outputs: list[str], example: dict):
        import onnxruntime as ort
        from onnx import helper

        from llmx.runtime.onnx_backend import session_options

        inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(example[n]).dtype), None)
                  for n in stage.inputs]
        graph = helper.make_graph(
            stage.nodes, f"{self.model.graph.name}-stage{stage.index}", inputs,
            [helper.make_empty_tensor_value_info(n) for n in outputs],
            [self._inits[n] for n in stage.initializers],
            value_info=[self._value_info[n] for n in stage.produced if n in self._value_info and n not in outputs])
        model = helper.make_model(graph, opset_imports=self.model.opset_import, functions=self.model.functions)
        model.ir_version = IR_VERSION
        # From bytes, its tensors read from the source's directory: nothing is written beside a
        # source artifact. Unpacked: the kernels read the mapped weights, so a stage holds its
        # layer once (a pass reads each layer once; packing would copy it for that one pass).
        options = session_options(self.threads, prepack=False)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(self.path.parent))
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
