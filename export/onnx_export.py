"""Tracing llmx's Decoder into the prefill and decode ONNX graphs.

We use torch's dynamo exporter (the default in torch 2.13; the TorchScript exporter is
deprecated). It keeps parameter names on initializers, which lets both graphs share one
weights file and lets later stages find weights by name. tests/test_export.py pins this.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path

import torch

from llmx.export.modules import Decoder, DecodeGraph, PrefillGraph
from llmx.logits_to_keep import add_to_decode_graph
from llmx.artifact.manifest import Manifest
from llmx.artifact.onnx_files import describe_graph, load_graph, save_graphs
from llmx.export.manifest import decoder_manifest
from llmx.weight_names import graph_name, model_weights

OPSET = 20

# Example sizes for tracing: all different and > 1, so no dynamic axis gets specialized.
_B, _S, _T, _L, _C = 2, 5, 3, 7, 11


def past_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def _export(module: torch.nn.Module, args: tuple, path: Path, inputs, outputs, dynamic_shapes) -> None:
    with warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=OPSET,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=dynamic_shapes,
            verbose=False,
        )
        program.save(str(path), external_data=True)


class _quiet_exporter:
    """The exporter logs progress lines with emoji through logging and print; keep the CLI clean."""

    def __enter__(self):
        import contextlib
        import io

        self._redirect = contextlib.redirect_stdout(io.StringIO())
        self._redirect.__enter__()
        self._level = logging.getLogger("torch.onnx").level
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)

    def __exit__(self, *exc):
        logging.getLogger("torch.onnx").setLevel(self._level)
        self._redirect.__exit__(*exc)


def export_decoder(model: Decoder, out_dir: Path, all_logits: bool = False) -> dict[str, "onnx.ModelProto"]:
    """Export prefill.onnx and decode.onnx into ``out_dir`` (sharing weights.bin)."""
    spec = model.spec
    n = spec.num_layers
    kv_shape = (_B, spec.num_kv_heads, _C, spec.head_dim)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    new, total, capacity = torch.export.Dim("new_tokens"), torch.export.Dim("total_length"), torch.export.Dim("capacity")
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ids = torch.randint(0, spec.vocab_size, (_B, _S))
        mask = torch.ones(_B, _S, dtype=torch.int64)
        pos = torch.arange(_S).expand(_B, _S).contiguous()
        by_batch_seq = {0: batch, 1: seq}
        _export(
            PrefillGraph(model, all_logits),
            (ids, mask, pos),
            tmp / "prefill.onnx",
            ["input_ids", "attention_mask", "position_ids"],
            ["logits", *present_names(n)],
            {"input_ids": by_batch_seq, "attention_mask": by_batch_seq, "position_ids": by_batch_seq},
        )
        past = tuple(torch.zeros(kv_shape) for _ in range(2 * n))
        ids = torch.randint(0, spec.vocab_size, (_B, _T))
        mask = torch.ones(_B, _L, dtype=torch.int64)
        pos = (torch.arange(_T) + _L - _T).expand(_B, _T).contiguous()
        _export(
            DecodeGraph(model),
            (ids, mask, pos, *past),
            tmp / "decode.onnx",
            ["input_ids", "attention_mask", "position_ids", *past_names(n)],
            ["logits", *present_names(n)],
            {
                "input_ids": {0: batch, 1: new},
                "attention_mask": {0: batch, 1: total},
                "position_ids": {0: batch, 1: new},
                "past": tuple({0: batch, 2: capacity} for _ in past),
            },
        )
        graphs = {name: load_graph(tmp / f"{name}.onnx") for name in ("prefill", "decode")}
        for graph in graphs.values():
            _strip_metadata(graph)
        # An ONNX post-pass, not a torch input: slicing by a traced scalar is data-dependent
        # shape that the dynamo exporter refuses.
        add_to_decode_graph(graphs["decode"], graph_name(model_weights(spec)["lm_head"]))
        save_graphs(graphs, out_dir, sources={name: tmp for name in graphs})
    return graphs


def traced_decoder_manifest(model: Decoder, out_dir: Path, tokenizer: dict, all_logits: bool) -> Manifest:
    """Trace prefill and decode into ``out_dir``; the decoder artifact's manifest (no lineage yet)."""
    export_decoder(model, out_dir, all_logits=all_logits)
    graphs = {name: describe_graph(load_graph(out_dir / f"{name}.onnx"), f"{name}.onnx") for name in ("prefill", "decode")}
    return decoder_manifest(model.spec, graphs, tokenizer)


def _strip_metadata(model) -> None:
    # The exporter records each node's Python stack trace and module path: large, and it
    # leaks local file paths into artifacts that get shipped.
    for node in model.graph.node:
        del node.metadata_props[:]
    del model.metadata_props[:]
