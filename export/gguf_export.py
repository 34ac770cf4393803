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

from llmx.artifact.manifest import Manifest, sha256_file

AS_STORED = "gguf"  # the precision a GGUF exports at by default: its own blocks


def gguf_export_options(checkpoint, graphs: str | None, precision: str | None, verify: bool) -> tuple[str, str]:
    """(graphs, precision) for exporting GGUF ``checkpoint`` (``stored_blocks_options``)."""
    from llmx.export.checkpoint import stored_blocks_options

    return stored_blocks_options(checkpoint, graphs, precision, verify, source="GGUF", label=AS_STORED,
                                 quantized=_types(quantized_linears(checkpoint)))


def quantized_linears(checkpoint) -> Counter:
    """GGUF type -> count of the file's quantized tensors (its float ones excluded)."""
    from llmx.export.gguf import FLOAT_TYPES

    return Counter({kind: n for kind, n in checkpoint.reader.source.quant_types().items() if kind not in FLOAT_TYPES})


def gguf_record(checkpoint) -> dict:
    """The manifest's record of the GGUF: file, checksum, tensor types, and what became of each type."""
    from llmx.export.gguf import FLOAT_TYPES

    tensors = checkpoint.reader
    types = tensors.source.quant_types()
    kept = Counter(tensors.kept.values())
    errors: dict[str, list[float]] = {}  # type -> the requantized tensors' errors
    for name, err in tensors.requantized.items():
        errors.setdefault(tensors.kept[name], []).append(err)
    became = {}
    for kind, count in sorted(types.items()):
        exact = kept[kind] - len(errors.get(kind, []))
        parts = [f"{exact} kept in their blocks (MatMulNBits)"] if exact else []
        if kind in errors:
            parts.append(f"{len(errors[kind])} requantized to 4-bit blocks (max relative RMS error "
                         f"{max(errors[kind]):.2e})")
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
    from llmx.export.gguf import GGUFTensors

    return isinstance(checkpoint.reader, GGUFTensors)


def package_gguf(checkpoint, tmp: Path) -> dict:
    from llmx.export.gguf_tokenizer import package_gguf_tokenizer

    return package_gguf_tokenizer(checkpoint.reader.source.field, tmp)
