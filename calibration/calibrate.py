"""``calibrate_artifact``: the calibration stage from one artifact and text to a quantized artifact.

    artifact + text --> windows --> (search) --> quantized prefill + decode --> report
                                                                               |
                        new artifact: graphs, weights.bin, quality.json, tensorrt/ <+

With ``options.search`` (the CLI's default) the recipe is not given but found: ``search.py``
tries recipes and per-MatMul fallbacks on the held-out split until a quality target holds,
and the chosen one is built by ``pipeline.py``. The new artifact is staged and renamed into
place only once its report is written (and, with a search, meets the target or ``force``).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.artifact.manifest import Manifest
from llmx.artifact.onnx_files import load_graph
from llmx.artifact.staging import finish, staged_artifact
from llmx.calibration import kv_int8, pipeline
from llmx.calibration.data import read_text_data, split_windows, token_windows
from llmx.calibration.encoder import load_sentences, measure_embeddings
from llmx.calibration.judge import DecoderJudge, kl_ratio, meets, ratio_bound
from llmx.calibration.layered import largest_stage_bytes
from llmx.calibration.matmuls import is_quantized
from llmx.calibration.options import UNSEARCHED_BLOCK_SIZE, CalibrationOptions
from llmx.calibration.progress import Progress, silent
from llmx.calibration.report import layered_reference, measure, write_report
from llmx.calibration.search import ALPHAS, TargetNotMetError, apply, format_search, run_search
from llmx.errors import ArtifactError, InputError
from llmx import memory_budget
from llmx.memory_budget import GiB, Need, check_fits, gib
from llmx.runtime.tokenizer import Tokenizer


def calibrate_artifact(src: str | Path | Artifact, out: str | Path, data: str | Path, options: CalibrationOptions,
                       eval_data: str | Path | None = None, force: bool = False,
                       log: Callable[[str], None] = lambda msg: None,
                       progress: Progress = silent) -> Manifest:
    """Quantize artifact ``src`` into ``out`` calibrated on ``data``; returns the new manifest."""
    options.validate()
    if options.block_size is None and (options.search is None or options.scheme is None):
        options = replace(options, block_size=UNSEARCHED_BLOCK_SIZE)
    source = Artifact.of(src)
    check_unquantized(source)
    options = check_calibration_fits(source, out, options)
    if options.layered:
        log(f"{options.label}: running the fp32 graphs one layer at a time ({gib(source.size_bytes())} of weights; "
            f"{gib(memory_budget.available_memory())} of memory available)")
    encoder = source.manifest.kind == "encoder"
    if encoder:
        if options.kv_cache != "float32":
            raise InputError("--kv-cache applies to decoders; an encoder has no KV cache")
        split, data_record = load_sentences(source, data, eval_data, options)
        log(f"{options.label}: calibrating on {len(split.calibration)} sentences from {data}")
    else:
        split, data_record = load_windows(source, data, eval_data, options)
        log(f"{options.label}: calibrating on {len(split.calibration)} windows x {split.seq_len} tokens from {data}")
    started = time.perf_counter()
    with staged_artifact(out, overwrite=force) as tmp, tempfile.TemporaryDirectory(prefix="llmx-calibrate-") as work:
        stats, searched, builder, fp32_logprobs = None, None, None, None
        if options.search is not None and options.scheme is not None:
            options, stats, searched, builder, fp32_logprobs = search_recipe(source, split, options,
                                                                             Path(work) / "search", force, log, progress)
        new = _build(source, split, options, Path(work), tmp, stats, log, progress, builder)
        new.precision.data = data_record
        report = _report(source, Artifact(tmp, new), split, options, eval_data, log, progress, Path(work),
                         fp32_logprobs)
        report["calibration_seconds"] = round(time.perf_counter() - started, 1)
        if searched is not None:
            report["search"] = searched
            report["meets_target"] = meets(report, searched["target"])
            if not report["meets_target"] and not force:
                log(format_search(searched))
                raise TargetNotMetError(f"the {options.label} artifact measures {_quality(report)} on the held-out "
                                        f"split, missing the target ({searched['measure']}); --force keeps it")
        write_report(tmp, report)
        new.extras["quality"] = report
        finish(tmp, new)
    return new


def search_recipe(source: Artifact, split, options: CalibrationOptions, work: Path, force: bool,
                  log: Callable[[str], None], progress: Progress):
    """(options for the recipe the search picked, the activation statistics, the search record,
    the w8/w4 builder whose blocks the artifact reuses, if any)."""
    work.mkdir()
    paths = pipeline.prepare_fp32(source, work / "fp32", share_weights=bool(options.layered))
    reference = pipeline.reference_graphs(source, paths, options)
    feeds = pipeline.make_feeds(source, split.calibration, options.threads)
    stats = pipeline.LazyStatistics(reference, feeds, options, progress, work)
    space = options.search
    if options.layered:
        # Each recipe's blocks are the whole model once more on disk (an 8B w4 set: 5 GB a block
        # size): unless flags fix it, w4 tries AWQ alone, which holds round-to-nearest in its grid
        # (alpha 0 per group) and rounds by importance; w8 round-to-nearest alone.
        if options.scheme == "w4" and space.awq == (False, True):
            space = replace(space, awq=(True,))
        if options.scheme == "w8" and space.alphas == ALPHAS:
            space = replace(space, alphas=(None,))
    if options.block_size is not None:  # a given block size fixes that dimension, as --method fixes the method
        space = replace(space, block_sizes=(options.block_size,))
    chosen, record, builder, judge = run_search(paths, source.manifest, feeds, stats, split.evaluation, options,
                                                space, work, log, progress, reference)
    if not record["met"]:
        best = record["candidates"][record["chosen"]]
        message = (f"no configuration meets the target ({record['measure']}); the best found, {best['label']}, "
                   f"measures {_quality(best)}")
        if not force:
            log(format_search(record))
            raise TargetNotMetError(message + "; --force keeps it, or relax --target")
        log(message + " (kept: --force)")
    return (apply(options, chosen), stats.collected, record, builder if options.scheme != "w8a8" else None,
            judge.reference if isinstance(judge, DecoderJudge) else None)


def _quality(measured: dict) -> str:
    if "cosine_mean" in measured:
        return f"cosine mean {measured['cosine_mean']:.4f} / min {measured['cosine_min']:.4f}"
    return (f"perplexity x{measured['perplexity_ratio']:.4f} (upper bound over windows x{ratio_bound(measured):.4f}, "
            f"exp(mean KL) x{kl_ratio(measured):.4f})")


def _build(source: Artifact, split, options: CalibrationOptions, work: Path, tmp: Path, stats, log,
           progress: Progress, builder=None) -> Manifest:
    models, weights_dir, record = pipeline.quantize_graphs(source, split.calibration, options, work, progress, stats,
                                                           builder)
    if options.kv_cache == "int8":
        log(f"int8 KV cache: scales from {len(split.calibration)} windows")
        scales = kv_int8.calibrate_kv(source, split.calibration, options.threads)
        kv_int8.quantize_kv_graphs(models, source.manifest, scales)
    new = pipeline.write_quantized(source, tmp, models, weights_dir, options, record)
    if options.kv_cache == "int8":
        kv_int8.mark_kv_int8(new, scales, split.calibration)
    return new


def _report(source: Artifact, candidate: Artifact, split, options: CalibrationOptions, eval_data, log,
            progress: Progress, work: Path, fp32_logprobs=None) -> dict:
    """``fp32_logprobs``: the search judge's fp32 log-probabilities of the same held-out windows
    (float16 on disk), read back instead of running the fp32 model again: 16 windows of SmolLM2-135M
    are 10 s of a calibration, an 8B model's layered pass minutes."""
    encoder = source.manifest.kind == "encoder"
    unit = "sentences" if encoder else "windows"
    log(f"measuring quality on {len(split.evaluation)} held-out {unit}")
    reference = None
    if fp32_logprobs is not None:  # a decoder's search (search_recipe gives none for encoders)
        reference = (logprobs.astype(np.float32) for logprobs in fp32_logprobs)
    elif options.layered:
        with progress("fp32 reference, a layer at a time", len(split.evaluation)) as bar:
            reference = layered_reference(source, split.evaluation, options.threads, work / "report-reference.f32",
                                          bar.update)
    with progress("evaluating", len(split.evaluation)) as bar:
        if encoder:
            measured = measure_embeddings(source, candidate, split.evaluation, options.threads, bar.update)
        else:
            measured = measure(source, candidate, split.evaluation, options.threads, bar.update, reference,
                               layered=bool(options.layered))
    source_text = str(eval_data) if eval_data else f"held-out tail of {candidate.manifest.precision.data['source']}"
    return {"scheme": options.scheme, "label": options.label, "kv_cache": options.kv_cache, "options": asdict(options),
            "evaluation": {"source": source_text, unit: len(split.evaluation), "seq_len": split.seq_len}, **measured}


