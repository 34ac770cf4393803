"""Tracing llmx's Decoder into the prefill and decode ONNX graphs.

We use torch's dynamo exporter (the default in torch 2.13; the TorchScript exporter is
deprecated). It keeps parameter names on initializers, which lets both graphs share one
weights file and lets later stages find weights by name. tests/test_export.py pins this.

The trace needs no weights (``export_streamed``):

    checkpoint --stream_weights--> weights.bin (fp32, one tensor at a time)
    ModelSpec --Decoder with fake parameters--> torch.export --> ONNX IR (initializers fake)
        initializers <- weights.bin by name (memory-mapped) --> the exporter's optimizer --> graphs

The parameters are FakeTensors (shapes and dtypes, no storage); the RoPE buffers stay real. The
exporter's optimizer runs only after every parameter's initializer points into weights.bin, so it
folds and de-duplicates on the real values, as it does on a loaded model, reading (mapping) only
the small tensors it folds or compares: the graphs are those ``export_decoder`` makes from a loaded
model and the weights are the loader's bit for bit (tests/test_streaming.py).
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from llmx.artifact.manifest import Manifest
from llmx.artifact.onnx_files import describe_graph, load_graph, save_graphs
from llmx.errors import ArtifactError
from llmx.export.checkpoint import Checkpoint, parameters_on_meta
from llmx.export.manifest import decoder_manifest
from llmx.export.modules import Decoder, DecodeGraph, PrefillGraph
from llmx.export.streaming import StreamedWeights, stream_weights
from llmx.export.tracing import quiet_exporter, strip_metadata, trace
from llmx.logits_to_keep import add_to_decode_graph
from llmx.low_precision import convert_graph, lowered_precision
from llmx.spec import ModelSpec
from llmx.weight_names import graph_name, model_weights

GRAPHS = ("prefill", "decode")

# Example sizes for tracing: all different and > 1, so no dynamic axis gets specialized.
_B, _S, _T, _L, _C = 2, 5, 3, 7, 11


def past_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def _graph_calls(model: Decoder, all_logits: bool) -> Iterator[tuple[str, torch.nn.Module, tuple, list, list, dict]]:
    """(graph, module, example args, input names, output names, dynamic shapes) of prefill, then decode."""
    spec = model.spec
    n = spec.num_layers
    kv_shape = (_B, spec.num_kv_heads, _C, spec.head_dim)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    new, total, capacity = torch.export.Dim("new_tokens"), torch.export.Dim("total_length"), torch.export.Dim("capacity")
    ids = torch.randint(0, spec.vocab_size, (_B, _S))
    mask = torch.ones(_B, _S, dtype=torch.int64)
    pos = torch.arange(_S).expand(_B, _S).contiguous()
    by_batch_seq = {0: batch, 1: seq}
    yield (
        "prefill",
        PrefillGraph(model, all_logits),
        (ids, mask, pos),
        ["input_ids", "attention_mask", "position_ids"],
        ["logits", *present_names(n)],
        {"input_ids": by_batch_seq, "attention_mask": by_batch_seq, "position_ids": by_batch_seq},
    )
    past = tuple(torch.zeros(kv_shape) for _ in range(2 * n))
    ids = torch.randint(0, spec.vocab_size, (_B, _T))
    mask = torch.ones(_B, _L, dtype=torch.int64)
    pos = (torch.arange(_T) + _L - _T).expand(_B, _T).contiguous()
    yield (
        "decode",
        DecodeGraph(model),
        (ids, mask, pos, *past),
        ["input_ids", "attention_mask", "position_ids", *past_names(n)],
        ["logits", *present_names(n)],
        {
            "input_ids": {0: batch, 1: new},
            "attention_mask": {0: batch, 1: total},
            "position_ids": {0: batch, 1: new},
            "past": tuple({0: batch, 2: capacity} for _ in past),
        },
    )


def export_decoder(model: Decoder, out_dir: Path, all_logits: bool = False) -> dict[str, "onnx.ModelProto"]:
    """Export prefill.onnx and decode.onnx of a loaded ``model`` into ``out_dir`` (sharing weights.bin)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, *call in _graph_calls(model, all_logits):
            trace(*call).save(str(tmp / f"{name}.onnx"), external_data=True)
        graphs = {name: load_graph(tmp / f"{name}.onnx") for name in GRAPHS}
        _finish(graphs, model.spec)
        save_graphs(graphs, out_dir, sources={name: tmp for name in graphs})
    return graphs


