"""Export: Hugging Face checkpoints -> ONNX prefill/decode graphs in an llmx artifact (needs torch).

Importing this package is cheap and torch-free; ``export_checkpoint`` pulls in torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from llmx.artifact.manifest import Manifest

KV_LAYOUT = {
    "layout": "batch,kv_heads,sequence,head_dim",
    "past": "past_key_values.{i}.{kv}",
    "present": "present.{i}.{kv}",
    "dtype": "float32",
    # A sequence's token at position p is stored in slot p. Decode scatters new entries at
    # position_ids, so past and present may (and should) be bound to the same buffer.
    "update": "scatter_at_position",
}


def export_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    verify: bool = False,
    all_logits: bool = False,
    force: bool = False,
    log: Callable[[str], None] = lambda msg: None,
) -> Manifest:
    """Export a local HF checkpoint (decoder or encoder) or a GGUF file to an artifact directory; returns its manifest."""
    from llmx.artifact.staging import finish, staged_artifact
    from llmx.export.checkpoint import load_model, open_checkpoint
    from llmx.export.gguf import gguf_file
    from llmx.export.tokenizer import package_tokenizer

    if (gguf := gguf_file(src)) is not None:  # a .gguf file, or a directory holding one
        from llmx.export.gguf_export import export_gguf

        return export_gguf(gguf, out, verify=verify, all_logits=all_logits, force=force, log=log)
    checkpoint = open_checkpoint(src)
    spec = checkpoint.spec
    if spec.kind == "encoder":
        from llmx.export.encoder import read_sentence_config

        for key, value in read_sentence_config(checkpoint.path).items():
            setattr(spec, key, value)
    log(f"loading {spec.family} weights ({spec.num_layers} layers, hidden {spec.hidden_size}) from {checkpoint.path}")
    model = load_model(checkpoint)
    with staged_artifact(out, overwrite=force) as tmp:
        tokenizer = package_tokenizer(checkpoint.path, tmp, checkpoint.config)
        log(f"exporting {'the embedding graph' if spec.kind == 'encoder' else 'prefill and decode graphs'}")
        export = _export_encoder if spec.kind == "encoder" else _export_decoder
        manifest = export(model, tmp, tokenizer, all_logits)
        manifest.lineage = [{"stage": "export", "source": str(checkpoint.path),
                             **({"prefill_logits": "all" if all_logits else "last"} if spec.kind == "decoder" else {})}]
        if verify:
            log("verifying ONNX Runtime against PyTorch")
            from llmx.export.verify import verify_export

            manifest.extras["verify"] = verify_export(model, tmp)
            log(f"verified: max |diff| {manifest.extras['verify']['max_abs_diff']:.2e}")
        finish(tmp, manifest)
    return manifest


def _export_decoder(model, tmp: Path, tokenizer: dict, all_logits: bool) -> Manifest:
    from llmx.export.onnx_export import export_decoder
    from llmx.artifact.onnx_files import describe_graph, load_graph

    spec = model.spec
    export_decoder(model, tmp, all_logits=all_logits)
    graphs = {name: describe_graph(load_graph(tmp / f"{name}.onnx"), f"{name}.onnx") for name in ("prefill", "decode")}
    return Manifest(
        kind="decoder",
        model=spec.to_dict(),
        graphs=graphs,
        tokenizer=tokenizer,
        precision=dict(FP32),
        kv={**KV_LAYOUT, "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
    )


def _export_encoder(model, tmp: Path, tokenizer: dict, all_logits: bool) -> Manifest:
    from llmx.export.encoder import export_encoder
    from llmx.artifact.onnx_files import describe_graph, load_graph

    export_encoder(model, tmp)
    graphs = {"embed": describe_graph(load_graph(tmp / "embed.onnx"), "embed.onnx")}
    return Manifest(kind="encoder", model=model.spec.to_dict(), graphs=graphs, tokenizer=tokenizer, precision=dict(FP32))


FP32 = {"weights": "float32", "activations": "float32", "scheme": None}