def load_windows(source: Artifact, data, eval_data, options: CalibrationOptions):
    """(calibration/evaluation split, the manifest's record of the data) for ``--data``/``--eval-data``."""
    max_seq_len = source.manifest.max_seq_len
    if options.seq_len > max_seq_len:
        raise InputError(f"--seq-len {options.seq_len} exceeds the model's maximum length {max_seq_len}")
    tokenizer = Tokenizer(source)
    text = read_text_data(data)
    record = {"source": str(data), "sha256": text.sha256}
    held_out = None
    if eval_data is not None:
        eval_text = read_text_data(eval_data)
        held_out = token_windows(tokenizer, eval_text, options.seq_len)
        record.update(eval_source=str(eval_data), eval_sha256=eval_text.sha256)
    split = split_windows(token_windows(tokenizer, text, options.seq_len), options.seq_len, options.samples,
                          options.eval_samples, held_out, source=str(data))
    record.update(windows=len(split.calibration), seq_len=split.seq_len)
    return split, record


# Calibration holds the fp32 graphs with their weights (the quantizer works on in-memory
# models), the quantized copy and ONNX Runtime's sessions for the quality report: a Qwen3-4B
# artifact (16 GB of weights) was killed at 24.2 GB by `--scheme w4 --no-search` (issue 33).
CALIBRATE_PEAK = 1.6  # x the fp32 weights, at least: the measured kill
# Layer by layer (layered.py) the peak is the larger of one stage's fp32 weights (mapped, not
# packed) and a candidate's session: its blocks packed, about the quantized artifact's size.
QUANTIZED_SHARE = {"w8": 0.3, "w4": 0.17}  # of the fp32 bytes: bits/32, plus scales and fallbacks


