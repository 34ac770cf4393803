"""The manifest an export writes: a decoder's graph IO, its KV layout and precision, and the
export's lineage entry (one way, ``Manifest.with_stage``, for every source format)."""

from __future__ import annotations

from typing import Any

from llmx import logits_to_keep
from llmx.artifact.manifest import GraphSpec, Manifest, Precision, TensorSpec
from llmx.spec import ModelSpec

KV_LAYOUT = {
    "layout": "batch,kv_heads,sequence,head_dim",
    "past": "past_key_values.{i}.{kv}",
    "present": "present.{i}.{kv}",
    "dtype": "float32",
    # A sequence's token at position p is stored in slot p. Decode scatters new entries at
    # position_ids, so past and present may (and should) be bound to the same buffer.
    "update": "scatter_at_position",
}
FP32 = {"weights": "float32", "activations": "float32", "scheme": None}


def decoder_manifest(spec: ModelSpec, graphs: dict[str, GraphSpec], tokenizer: dict,
                     precision: Precision | dict = FP32) -> Manifest:
    return Manifest(
        kind="decoder",
        model=spec.to_dict(),
        graphs=graphs,
        tokenizer=tokenizer,
        precision=precision if isinstance(precision, Precision) else dict(precision),
        kv={**KV_LAYOUT, "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
    )


def with_export_lineage(manifest: Manifest, source: str, **details: Any) -> Manifest:
    """``manifest`` with its one lineage entry: the export from ``source``."""
    manifest.lineage = []
    return manifest.with_stage("export", source=source, **details)


def decoder_io(spec: ModelSpec, all_logits: bool) -> dict[str, GraphSpec]:
    """prefill's and decode's inputs and outputs, as the traced (portable) graphs declare them."""
    kv_heads, head_dim, vocab = spec.num_kv_heads, spec.head_dim, spec.vocab_size

    def kv(prefix: str, axis: str) -> list[TensorSpec]:
        return [TensorSpec(f"{prefix}.{i}.{s}", "float32", ["batch", kv_heads, axis, head_dim])
                for i in range(spec.num_layers) for s in ("key", "value")]

    def ids(name: str, axis: str) -> TensorSpec:
        return TensorSpec(name, "int64", ["batch", axis])

    prefill = GraphSpec(
        file="prefill.onnx",
        inputs=[ids("input_ids", "sequence"), ids("attention_mask", "sequence"), ids("position_ids", "sequence")],
        outputs=[TensorSpec("logits", "float32", ["batch", "sequence" if all_logits else 1, vocab]),
                 *kv("present", "sequence")],
    )
    decode = GraphSpec(
        file="decode.onnx",
        inputs=[ids("input_ids", "new_tokens"), ids("attention_mask", "total_length"), ids("position_ids", "new_tokens"),
                *kv("past_key_values", "capacity"), TensorSpec(logits_to_keep.NAME, "int64", [])],
        outputs=[TensorSpec("logits", "float32", ["batch", logits_to_keep.KEPT_AXIS, vocab]), *kv("present", "capacity")],
    )
    return {"prefill": prefill, "decode": decode}
