"""Calibration: INT8/INT4 quantization of artifacts with a measured quality report.

    artifact + text --> windows --> (SmoothQuant) --> quantized prefill + decode --> report
                                                                                    |
                        new artifact: graphs, weights.bin, quality.json, tensorrt/ <+

With ``options.search`` (the CLI's default) the recipe is not given but found: ``search.py``
tries recipes and per-MatMul fallbacks on the held-out split until a quality target holds,
and the chosen one is built as below.

Schemes: ``w8a8`` static INT8 Q/DQ (calibrated activations, per-channel weights; the graphs
TensorRT reads), ``w8`` and ``w4`` weight-only MatMulNBits. Both graphs are quantized; decode
is calibrated on real KV caches (see ``feeds``). ``kv_cache="int8"`` also stores the KV cache
as int8 (``kv_int8``), with a scheme or alone. Importing this package is cheap; the work
happens in ``calibrate_artifact``.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from llmx.calibration.pipeline import Progress, silent
from llmx.calibration.search import SearchSpace, TargetNotMetError
from llmx.calibration.static import METHODS
from llmx.errors import ArtifactError, InputError
from llmx.artifact.manifest import Manifest, Precision, load_manifest

SCHEMES = ("w8a8", "w8", "w4")
UNSEARCHED_BLOCK_SIZE = 32  # no quality gate without the search: the known-safe size (genai's default too)
KV_CACHE_DTYPES = ("float32", "int8")


@dataclass
class CalibrationOptions:
    scheme: str | None  # None: weights untouched (only an int8 KV cache)
    method: str = "percentile"  # w8a8: how activation ranges are chosen (best of the three on real text)
    smoothquant: float | None = None  # w8a8: SmoothQuant alpha (None: off)
    per_channel: bool = True  # w8a8: weight scales per output channel (else per tensor)
    block_size: int | None = None  # w8/w4: input channels per scale; None: searched, else UNSEARCHED_BLOCK_SIZE
    symmetric: bool = True  # w8/w4: no zero points
    samples: int = 32  # calibration windows
    seq_len: int = 256  # tokens per window
    eval_samples: int = 16  # evaluation windows
    threads: int | None = None
    kv_cache: str = "float32"  # "int8": static per-channel int8 KV cache (kv_int8.py)
    awq: bool = False  # w4/w8: AWQ-style activation-aware scales before rounding (awq.py)
    fallback: tuple[str, ...] = ()  # weight names of MatMuls kept in higher precision (see weight_only/static)
    search: SearchSpace | None = None  # None: exactly this recipe; else search.py picks one meeting a target

    def validate(self) -> "CalibrationOptions":
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise InputError(f"--kv-cache must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache!r}")
        if self.scheme is None and self.kv_cache == "float32":
            raise InputError(f"--scheme is required ({', '.join(SCHEMES)}) unless --kv-cache int8 is the only change")
        if self.scheme is None:
            return self
        if self.scheme not in SCHEMES:
            raise InputError(f"scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.method not in METHODS:
            raise InputError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.smoothquant is not None and not 0.0 <= self.smoothquant <= 1.0:
            raise InputError(f"--smoothquant alpha must be in [0, 1], got {self.smoothquant}")
        if self.search is not None and self.search.target is not None and not 0 < self.search.target < 10:
            raise InputError(f"--target must be a perplexity ratio (e.g. 1.02) or a cosine floor (e.g. 0.99), "
                             f"got {self.search.target}")
        if self.awq and self.scheme == "w8a8":
            raise InputError("--awq applies to weight-only schemes (w8, w4); w8a8 has SmoothQuant")
        if self.smoothquant is not None and self.scheme != "w8a8":
            raise InputError("--smoothquant applies to w8a8 only (weight-only schemes leave activations in fp32)")
        if self.scheme != "w8a8" and self.block_size is not None:
            from llmx.calibration.weight_only import check_block_size

            check_block_size(self.block_size)
        return self

    @property
    def label(self) -> str:
        """What the report calls the quantized artifact: the scheme, plus "kv8" for an int8 cache."""
        parts = [self.scheme] if self.scheme else []
        return "+".join(parts + (["kv8"] if self.kv_cache == "int8" else []))

    def precision(self) -> Precision:
        """The manifest's ``precision`` section for this scheme."""
        # "fallback": the MatMuls (weight names) kept in fp32 (w8a8), at accuracy level 0 (w8), 8-bit (w4).
        if self.scheme == "w8a8":
            return Precision(weights="int8", activations="int8", scheme=self.scheme, method=self.method,
                             smoothquant=self.smoothquant, per_channel=self.per_channel, symmetric=True,
                             fallback=list(self.fallback))
        return Precision(weights="int8" if self.scheme == "w8" else "int4", activations="float32", scheme=self.scheme,
                         block_size=self.block_size, symmetric=self.symmetric, awq=self.awq,
                         fallback=list(self.fallback))


