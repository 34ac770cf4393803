"""Export: Hugging Face checkpoints -> ONNX prefill/decode graphs in an llmx artifact (needs torch).

Two ways to the graphs (``graphs``):

- "portable" (default): llmx's torch modules traced by torch's dynamo exporter; standard ONNX
  ops that TensorRT and other runtimes read. Decoders are traced on fake parameters with the
  weights streamed into weights.bin (export/onnx_export.py ``export_streamed``); the fp32 model is
  loaded only for ``verify``. Encoders (small) are loaded and traced.
- "fused": ONNX Runtime's fused graphs written from the ModelSpec (what ``llmx optimize``
  writes) with the weights streamed from the checkpoint one tensor at a time
  (export/fused.py), optionally quantized as they pass (``precision`` w8/w4).

Importing this package is cheap and torch-free; ``export_checkpoint`` pulls in torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from llmx.artifact.manifest import Manifest
from llmx.errors import InputError
from llmx.quant_blocks import BITS, UNSEARCHED_BLOCK_SIZE, check_block_size

GRAPH_KINDS = ("portable", "fused")
PRECISIONS = ("fp32", "fp16", "bf16", "w8", "w4")
LOW_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def export_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    verify: bool = False,
    all_logits: bool = False,
    force: bool = False,
    graphs: str | None = None,
    precision: str | None = None,
    block_size: int = UNSEARCHED_BLOCK_SIZE,
    source: str | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> Manifest:
    """Export a local HF checkpoint (decoder or encoder) or a GGUF file to an artifact directory; returns its manifest.

    ``precision`` None: fp32 for a checkpoint directory; a GGUF keeps its quantized blocks
    (export/gguf_export.py). ``graphs`` None: "fused" for a quantized ``precision`` (MatMulNBits
    is an ONNX Runtime op), else "portable" (a GGUF: fused where the family has fused kernels).
    ``source``: what the lineage names as the source (a hub id) when ``src`` is where it was put.
    """
    from llmx.artifact.staging import finish, staged_artifact
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.gguf import gguf_file
    from llmx.export.manifest import with_export_lineage
    from llmx.export.memory import check_export_fits
    from llmx.export.tokenizer import package_tokenizer

    checked = _check_options(graphs, precision or "fp32", block_size, verify)  # before anything is read
    if (gguf := gguf_file(src)) is not None:  # a .gguf file, or a directory holding one
        from llmx.export.gguf import gguf_checkpoint
        from llmx.export.gguf_export import gguf_export_options

        checkpoint = gguf_checkpoint(gguf)
        graphs, precision = gguf_export_options(checkpoint, graphs, precision, verify)
    else:
        from llmx.export.prequantized import is_prequantized, prequantized_checkpoint, prequantized_export_options

        checkpoint = prequantized_checkpoint(open_checkpoint(src))
        if is_prequantized(checkpoint):  # GPTQ, AWQ, compressed-tensors: its own blocks (export/prequantized.py)
            graphs, precision = prequantized_export_options(checkpoint, graphs, precision, verify)
        else:
            graphs, precision = checked, precision or "fp32"
    spec = checkpoint.spec
    if spec.kind == "encoder":
        from llmx.export.encoder import read_sentence_config

        if graphs == "fused":
            raise InputError("--graphs fused is for decoders; an encoder exports portable graphs")
        if precision != "fp32":
            raise InputError(f"--precision {precision} is for decoders; an encoder exports fp32 "
                             "(`llmx calibrate` quantizes it)")
        for key, value in read_sentence_config(checkpoint.path).items():
            setattr(spec, key, value)
    check_export_fits(checkpoint, out, graphs, precision, block_size, verify)
    if graphs == "fused":
        from llmx.export.fused import export_fused

        with staged_artifact(out, overwrite=force) as tmp:
            tokenizer = _package_tokenizer(checkpoint, tmp)
            manifest = export_fused(checkpoint, tmp, tokenizer, all_logits=all_logits, precision=precision,
                                    block_size=block_size, log=log)
            return finish(tmp, _with_source_record(manifest, checkpoint, source, log))

    from llmx.export.checkpoint import load_model

    if spec.kind == "decoder":
        from llmx.export.onnx_export import streamed_decoder_manifest

        weights = f"{spec.family} weights ({spec.num_layers} layers, hidden {spec.hidden_size}) from {checkpoint.path}"
        model = None
        if verify:  # the only step that needs the fp32 model in memory
            log(f"loading {weights}")
            model = load_model(checkpoint)
        else:
            log(f"streaming {weights}" + (f" as {precision}" if precision != "fp32" else ""))
        with staged_artifact(out, overwrite=force) as tmp:
            tokenizer = _package_tokenizer(checkpoint, tmp)
            low_dtype = LOW_DTYPES.get(precision)
            details = dict(prefill_logits="all" if all_logits else "last")
            if low_dtype:
                details.update(precision=precision, lowered="weights stored in " + low_dtype + " as they streamed "
                               "past; graphs lowered as `llmx build` lowers (norms, softmax, position math fp32)")
            manifest = with_export_lineage(streamed_decoder_manifest(checkpoint, tmp, tokenizer, all_logits, log,
                                                                     low_dtype=low_dtype),
                                           str(checkpoint.path), **details)
            if model is not None:
                log("verifying ONNX Runtime against PyTorch")
                _verify(model, tmp, manifest, log)
            return finish(tmp, _with_source_record(manifest, checkpoint, source, log))

    # Encoders keep the loaded model's trace (their weights are small).
    log(f"loading {spec.family} weights ({spec.num_layers} layers, hidden {spec.hidden_size}) from {checkpoint.path}")
    model = load_model(checkpoint)
    with staged_artifact(out, overwrite=force) as tmp:
        from llmx.export.encoder import encoder_manifest

        tokenizer = package_tokenizer(checkpoint.path, tmp, checkpoint.config)
        log("exporting the embedding graph")
        manifest = with_export_lineage(encoder_manifest(model, tmp, tokenizer), str(checkpoint.path))
        if verify:
            log("verifying ONNX Runtime against PyTorch")
            _verify(model, tmp, manifest, log)
        return finish(tmp, _with_source_record(manifest, checkpoint, source, log))


def _package_tokenizer(checkpoint, tmp: Path) -> dict:
    from llmx.export.gguf_export import is_gguf, package_gguf
    from llmx.export.tokenizer import package_tokenizer

    return package_gguf(checkpoint, tmp) if is_gguf(checkpoint) else package_tokenizer(checkpoint.path, tmp, checkpoint.config)


def _with_source_record(manifest: Manifest, checkpoint, source: str | None, log: Callable[[str], None]) -> Manifest:
    from llmx.export.gguf_export import finish_gguf_manifest, is_gguf
    from llmx.export.prequantized import finish_prequantized_manifest, is_prequantized

    if source is not None:
        manifest.lineage[0].details.update(source=source, path=str(checkpoint.path))
    if is_prequantized(checkpoint):
        return finish_prequantized_manifest(manifest, checkpoint, log)
    return finish_gguf_manifest(manifest, checkpoint, log) if is_gguf(checkpoint) else manifest


def _verify(model, tmp: Path, manifest: Manifest, log: Callable[[str], None]) -> None:
    from llmx.export.verify import verify_export

    manifest.extras["verify"] = verify_export(model, tmp)
    log(f"verified: max |diff| {manifest.extras['verify']['max_abs_diff']:.2e}")


def _check_options(graphs: str | None, precision: str, block_size: int, verify: bool) -> str:
    """The graph kind to write; refuses a combination before anything is read."""
    if precision not in PRECISIONS:
        raise InputError(f"--precision {precision} is not supported; use one of {', '.join(PRECISIONS)}")
    graphs = graphs or ("fused" if precision in BITS else "portable")
    if graphs not in GRAPH_KINDS:
        raise InputError(f"--graphs must be one of {', '.join(GRAPH_KINDS)}, got {graphs!r}")
    if precision in LOW_DTYPES:
        if graphs == "fused":
            raise InputError(f"--precision {precision} writes portable graphs (for GPUs: `llmx build`, --backend "
                             "ort-cuda); ONNX Runtime's fused CPU kernels compute in fp32: use --graphs portable")
        if verify:
            raise InputError(f"--verify checks fp32 graphs against PyTorch to 1e-4, which {precision} cannot meet; "
                             "export fp32 to verify")
    if precision in BITS:
        check_block_size(block_size)
        if graphs == "portable":
            raise InputError(f"--precision {precision} writes ONNX Runtime's MatMulNBits, which portable graphs do not "
                             "hold; use --graphs fused (or export portable, then `llmx calibrate`)")
    if verify and graphs == "fused":
        raise InputError("--verify compares the graphs with the PyTorch model, which --graphs fused never loads; "
                         "export portable graphs to verify")
    return graphs