def export_streamed(spec: ModelSpec, tensors: Mapping[str, "torch.Tensor"], out_dir: Path, all_logits: bool = False,
                    log: Callable[[str], None] = lambda msg: None, low_dtype: str | None = None) -> dict[str, "onnx.ModelProto"]:
    """The graphs ``export_decoder`` writes, traced without loading the model: the weights
    streamed from ``tensors`` (``Checkpoint.tensors()``) into ``out_dir``/weights.bin, the trace on fake parameters.

    ``low_dtype`` (float16 | bfloat16): the graphs ``llmx build`` would lower the fp32 ones to
    (llmx/low_precision.py), with the weights stored in that dtype as they stream past, so no
    fp32 copy of them is ever written.
    """
    weights = stream_weights(spec, tensors, out_dir, low_dtype=low_dtype)
    log("exporting prefill and decode graphs")
    model = fake_decoder(spec)
    graphs = {}
    for name, *call in _graph_calls(model, all_logits):
        program = trace(*call, optimize=False)
        _attach_weights(program.model, weights)
        with warnings.catch_warnings(), quiet_exporter():
            warnings.simplefilter("ignore")
            program.optimize()  # what torch.onnx.export(optimize=True) runs, now on the real values
        _detach_lowered(program.model, weights)
        graphs[name] = ir.serde.serialize_model(program.model)
        _release(program.model)
    _finish(graphs, spec)
    if low_dtype is not None:
        for name, graph in graphs.items():
            log(f"lowering the {name} graph to {low_dtype} (norms, softmax and position math stay float32)")
            convert_graph(graph, low_dtype, base_dir=out_dir, lowered=weights.lowered)
    save_graphs(graphs, out_dir, append=True)
    return graphs


def fake_decoder(spec: ModelSpec) -> Decoder:
    """llmx's Decoder for ``spec`` with FakeTensor parameters (shape and dtype, no storage) and
    real buffers (the RoPE frequencies, which no checkpoint holds)."""
    with parameters_on_meta():
        model = Decoder(spec)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                with mode:
                    fake = torch.empty(param.shape, dtype=param.dtype)
                module._parameters[name] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
    return model.eval()


def _attach_weights(model: ir.Model, weights: StreamedWeights) -> None:
    """Point each fake initializer at its streamed tensor (memory-mapped from weights.bin, or
    inline); a weight stored lowered is read back as float32 only if the optimizer asks for it."""
    for name, value in model.graph.initializers.items():
        if name in weights.lowered:
            stored = ir.serde.deserialize_tensor(weights.lowered[name], base_path=str(weights.root))
            tensor = ir.LazyTensor(lambda stored=stored: ir.Tensor(stored.numpy().astype("float32")),
                                   ir.DataType.FLOAT, stored.shape, name=name)
        elif name in weights.tensors:
            tensor = ir.serde.deserialize_tensor(weights.tensors[name], base_path=str(weights.root))
            if tuple(tensor.shape) != tuple(value.const_value.shape) or tensor.dtype != value.const_value.dtype:
                raise ArtifactError(f"internal error: streamed {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                                    f"the trace's {value.const_value.dtype} {tuple(value.const_value.shape)}")
            value.const_value = tensor
        elif isinstance(getattr(value.const_value, "raw", None), FakeTensor):
            raise ArtifactError(f"internal error: the trace's initializer {name} is no streamed weight")


def _detach_lowered(model: ir.Model, weights: StreamedWeights) -> None:
    """Lowered weights leave the graph as data-less float32 references, which the lowering pass
    replaces with the stored ones: serializing their float32 view would write the whole model."""
    for name, value in model.graph.initializers.items():
        if name in weights.lowered:
            value.const_value = ir.ExternalTensor(f"{name}.not-written", 0, 0, ir.DataType.FLOAT,
                                                  shape=value.const_value.shape, name=name)


def _release(model: ir.Model) -> None:
    # Unmap weights.bin: the optimizer mapped the tensors it read.
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value.release()


def _finish(graphs: dict[str, "onnx.ModelProto"], spec: ModelSpec) -> None:
    for graph in graphs.values():
        strip_metadata(graph)
    # An ONNX post-pass, not a torch input: slicing by a traced scalar is data-dependent
    # shape that the dynamo exporter refuses.
    add_to_decode_graph(graphs["decode"], graph_name(model_weights(spec)["lm_head"]))


def traced_decoder_manifest(model: Decoder, out_dir: Path, tokenizer: dict, all_logits: bool) -> Manifest:
    """Trace prefill and decode of a loaded ``model`` into ``out_dir``; the artifact's manifest (no lineage yet)."""
    export_decoder(model, out_dir, all_logits=all_logits)
    return _manifest(model.spec, out_dir, tokenizer)


def streamed_decoder_manifest(checkpoint: Checkpoint, out_dir: Path, tokenizer: dict, all_logits: bool,
                              log: Callable[[str], None] = lambda msg: None, low_dtype: str | None = None) -> Manifest:
    """Trace prefill and decode with the weights streamed from ``checkpoint``; the manifest (no lineage yet)."""
    export_streamed(checkpoint.spec, checkpoint.tensors(), out_dir, all_logits=all_logits, log=log,
                    low_dtype=low_dtype)
    manifest = _manifest(checkpoint.spec, out_dir, tokenizer)
    if low_dtype is None:
        return manifest
    # What `llmx build --precision fp16|bf16` records for the graphs it lowers.
    return dataclasses.replace(manifest, kv=dataclasses.replace(manifest.kv, dtype=low_dtype),
                               precision=lowered_precision(manifest.precision, low_dtype))


def _manifest(spec: ModelSpec, out_dir: Path, tokenizer: dict) -> Manifest:
    graphs = {name: describe_graph(load_graph(out_dir / f"{name}.onnx"), f"{name}.onnx") for name in GRAPHS}
    return decoder_manifest(spec, graphs, tokenizer)
