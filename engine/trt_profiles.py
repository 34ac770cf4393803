"""The engines a build produces for a layout, and their optimization profiles.

The shapes themselves (limits, axis ranges, one profile per graph) are the contract's
(llmx/artifact/tensorrt.py): the runtime configures ONNX Runtime's TensorRT provider from the same
functions. Layouts, to be chosen by measurement on the GPU (benchmarks/gpu_bench.py runs both):

- ``split``: prefill.engine from the prefill graph (whole prompt, last-position logits only)
  and decode.engine from the decode graph; simplest data path, but the weights are on the
  device twice.
- ``shared``: one engine from the decode graph with two profiles: profile 0 takes prompt
  chunks (prefill is decode into an empty cache), profile 1 takes decode steps; one copy of
  the weights, two execution contexts. Prefill then computes logits for every prompt
  position, so prompts go in chunks that bound that buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmx.artifact.tensorrt import LAYOUTS, BuildLimits, ProfileSpec, axis_ranges, graph_profile
from llmx.errors import ArtifactError, InputError
from llmx.artifact.manifest import Manifest


@dataclass
class EngineSpec:
    name: str  # "prefill" | "decode" | "model"
    graph: str  # the manifest graph it is built from
    file: str
    profiles: list[ProfileSpec] = field(default_factory=list)


def engine_specs(manifest: Manifest, limits: BuildLimits, layout: str) -> list[EngineSpec]:
    """The engines (and their profiles) a build produces for ``layout``."""
    for name in ("prefill", "decode"):
        if name not in manifest.graphs:
            raise ArtifactError(f"artifact has no {name} graph")
    decode = manifest.graphs["decode"]
    if layout == "split":
        prefill = manifest.graphs["prefill"]
        return [
            EngineSpec("prefill", "prefill", "prefill.engine", [graph_profile("prefill", prefill, axis_ranges("prefill", limits))]),
            EngineSpec("decode", "decode", "decode.engine", [graph_profile("decode", decode, axis_ranges("decode", limits))]),
        ]
    if layout == "shared":
        return [EngineSpec("model", "decode", "model.engine", [
            graph_profile("prefill", decode, axis_ranges("prefill_chunks", limits)),
            graph_profile("decode", decode, axis_ranges("decode", limits)),
        ])]
    raise InputError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
