"""``llmx export model.gguf``: a GGUF file streams into an artifact as a checkpoint directory does.

    GGUF (memory-mapped) --a tensor at a time--> iter_weights --> weights.bin
      quantized linears: the file's own blocks as MatMulNBits (export/gguf_blocks.py)
      norms, embeddings, float tensors: float32

The file reads as the Hugging Face checkpoint it was converted from (export/gguf.py: metadata
-> config.json, tensor names -> HF names, llama.cpp's q/k row permutation undone), so it goes
through the same ModelSpec table, weight rules and graph writers. By default a quantized file
keeps its blocks (no second rounding) in ONNX Runtime's fused graphs; ``--precision
fp32|fp16|bf16`` dequantizes every tensor instead (portable graphs too).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from llmx.artifact.manifest import Manifest, Precision, sha256_file
from llmx.errors import InputError
from llmx.quant_blocks import BITS, CPU_ACCURACY_LEVEL

AS_STORED = "gguf"  # the precision a GGUF exports at by default: its own blocks


def gguf_export_options(checkpoint, graphs: str | None, precision: str, verify: bool) -> tuple[str, str]:
    """(graphs, precision) for exporting GGUF ``checkpoint``; refuses what would round twice."""
    from llmx.fused.decoder import check_supported

    quantized = quantized_linears(checkpoint)
    if precision in BITS and quantized:
        raise InputError(f"this GGUF is already quantized ({_types(quantized)}); quantizing it again to "
                         f"{precision} would round twice: export it as it is (no --precision)")
    if precision == AS_STORED:
        if graphs == "portable" or verify:
            # Portable graphs hold no MatMulNBits; --verify compares fp32 graphs with PyTorch.
            return "portable", "fp32"
        if graphs is None:
            try:
                check_supported(checkpoint.spec)
            except Exception:  # noqa: BLE001 -- no fused kernel for this family: the traced graphs
                return "portable", "fp32"
        return "fused", AS_STORED if quantized else "fp32"
    return graphs or ("fused" if precision in BITS else "portable"), precision


def quantized_linears(checkpoint) -> Counter:
    """GGUF type -> count of the file's quantized tensors (its float ones excluded)."""
    from llmx.export.gguf import FLOAT_TYPES

    source = checkpoint.reader.source
    return Counter(t.tensor_type.name for t in source.tensors.values() if t.tensor_type.name not in FLOAT_TYPES)


def stored_precision(quantized: dict) -> Precision:
    """The precision section of fused graphs holding a GGUF's blocks (``StreamedWeights.quantized``)."""
    weights = [part for w in quantized.values() for part in (w.parts or [w])]
    bits = {w.bits for w in weights}
    sizes = Counter(w.block_size for w in weights)
    symmetric = all(len(w.tensors) == 2 and w.offsets is None for w in weights)  # no zero points, no offsets
    return Precision(weights="int4" if 4 in bits else "int8", scheme="w4" if 4 in bits else "w8",
                     block_size=sizes.most_common(1)[0][0], symmetric=symmetric, accuracy_level=CPU_ACCURACY_LEVEL)


def gguf_record(checkpoint) -> dict:
    """The manifest's record of the GGUF: file, checksum, tensor types, and what became of each type."""
    from llmx.export.gguf import FLOAT_TYPES

    tensors = checkpoint.reader
    types = Counter(t.tensor_type.name for t in tensors.source.tensors.values())
    kept = Counter(tensors.kept.values())
    requantized = {kind: max(err for name, err in tensors.requantized.items() if tensors.kept[name] == kind)
                   for kind in {tensors.kept[name] for name in tensors.requantized}}
    became = {}
    for kind, count in sorted(types.items()):
        exact = kept[kind] - sum(1 for n in tensors.requantized if tensors.kept[n] == kind)
        parts = [f"{exact} kept in their blocks (MatMulNBits)"] if exact else []
        if kind in requantized:
            parts.append(f"{kept[kind] - exact} requantized to 4-bit blocks (max relative RMS error "
                         f"{requantized[kind]:.2e})")
        if count - kept[kind]:
            parts.append(f"{count - kept[kind]} " + ("float32" if kind in FLOAT_TYPES else "dequantized to float32"))
        became[kind] = "; ".join(parts)
    return {"file": checkpoint.path.name, "sha256": sha256_file(checkpoint.path),
            "architecture": tensors.source.architecture, "tensor_types": dict(types), "became": became}


def summary(record: dict) -> str:
    """One log line: which types became what, with counts."""
    return "GGUF tensors: " + "; ".join(f"{kind} x{record['tensor_types'][kind]}: {what}"
                                         for kind, what in record["became"].items())


def finish_gguf_manifest(manifest: Manifest, checkpoint, log) -> Manifest:
    manifest.lineage[0].details["format"] = "gguf"
    manifest.extras["gguf"] = gguf_record(checkpoint)
    log(summary(manifest.extras["gguf"]))
    return manifest


def _types(counts: Counter) -> str:
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common())


def is_gguf(checkpoint) -> bool:
    return checkpoint.reader is not None and hasattr(checkpoint.reader, "source")


def package_gguf(checkpoint, tmp: Path) -> dict:
    from llmx.export.gguf_tokenizer import package_gguf_tokenizer

    return package_gguf_tokenizer(checkpoint.reader.source.field, tmp)