def check_calibration_fits(source: Artifact, out: str | Path, options: CalibrationOptions) -> CalibrationOptions:
    """Refuse, before reading anything, a calibration that cannot fit in memory; returns the
    options with ``layered`` decided: a weight-only decoder whose fp32 graphs do not fit runs
    them a layer at a time."""
    can_layer = (options.scheme in ("w8", "w4") and source.manifest.kind == "decoder"
                 and options.kv_cache == "float32")
    whole = Need(int(CALIBRATE_PEAK * source.size_bytes()) + GiB, 0)  # memory only: the output is smaller
    if options.layered is None:
        options = replace(options, layered=can_layer and whole.memory > memory_budget.available_memory())
    if options.layered and not can_layer:
        raise InputError("layer-by-layer calibration applies to decoders with weight-only schemes (w8, w4) "
                         "and a float32 KV cache")
    if options.layered:
        stage = max(largest_stage_bytes(load_graph(source.graph_path(name))) for name in source.manifest.graphs)
        quantized = int(QUANTIZED_SHARE[options.scheme] * source.size_bytes())
        hint = (f"`llmx export CHECKPOINT -o DIR --precision {options.scheme}` writes the round-to-nearest blocks "
                "of --no-search streaming the checkpoint a tensor at a time")
        # disk: the artifact, and the blocks of each block size the search tries (written once, kept)
        need = Need(max(stage, quantized) + GiB, 4 * quantized)
        check_fits(f"calibrating {source.root.name} ({options.label}) layer by layer", need, out, hint=hint)
        return options
    hint = "free memory (other processes hold it) or use a machine with more"
    if can_layer:
        hint += "; --layered runs the fp32 graphs a layer at a time"
    check_fits(f"calibrating {source.root.name} ({options.label})", whole, out, hint=hint)
    return options


def check_unquantized(source: Artifact) -> None:
    scheme = source.manifest.precision.scheme
    if scheme or any(is_quantized(load_graph(source.graph_path(name))) for name in source.manifest.graphs):
        raise ArtifactError(f"{source.root} is already quantized ({scheme or 'quantized ops in its graphs'}); "
                            "calibrate the fp32 artifact it was made from")
