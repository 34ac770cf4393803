"""``llmx export model.gguf``: a GGUF file becomes an artifact like a checkpoint directory does.

    GGUF --> config + fp32 weights --> torch Decoder --> prefill/decode ONNX (fp32)
                                                           |
     Q8_0/Q4_0/Q4_1 blocks (gguf_blocks) --> MatMulNBits --+--> artifact (w8 / w4 / fp32)

Every tensor is dequantized for the torch export; then each linear layer whose GGUF tensors
are all Q8_0, or all Q4_0/Q4_1, gets its MatMul swapped for MatMulNBits holding the file's
own blocks, so the artifact computes with exactly the weights llama.cpp would (no second
rounding). Other types (K-quants, F16, ...) stay as their float32 dequantization and the
manifest says so.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from llmx.export.gguf import GGUFSource, open_gguf, unpermute_rows
from llmx.artifact.manifest import Manifest, Precision, sha256_file
from llmx.export.gguf_blocks import BITS, from_gguf
from llmx.export.manifest import with_export_lineage
from llmx.quant_blocks import CPU_ACCURACY_LEVEL, Blocks, concat_rows, replace_matmuls

# llmx linear weight -> the GGUF tensors stacked along its output axis.
LINEAR_SOURCES = {
    "layers.{i}.attn.qkv.weight": ("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight", "blk.{i}.attn_v.weight"),
    "layers.{i}.attn.o.weight": ("blk.{i}.attn_output.weight",),
    "layers.{i}.mlp.up.weight": ("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"),
    "layers.{i}.mlp.down.weight": ("blk.{i}.ffn_down.weight",),
}
ACCURACY_LEVEL = CPU_ACCURACY_LEVEL  # as `calibrate --scheme w8/w4`: the CPU kernel multiplies in int8 (what llama.cpp does too)


def export_gguf(
    path: Path,
    out: str | Path,
    *,
    verify: bool = False,
    all_logits: bool = False,
    force: bool = False,
    log: Callable[[str], None] = lambda msg: None,
) -> Manifest:
    """Export the GGUF file ``path`` to an artifact directory; returns its manifest."""
    from llmx.artifact.staging import finish, staged_artifact
    from llmx.export.checkpoint import build_model, map_weights
    from llmx.export.onnx_export import traced_decoder_manifest
    from llmx.export.gguf_tokenizer import package_gguf_tokenizer
    from llmx.spec import spec_from_hf_config

    source = open_gguf(path)
    spec = spec_from_hf_config(source.config())
    log(f"loading {spec.family} weights from GGUF {path.name} ({spec.num_layers} layers, hidden {spec.hidden_size})")
    model = build_model(spec, map_weights(spec, source.hf_weights(spec.num_heads, spec.num_kv_heads)))
    blocks = quantized_linears(source, spec)
    with staged_artifact(out, overwrite=force) as tmp, tempfile.TemporaryDirectory(prefix="llmx-gguf-") as scratch:
        tokenizer = package_gguf_tokenizer(source.field, tmp)
        log("exporting prefill and decode graphs")
        fp32_dir = Path(scratch) if blocks else tmp
        manifest = traced_decoder_manifest(model, fp32_dir, tokenizer, all_logits)
        if verify:
            from llmx.export.verify import verify_export

            log("verifying ONNX Runtime against PyTorch (float32 graphs)")
            manifest.extras["verify"] = verify_export(model, fp32_dir)
        if blocks:
            log(f"MatMulNBits from the GGUF's own blocks for {len(blocks)} weights")
            manifest.graphs, manifest.precision = _write_quantized(fp32_dir, tmp, blocks)
        manifest = with_export_lineage(manifest, str(path), format="gguf")
        manifest.extras["gguf"] = _record(source, blocks)
        if dequantized := manifest.extras["gguf"]["dequantized"]:
            log("dequantized to float32: " + ", ".join(f"{name} ({kind})" for name, kind in dequantized.items()))
        finish(tmp, manifest)
    return manifest


def quantized_linears(source: GGUFSource, spec) -> dict[str, Blocks]:
    """llmx weight name -> MatMulNBits blocks, for linears whose GGUF tensors all have one bit width."""
    found: dict[str, Blocks] = {}
    for i in range(spec.num_layers):
        for ours, theirs in LINEAR_SOURCES.items():
            if (b := _blocks(source, [t.format(i=i) for t in theirs], spec)) is not None:
                found[ours.format(i=i)] = b
    head = "output.weight" if "output.weight" in source.tensors else "token_embd.weight"
    if (b := _blocks(source, [head], spec)) is not None:
        found["lm_head.weight"] = b
    return found


def _blocks(source: GGUFSource, names: list[str], spec) -> Blocks | None:
    tensors = [source.tensors[n] for n in names if n in source.tensors]
    types = {t.tensor_type.name for t in tensors}
    if len(tensors) != len(names) or not types <= set(BITS) or len({BITS[t] for t in types}) != 1:
        return None
    parts = []
    for name, tensor in zip(names, tensors):
        blocks = from_gguf(tensor.data, tensor.tensor_type.name)
        if (heads := source.row_heads(name, spec.num_heads, spec.num_kv_heads)) is not None:
            blocks = blocks.rows(unpermute_rows(np.arange(blocks.n), heads))
        parts.append(blocks)
    return concat_rows(parts)


def _write_quantized(fp32_dir: Path, tmp: Path, blocks: dict[str, Blocks]):
    from llmx.artifact.onnx_files import describe_graph, load_graph, save_graphs

    by_name = {f"model.{k}": v for k, v in blocks.items()} | blocks  # the exporter may prefix "model."
    graphs = {}
    for name in ("prefill", "decode"):
        graphs[name] = load_graph(fp32_dir / f"{name}.onnx")
        by_initializer = {weight: b.initializers(weight) for weight, b in by_name.items()}
        if len(replace_matmuls(graphs[name], by_initializer, ACCURACY_LEVEL)) != len(blocks):
            raise RuntimeError(f"{name}.onnx: not every quantized GGUF weight was found as a MatMul weight")
    save_graphs(graphs, tmp, sources={name: fp32_dir for name in graphs})
    described = {name: describe_graph(g, f"{name}.onnx", ops="onnxruntime") for name, g in graphs.items()}
    bits = {b.bits for b in blocks.values()}
    # extras["gguf"] says these blocks are the file's own (not requantized).
    precision = Precision(weights="int4" if 4 in bits else "int8", activations="float32",
                          scheme="w4" if 4 in bits else "w8", block_size=32,
                          symmetric=all(b.zero_points is None for b in blocks.values()), accuracy_level=ACCURACY_LEVEL)
    return described, precision


def _record(source: GGUFSource, blocks: dict[str, Blocks]) -> dict:
    """The manifest's record of the GGUF: file, checksum, tensor types, what stayed quantized."""
    quantized = set()
    for ours in blocks:
        quantized.update(_gguf_names(ours, source))
    dequantized = {n: t.tensor_type.name for n, t in source.tensors.items()
                   if n not in quantized and t.tensor_type.name not in ("F32",)}
    return {"file": source.path.name, "sha256": sha256_file(source.path), "architecture": source.architecture,
            "tensor_types": source.quant_types(), "kept_quantized": len(quantized),
            "dequantized": dequantized}


def _gguf_names(ours: str, source: GGUFSource) -> list[str]:
    if ours == "lm_head.weight":
        return ["output.weight" if "output.weight" in source.tensors else "token_embd.weight"]
    layer, _, rest = ours.partition(".")[2].partition(".")
    pattern = LINEAR_SOURCES[f"layers.{{i}}.{rest}"]
    return [p.format(i=layer) for p in pattern]
