"""``llmx export --graphs fused``: ONNX Runtime's fused graphs written straight from the checkpoint.

    checkpoint --stream_weights--> weights.bin (fp32, or w8/w4 blocks)
    ModelSpec  --build_graph-----> prefill.onnx, decode.onnx (the graphs `llmx optimize` writes)

No torch model and no trace: the graphs come from the ModelSpec (llmx/fused/), the weights
from the checkpoint one tensor at a time (export/streaming.py). The result is the
artifact ``llmx export`` + ``llmx optimize`` make (and, with ``--precision w8|w4``, + ``llmx
calibrate --no-search``), without the fp32 model in memory or an fp32 artifact on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from llmx.artifact.manifest import Manifest, Precision
from llmx.artifact.onnx_files import describe_graph, save_graphs
from llmx.compact_blocks import REBUILT, expand_in_graph
from llmx.errors import ArtifactError
from llmx.export.checkpoint import Checkpoint
from llmx.export.manifest import FP32, decoder_io, decoder_manifest, with_export_lineage
from llmx.export.streaming import Quantization, stream_weights
from llmx.fused.decoder import ACTIVATIONS, build_graph, check_supported
from llmx.quant_blocks import BITS, CPU_ACCURACY_LEVEL, replace_matmuls, stored_precision, weight_only_precision

GRAPHS = ("prefill", "decode")
PRECISIONS = ("fp32", "w8", "w4")


def export_fused(checkpoint: Checkpoint, tmp: Path, tokenizer: dict, *, all_logits: bool, precision: str,
                 block_size: int, log: Callable[[str], None]) -> Manifest:
    """Write the fused prefill/decode graphs and their streamed weights into ``tmp``; returns the manifest."""
    spec = checkpoint.spec
    check_supported(spec)
    quantization = Quantization(BITS[precision], block_size) if precision in BITS else None
    log(f"streaming {spec.family} weights ({spec.num_layers} layers, hidden {spec.hidden_size}) "
        f"from {checkpoint.path} as {precision}" + (f" (blocks of {block_size})" if quantization else ""))
    weights = stream_weights(spec, checkpoint.tensors(), tmp, quantization, stored=checkpoint.stored_blocks,
                             lookup_from_head=True)
    log("writing fused prefill and decode graphs")
    io = decoder_io(spec, all_logits)
    graphs = {name: build_graph(spec, weights, name, io[name], all_logits) for name in GRAPHS}
    for name, graph in graphs.items():
        if weights.quantized and len(replace_matmuls(graph, weights.quantized, CPU_ACCURACY_LEVEL)) != len(weights.quantized):
            raise ArtifactError(f"internal error: {name}: not every quantized weight feeds a MatMul")
        expand_in_graph(graph, weights.rebuilt)
    save_graphs(graphs, tmp, append=True)
    described = {name: describe_graph(graphs[name], f"{name}.onnx", ops="onnxruntime") for name in GRAPHS}
    for name, graph in described.items():
        if [graph.inputs, graph.outputs] != [io[name].inputs, io[name].outputs]:
            raise ArtifactError(f"internal error: the fused {name} graph's inputs or outputs differ from the portable one's")
        # As `llmx optimize` marks its graphs: fused already, ORT's passes would only cost load time;
        # a quantized graph gets ORT's full level, as calibrate leaves it.
        graph.ort_optimization = None if weights.quantized else "basic"
    if quantization:
        section = weight_only_precision(precision, block_size, symmetric=True)
    elif weights.quantized:  # the source's own blocks (a GGUF, a GPTQ/AWQ checkpoint)
        section = stored_precision(weights.quantized)
    else:
        section = Precision(**FP32)
    manifest = decoder_manifest(spec, described, tokenizer, section)
    if weights.rebuilt:
        manifest.extras[REBUILT] = {"tensors": len(weights.rebuilt), "load_bytes": weights.rebuilt_load_bytes}
    details = dict(prefill_logits="all" if all_logits else "last", graphs="fused", streamed=True,
                   target="onnxruntime", attention="com.microsoft.GroupQueryAttention",
                   activation=ACTIVATIONS[spec.activation][0], precision=precision)
    if quantization:
        details.update(block_size=block_size, symmetric=True, quantized="round-to-nearest blocks as the weights "
                       "streamed past (calibrate --no-search's); no quality report: `llmx calibrate` measures one")
    elif weights.quantized:
        details.update(quantized="the source's own blocks, not rounded again (extras.gguf or extras.prequantized "
                       "says which)")
    return with_export_lineage(manifest, str(checkpoint.path), **details)