def calibrate_artifact(src: str | Path, out: str | Path, data: str | Path, options: CalibrationOptions,
                       eval_data: str | Path | None = None, force: bool = False,
                       log: Callable[[str], None] = lambda msg: None,
                       progress: Progress = silent) -> Manifest:
    """Quantize artifact ``src`` into ``out`` calibrated on ``data``; returns the new manifest."""
    from llmx.artifact.staging import finish, staged_artifact
    from llmx.calibration.judge import meets
    from llmx.calibration.report import write_report
    from llmx.calibration.search import format_search

    options.validate()
    if options.block_size is None and (options.search is None or options.scheme is None):
        options = replace(options, block_size=UNSEARCHED_BLOCK_SIZE)
    src = Path(src)
    manifest = load_manifest(src)
    check_unquantized(src, manifest)
    encoder = manifest.kind == "encoder"
    if encoder:
        from llmx.calibration.encoder import load_sentences

        if options.kv_cache != "float32":
            raise InputError("--kv-cache applies to decoders; an encoder has no KV cache")
        split, data_record = load_sentences(src, manifest, data, eval_data, options)
        log(f"{options.label}: calibrating on {len(split.calibration)} sentences from {data}")
    else:
        split, data_record = load_windows(src, manifest, data, eval_data, options)
        log(f"{options.label}: calibrating on {len(split.calibration)} windows x {split.seq_len} tokens from {data}")
    started = time.perf_counter()
    with staged_artifact(out, overwrite=force) as tmp, tempfile.TemporaryDirectory(prefix="llmx-calibrate-") as work:
        stats, searched = None, None
        if options.search is not None and options.scheme is not None:
            options, stats, searched = search_recipe(src, manifest, split, options, Path(work) / "search", force, log,
                                                     progress)
        new = _build(src, manifest, split, options, Path(work), tmp, stats, log, progress)
        new.precision.data = data_record
        report = _report(src, tmp, new, split, options, eval_data, encoder, log, progress)
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


def search_recipe(src: Path, manifest: Manifest, split, options: CalibrationOptions, work: Path, force: bool,
                  log: Callable[[str], None], progress: Progress):
    """(options for the recipe the search picked, the activation statistics, the search record)."""
    from llmx.calibration import pipeline
    from llmx.calibration.activations import collect_stats
    from llmx.calibration.search import apply, format_search, run_search

    work.mkdir()
    paths = pipeline.prepare_fp32(src, manifest, work / "fp32")
    feeds = pipeline.make_feeds(src, manifest, split.calibration, options.threads)
    stats = None
    if options.scheme == "w8a8" or (options.scheme == "w4" and True in options.search.awq):  # else unused
        with progress("activation statistics", sum(feeds.count(name) for name in paths)) as bar:
            stats = collect_stats(paths, feeds, bar.update, options.threads)
    space = options.search
    if options.block_size is not None:  # a given block size fixes that dimension, as --method fixes the method
        space = replace(space, block_sizes=(options.block_size,))
    chosen, record = run_search(paths, manifest, feeds, stats, split.evaluation, options, space, work, log)
    if not record["met"]:
        best = record["candidates"][record["chosen"]]
        message = (f"no configuration meets the target ({record['measure']}); the best found, {best['label']}, "
                   f"measures {_quality(best)}")
        if not force:
            log(format_search(record))
            raise TargetNotMetError(message + "; --force keeps it, or relax --target")
        log(message + " (kept: --force)")
    return apply(options, chosen), stats, record


def _quality(measured: dict) -> str:
    if "cosine_mean" in measured:
        return f"cosine mean {measured['cosine_mean']:.4f} / min {measured['cosine_min']:.4f}"
    return f"perplexity x{measured['perplexity_ratio']:.4f}"


def _build(src: Path, manifest: Manifest, split, options: CalibrationOptions, work: Path, tmp: Path, stats, log,
           progress: Progress) -> Manifest:
    from llmx.calibration import pipeline

    models, weights_dir, record = pipeline.quantize_graphs(src, manifest, split.calibration, options, work,
                                                           progress, stats)
    if options.kv_cache == "int8":
        from llmx.calibration import kv_int8

        log(f"int8 KV cache: scales from {len(split.calibration)} windows")
        scales = kv_int8.calibrate_kv(src, manifest, split.calibration, options.threads)
        kv_int8.quantize_kv_graphs(models, manifest, scales)
    new = pipeline.write_quantized(src, manifest, tmp, models, weights_dir, options, record)
    if options.kv_cache == "int8":
        kv_int8.mark_kv_int8(new, scales, split.calibration)
    return new


def _report(src: Path, tmp: Path, new: Manifest, split, options: CalibrationOptions, eval_data, encoder: bool,
            log, progress: Progress) -> dict:
    from llmx.calibration.encoder import measure_embeddings
    from llmx.calibration.report import measure

    unit = "sentences" if encoder else "windows"
    log(f"measuring quality on {len(split.evaluation)} held-out {unit}")
    with progress("evaluating", len(split.evaluation)) as bar:
        score = measure_embeddings if encoder else measure
        measured = score(src, tmp, new, split.evaluation, options.threads, bar.update)
    source = str(eval_data) if eval_data else f"held-out tail of {new.precision.data['source']}"
    return {"scheme": options.scheme, "label": options.label, "kv_cache": options.kv_cache, "options": asdict(options),
            "evaluation": {"source": source, unit: len(split.evaluation), "seq_len": split.seq_len}, **measured}


def load_windows(src: Path, manifest: Manifest, data, eval_data, options: CalibrationOptions):
    """(calibration/evaluation split, the manifest's record of the data) for ``--data``/``--eval-data``."""
    from llmx.calibration.data import read_text_data, split_windows, token_windows
    from llmx.runtime.tokenizer import Tokenizer

    if options.seq_len > manifest.max_seq_len:
        raise InputError(f"--seq-len {options.seq_len} exceeds the model's maximum length {manifest.max_seq_len}")
    tokenizer = Tokenizer(src, manifest)
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


def check_unquantized(src: Path, manifest: Manifest) -> None:
    from llmx.calibration.matmuls import is_quantized
    from llmx.artifact.onnx_files import load_graph

    scheme = manifest.precision.scheme
    if scheme or any(is_quantized(load_graph(src / g.file)) for g in manifest.graphs.values()):
        raise ArtifactError(f"{src} is already quantized ({scheme or 'quantized ops in its graphs'}); "
                            "calibrate the fp32 artifact it was made from")


__all__ = ["CalibrationOptions", "SCHEMES", "KV_CACHE_DTYPES", "METHODS", "calibrate_artifact"]
