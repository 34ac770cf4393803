"""The calibration pipeline: source graphs -> (SmoothQuant) -> quantized graphs -> new artifact.

Every step reads graphs from a directory and writes the next step's graphs (with their own
weights.bin) into a scratch directory; only ``write_quantized`` writes into the artifact being
staged. Graphs are named by their manifest key (``prefill``, ``decode``) throughout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from llmx.artifact.handle import Artifact
from llmx.artifact.manifest import Manifest
from llmx.artifact.onnx_files import WEIGHTS_FILE, describe_graph, load_graph, save_graphs
from llmx.artifact.staging import copy_tokenizer
from llmx.calibration.activations import TOP_ROWS, ActivationStats, collect_stats, statistics_graphs
from llmx.calibration.candidates import Candidate
from llmx.calibration.encoder import EncoderFeeds
from llmx.calibration.feeds import Feeds
from llmx.calibration.judge import DecoderJudge, EncoderJudge
from llmx.calibration.layered import LayeredGraph
from llmx.calibration.matmuls import (SHARED_WEIGHTS, declare_activation_types, initializers, name_nodes,
                                     untie_weights, weight_matmuls)
from llmx.calibration.options import CalibrationOptions
from llmx.calibration.progress import Progress, silent
from llmx.calibration.smoothquant import activation_absmax, apply_smoothing, smoothing_scales
from llmx.calibration.static import activation_scales, collect_ranges, quantize_qdq, ranges_from_stats
from llmx.calibration.tensorrt_cache import TRT_VERSION, write_tables
from llmx.calibration.weight_only_builder import WeightOnlyBuilder




def quantize_graphs(source: Artifact, windows: list[list[int]], options: CalibrationOptions, work: Path,
                    progress: Progress, stats: ActivationStats | None = None,
                    builder: WeightOnlyBuilder | None = None) -> tuple[dict, Path | None, dict]:
    """(quantized models, the directory their external data lives in, what was done).

    ``stats``: activation statistics of these windows already collected (by the search); else
    they are collected here when SmoothQuant, AWQ or minmax ranges need them. ``builder``: the
    search's w8/w4 builder, whose scaled graphs and blocks the artifact reuses.
    """
    if options.scheme is None:  # weights stay as they are (an int8 KV cache alone)
        return {name: load_graph(source.graph_path(name)) for name in source.manifest.graphs}, source.root, {}
    record: dict = {"fallback": list(options.fallback)} if options.fallback else {}
    if options.scheme != "w8a8":
        if builder is None:
            paths = prepare_fp32(source, work / "fp32", share_weights=bool(options.layered))
            lazy = LazyStatistics(reference_graphs(source, paths, options), make_feeds(source, windows, options.threads),
                                  options, progress, work, stats)
            graph = "embed" if source.manifest.kind == "encoder" else "decode"
            builder = WeightOnlyBuilder(paths, graph, lazy, options.scheme, options.symmetric, progress)
        candidate = Candidate(alpha=options.smoothquant, awq=options.awq, fallback=tuple(options.fallback),
                              block_size=options.block_size)
        models, weights_dir, scaling = builder.graphs(candidate)
        return models, weights_dir, {**record, **scaling}
    paths = prepare_fp32(source, work / "fp32")
    feeds = make_feeds(source, windows, options.threads)
    if stats is None and (options.smoothquant is not None or options.method == "minmax"):
        stats = statistics(paths, feeds, options, progress, work)
    scales = None
    if options.smoothquant is not None:
        paths, record["smoothquant"] = smooth_graphs(paths, feeds, options, work / "smooth", progress,
                                                     stats.merged_absmax())
        scales = record["smoothquant"].pop("scales")
    return static_graphs(paths, feeds, options, work / "qdq", progress, stats, scales), work / "qdq", record


SEARCHED = (DecoderJudge.graph, EncoderJudge.graph)  # the graph the search scores, a decoder's and an encoder's


def statistics(paths: dict[str, Path], feeds, options: CalibrationOptions, progress: Progress,
               scratch: Path) -> ActivationStats:
    """One fp32 pass over the calibration feeds of the graphs the scheme needs (statistics_graphs);
    the sampled rows are kept in ``scratch``."""
    graphs = statistics_graphs(paths, options.scheme)
    if options.layered:  # the bar counts stages: each runs over every feed
        total = sum(len(LayeredGraph(path).stages) for path in graphs.values())
    else:
        total = sum(feeds.count(name) for name in graphs)
    with progress("activation statistics", total) as bar:
        # w8a8's percentile ranges of the searched graph from the statistics (a layered run: too
        # many channels to keep)
        top_rows = TOP_ROWS if options.scheme == "w8a8" and not options.layered else 0
        stats = collect_stats(graphs, feeds, bar.update, options.threads, options.layered, top_rows, SEARCHED)
    stats.spill(scratch / "activation-rows.f32")
    return stats


class LazyStatistics:
    """``statistics`` collected on first call (round-to-nearest never needs them; w8a8 at once,
    w8/w4 once a recipe rescales channels or falls back); ``collected``: them, or None."""

    def __init__(self, paths: dict[str, Path], feeds, options: CalibrationOptions, progress: Progress,
                 scratch: Path, collected: ActivationStats | None = None):
        self.paths, self.feeds, self.options, self.progress = paths, feeds, options, progress
        self.scratch, self.collected = scratch, collected

    def __call__(self) -> ActivationStats:
        if self.collected is None:
            self.collected = statistics(self.paths, self.feeds, self.options, self.progress, self.scratch)
        return self.collected


def prepare_fp32(source: Artifact, out: Path, share_weights: bool = False) -> dict[str, Path]:
    """The source graphs with named nodes, typed MatMul inputs and untied weights (what the
    quantizers need), their tensors copied into ``out``'s weights.bin. With ``share_weights`` (a
    model calibrated a layer at a time: an 8B model's fp32 copy would be another 32 GB of disk) the
    weight-MatMul tensors are not copied but read through a symbolic link to the source's file
    (SHARED_WEIGHTS): llmx's readers (matmuls.read_array, tensor_bytes) follow it, and no graph
    ONNX Runtime loads keeps a reference to it (it refuses a link out of the graph's directory:
    weight_only_builder copies an fp32 fallback's tensor next to its blocks)."""
    out.mkdir()
    models = {name: load_graph(source.graph_path(name)) for name in source.manifest.graphs}
    for model in models.values():
        name_nodes(model)
        declare_activation_types(model)
        untie_weights(model)
    shared = set()
    if share_weights:
        (out / SHARED_WEIGHTS).symlink_to((source.root / WEIGHTS_FILE).absolute())
        for model in models.values():
            inits = initializers(model)
            for mm in weight_matmuls(model):
                for entry in inits[mm.weight].external_data:
                    if entry.key == "location" and entry.value == WEIGHTS_FILE:
                        entry.value = SHARED_WEIGHTS
                        shared.add(mm.weight)
    save_graphs(models, out, sources={name: source.root for name in models}, keep=shared)
    return {name: out / f"{name}.onnx" for name in models}


def reference_graphs(source: Artifact, paths: dict[str, Path], options: CalibrationOptions) -> dict[str, Path]:
    """The fp32 graphs the statistics and the judge run: the prepared ``paths``, or a layered
    run's source graphs themselves (its stages read the source's directory and write nothing
    there; the prepared ones hold links ONNX Runtime refuses)."""
    if options.layered:
        return {name: source.graph_path(name) for name in paths}
    return paths


def make_feeds(source: Artifact, windows: list[list[int]], threads: int | None):
    """Calibration inputs of every graph: sentences for an encoder, windows and real KV for a decoder."""
    if source.manifest.kind == "encoder":
        return EncoderFeeds(windows)
    return Feeds(source, windows, threads)


def smooth_graphs(paths: dict[str, Path], feeds, options: CalibrationOptions, out: Path, progress: Progress = silent,
                  absmax: dict | None = None):
    """SmoothQuant both graphs with one set of scales; returns (new graph paths, what was done)."""
    if absmax is None:
        total = sum(feeds.count(name) for name in paths)
        with progress("smoothquant statistics", total) as bar:
            absmax = activation_absmax(paths, feeds, bar.update, options.threads)
    base = next(iter(paths.values())).parent
    models = {name: load_graph(path) for name, path in paths.items()}
    scales = {}
    for model in models.values():  # prefill and decode hold the same groups: same keys, same scales
        scales.update(smoothing_scales(model, base, absmax, options.smoothquant))
    counts = {name: apply_smoothing(model, base, scales) for name, model in models.items()}
    out.mkdir()
    save_graphs(models, out, sources={name: base for name in models})
    return {name: out / f"{name}.onnx" for name in models}, {"alpha": options.smoothquant, "groups": len(scales),
                                                            "per_graph": counts, "scales": scales}


def static_graphs(paths: dict[str, Path], feeds, options: CalibrationOptions, out: Path, progress: Progress,
                  stats: ActivationStats | None = None, scales: dict | None = None) -> dict:
    """Q/DQ graphs; minmax and percentile ranges come from ``stats`` (and the smoothing ``scales``
    applied to ``paths``) when given (static.ranges_from_stats), without running the graphs again."""
    out.mkdir()
    for name, path in paths.items():
        ranges = None if stats is None else ranges_from_stats(options.method, load_graph(path), stats, name, scales)
        if ranges is None:
            with progress(f"calibrating {name}", feeds.count(name)) as bar:
                ranges = collect_ranges(path, feeds(name), options.method, bar.update)
        quantize_qdq(path, out / f"{name}.onnx", ranges, options.method, options.per_channel, skip=set(options.fallback))
    return {name: load_graph(out / f"{name}.onnx") for name in paths}


def write_quantized(source: Artifact, tmp: Path, models: dict, weights_dir: Path | None,
                    options: CalibrationOptions, record: dict) -> Manifest:
    """Graphs, tokenizer and TensorRT tables into ``tmp``; the new manifest (not yet saved)."""
    manifest = source.manifest
    save_graphs(models, tmp, sources={name: weights_dir for name in models} if weights_dir else None)
    copy_tokenizer(source.root, tmp)
    portable = options.scheme in ("w8a8", None) and all(g.ops == "portable" for g in manifest.graphs.values())
    ops = "portable" if portable else "onnxruntime"
    new = manifest.with_stage("calibrate", scheme=options.scheme, kv_cache=options.kv_cache, **record)
    new.graphs = {name: describe_graph(model, f"{name}.onnx", ops=ops) for name, model in models.items()}
    new.precision = options.precision() if options.scheme else dataclasses.replace(manifest.precision)
    new.extras = {k: v for k, v in manifest.extras.items() if k != "verify"}
    if options.scheme == "w8a8":
        # Under "calibration", not "tensorrt": that key is `llmx build`'s record of built engines.
        new.extras["calibration"] = _tensorrt_tables(tmp, models, options.method)
    return new


def _tensorrt_tables(tmp: Path, models: dict, method: str) -> dict:
    tables = {}
    for name, model in models.items():
        folder = Path("tensorrt") / name
        files = write_tables(tmp / folder, activation_scales(model, tmp), method)
        tables[name] = [(folder / f).as_posix() for f in files]
    return {"tensorrt_tables": tables, "trt_version_header": TRT_VERSION,
            "note": "keys are the tensors feeding QuantizeLinear nodes; scales equal the Q/DQ scales"}
