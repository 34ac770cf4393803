"""``llmx optimize``: a portable artifact in, an ONNX Runtime artifact with fused graphs out.

The new artifact has the same graph names, inputs and outputs, KV layout, tokenizer and
precision as its source; its graphs use ONNX Runtime's fused CPU/CUDA kernels (``ops:
"onnxruntime"`` in the manifest) and it gets an ``optimize`` lineage entry. The source stays
as it was: it is the portable one that TensorRT and other runtimes read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from llmx.artifact.handle import Artifact
from llmx.artifact.manifest import Manifest
from llmx.artifact.onnx_files import describe_graph, save_graphs
from llmx.artifact.staging import copy_tokenizer, finish, staged_artifact
from llmx.errors import ArtifactError, InputError
from llmx.spec import ModelSpec
from llmx.fused.decoder import ACTIVATIONS, build_graph, check_supported
from llmx.optimize.weights import SourceWeights
from llmx.weight_names import graph_name, model_weights

GRAPHS = ("prefill", "decode")
FUSIONS = [
    "SimplifiedLayerNormalization/SkipSimplifiedLayerNormalization (LayerNorm: SkipLayerNormalization)",
    "GroupQueryAttention with rotary and in-place KV cache",
    "RotaryEmbedding (prefill)",
    "fused activations (QuickGelu as SiLU, FastGelu, Gelu)",
    "projection biases folded into the next skip-norm",
    "MoE (com.microsoft) for sparse expert layers",
]


def check_source(src: Artifact) -> ModelSpec:
    """The source must be a portable fp32 decoder artifact with both graphs."""
    manifest = src.manifest
    if manifest.kind != "decoder":
        raise InputError(f"{src.root} holds a {manifest.kind} model; optimize works on decoders")
    if manifest.stage_applied("optimize") or any(g.ops != "portable" for g in manifest.graphs.values()):
        raise InputError(f"{src.root} is already optimized for ONNX Runtime; optimize the portable artifact it came from")
    scheme, weights = manifest.precision.scheme, manifest.precision.weights
    if scheme or weights != "float32":
        raise InputError(f"{src.root} is quantized ({scheme or weights}); run optimize before calibrate")
    missing = [name for name in GRAPHS if name not in manifest.graphs]
    if missing:
        raise ArtifactError(f"{src.root} has no {' or '.join(missing)} graph")
    for name in GRAPHS:
        src.existing_file(manifest.graphs[name].file, f"graphs.{name}.file")
    spec = manifest.model
    check_supported(spec)
    return spec


def optimize_artifact(src: str | Path | Artifact, out: str | Path, *, force: bool = False,
                      log: Callable[[str], None] = lambda msg: None) -> Manifest:
    """Write the ONNX Runtime artifact for the portable artifact ``src`` to ``out``."""
    src = Artifact.of(src)
    manifest = src.manifest
    spec = check_source(src)
    if Path(out).absolute() == src.root.absolute():
        raise InputError("the optimized artifact needs its own directory (-o must differ from the source)")
    all_logits = manifest.graphs["prefill"].outputs[0].shape[1] != 1
    log(f"building fused graphs for {spec.family} ({spec.num_layers} layers, {spec.activation}, {spec.norm} norm)")
    weights = SourceWeights(src.root, manifest.graphs["decode"].file)
    # A tied table, which the portable graphs hold twice (the lookup's and the head's), once.
    names = {role: graph_name(name) for role, name in model_weights(spec).items()}
    weights.lookup_from_head = spec.tie_word_embeddings and spec.logits_scale == 1.0 and "lm_head" in names \
        and weights.head_holds_table(names["embed"], names["lm_head"], spec.embed_scale)
    graphs = {name: build_graph(spec, weights, name, manifest.graphs[name], all_logits) for name in GRAPHS}
    with staged_artifact(out, overwrite=force) as tmp:
        save_graphs(graphs, tmp, sources={name: src.root for name in GRAPHS})
        copy_tokenizer(src.root, tmp)
        described = {name: describe_graph(graphs[name], f"{name}.onnx", ops="onnxruntime") for name in GRAPHS}
        for name, spec_io in described.items():
            _check_same_io(name, manifest.graphs[name], spec_io)
        for graph in described.values():
            # Measured: ORT's extended/all passes change nothing in these graphs' speed and add ~0.2 s
            # (of ~0.75 s) to loading them; the runtime takes this level unless told otherwise.
            graph.ort_optimization = "basic"
        result = dataclasses.replace(manifest, graphs=described, checksums={}, extras=dict(manifest.extras))
        result = result.with_stage(
            "optimize",
            source=str(src.root.absolute()),
            target="onnxruntime",
            attention="com.microsoft.GroupQueryAttention",
            activation=ACTIVATIONS[spec.activation][0],
            fusions=FUSIONS,
        )
        finish(tmp, result)
    log(f"wrote {out}")
    return result


def _check_same_io(name: str, before, after) -> None:
    """The fused graph must be a drop-in replacement: same names, dtypes and shapes, in order."""
    def io(g):
        return [(t.name, t.dtype, list(t.shape)) for t in (*g.inputs, *g.outputs)]

    if io(before) != io(after):
        raise ArtifactError(f"internal error: optimized {name} graph changed its inputs or outputs")
