"""Calibration a decoder layer at a time (calibration/layered.py): what a model whose fp32 graphs do
not fit in memory gets. The stage-by-stage run computes what the whole graph computes, the
statistics and the report come out the same, and the layered mode is chosen by itself when the
memory check says the whole graphs would not fit."""

from __future__ import annotations

import hashlib
import inspect

import numpy as np
import pytest

from llmx.artifact import Artifact
from llmx.calibration import CalibrationOptions, calibrate_artifact
from llmx.calibration.judge import DecoderJudge, session
from llmx.calibration.layered import LayeredGraph, layer_of
from llmx.calibration.search import SearchSpace, format_search
from llmx.errors import InputError
from test_cli import error_line, run

SMALL = dict(samples=3, seq_len=32, eval_samples=3, threads=1)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    import argparse

    path = tmp_path_factory.mktemp("layered-data") / "calib.txt"
    path.write_text(inspect.getsource(argparse))
    return path


def windows(count: int, length: int = 24) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 250, length).tolist() for _ in range(count)]


@pytest.mark.parametrize("variant", ["portable", "fused"])
def test_stages_compute_what_the_whole_graph_computes(store, variant):
    """Both graphs, portable (the dynamo export) and fused (contrib ops), feed by feed: the logits,
    and a KV output of the first layer asked for by name, equal the whole session's."""
    from llmx.calibration.feeds import prefill_feed

    art = Artifact.of(store.artifact("llama") if variant == "portable" else store.optimized("llama"))
    layers = art.manifest.model.num_layers
    for graph in ("prefill", "decode"):
        layered, whole = LayeredGraph(art.graph_path(graph), 1), session(art.graph_path(graph), 1)
        assert [s.index for s in layered.stages] == list(range(-1, layers))
        last = layered.stages[-1]
        assert "logits" in last.produced  # the final norm and the head join the last layer
        assert max(layer_of(w) for w in last.initializers) == last.index  # no later weights
        feeds = [prefill_feed(w) if graph == "prefill" else DecoderJudge._feed(layered, art.manifest, w)
                 for w in windows(3)]
        names = ["logits", "present.0.key"]
        got: dict[int, dict] = {}
        for i, values in layered.run_each(names, feeds):
            got.setdefault(i, {}).update(values)
        assert sorted(got) == [0, 1, 2]
        for i, feed in enumerate(feeds):
            for name, expected in zip(names, whole.run(names, feed)):
                np.testing.assert_allclose(got[i][name], expected, atol=2e-5, rtol=1e-4)


def test_layered_statistics_equal_the_whole_pass(store, tmp_path):
    """The activation statistics, gathered stage by stage, equal one whole pass's: the same
    per-channel sums and maxima, and the same sampled rows (one generator per input)."""
    from llmx.calibration.activations import collect_stats
    from llmx.calibration.feeds import Feeds
    from llmx.calibration.pipeline import prepare_fp32

    art = Artifact.of(store.artifact("llama"))
    paths = prepare_fp32(art, tmp_path / "fp32")
    feeds = Feeds(art, windows(3, 32), 1)
    whole = collect_stats({"prefill": paths["prefill"]}, feeds, threads=1)
    layered = collect_stats({"prefill": art.graph_path("prefill")}, feeds, threads=1, layered=True)  # as it runs
    assert sorted(layered.abs_sum) == sorted(whole.abs_sum) and len(whole.abs_sum) > 4
    for weight in whole.abs_sum:
        np.testing.assert_allclose(layered.abs_sum[weight], whole.abs_sum[weight], rtol=1e-4)
        np.testing.assert_allclose(layered.absmax["prefill"][weight], whole.absmax["prefill"][weight], rtol=1e-4)
        np.testing.assert_allclose(layered.rows[weight], whole.rows[weight], atol=1e-4)
        assert layered.count[weight] == whole.count[weight]


@pytest.mark.parametrize("scheme", ["w8", "w4"])
def test_the_source_weights_are_read_through_a_link_and_left_as_they_were(store, text, tmp_path, scheme):
    """A layered calibration does not copy the fp32 weights (an 8B model's 32 GB): the prepared
    graphs read the MatMul weights through a link to the source's file, copied next to the blocks
    only where a candidate keeps one in fp32 (w8's fallbacks, which ONNX Runtime must load); the
    source is left byte for byte, and the w8 fallback builds the same artifact as a whole run."""
    from llmx.artifact.onnx_files import load_graph
    from llmx.calibration.matmuls import SHARED_WEIGHTS, initializers, read_array, weight_matmuls
    from llmx.calibration.pipeline import prepare_fp32

    art = Artifact.of(store.artifact("llama"))
    before = hashlib.sha256((art.root / "weights.bin").read_bytes()).hexdigest()
    paths = prepare_fp32(art, tmp_path / "fp32", share_weights=True)
    assert (tmp_path / "fp32" / SHARED_WEIGHTS).resolve() == (art.root / "weights.bin").resolve()
    copied = (tmp_path / "fp32" / "weights.bin").stat().st_size
    assert 0 < copied < (art.root / "weights.bin").stat().st_size / 2  # embedding and norms, not the MatMuls
    model = load_graph(paths["decode"])
    weight = weight_matmuls(model)[0].weight
    source = read_array(initializers(load_graph(art.graph_path("decode")))[weight], art.root)
    np.testing.assert_array_equal(read_array(initializers(model)[weight], paths["decode"].parent), source)
    fallback = (weight,)
    built = {}
    for layered in (True, False):
        options = CalibrationOptions(scheme=scheme, block_size=32, fallback=fallback, layered=layered, **SMALL)
        calibrate_artifact(art, tmp_path / f"{scheme}-{layered}", text, options)
        built[layered] = (tmp_path / f"{scheme}-{layered}" / "weights.bin").read_bytes()
    assert built[True] == built[False]
    assert hashlib.sha256((art.root / "weights.bin").read_bytes()).hexdigest() == before
    assert sorted(p.name for p in art.root.iterdir() if p.suffix == ".onnx") == ["decode.onnx", "prefill.onnx"]


def test_a_layered_calibration_builds_and_reports_what_a_whole_one_does(store, text, tmp_path):
    """w4 without a search: the same blocks, the same graphs, the same report (the reference
    computed a layer at a time); with a search: fp32 untimed, said so, and the target still judged."""
    art = store.artifact("llama")
    reports = {}
    for layered in (False, True):
        out = tmp_path / f"w4-{layered}"
        options = CalibrationOptions(scheme="w4", block_size=32, layered=layered, **SMALL)
        reports[layered] = calibrate_artifact(art, out, text, options).extras["quality"]
    assert (tmp_path / "w4-True" / "weights.bin").read_bytes() == (tmp_path / "w4-False" / "weights.bin").read_bytes()
    for key in ("perplexity_ratio", "mean_kl", "top1_agreement"):
        assert reports[True][key] == pytest.approx(reports[False][key], rel=1e-4, abs=1e-6)
    assert reports[True]["fp32"]["perplexity"] == pytest.approx(reports[False]["fp32"]["perplexity"], rel=1e-4)
    logs: list[str] = []
    options = CalibrationOptions(scheme="w4", layered=True, search=_space(1.5), **SMALL)
    searched = calibrate_artifact(art, tmp_path / "searched", text, options, log=logs.append).extras["quality"]
    record = searched["search"]
    assert record["fp32"] is None and not record["slower_than_fp32"] and record["met"]
    assert any("one layer at a time" in line for line in logs)
    assert "fp32: not timed" in format_search(record)


def _space(target: float):
    return SearchSpace(target=target)


def test_layered_is_chosen_when_the_whole_graphs_do_not_fit(store, text, tmp_path, monkeypatch):
    """The memory check decides: with less memory than the whole fp32 graphs need, a w4
    calibration runs them a layer at a time and says so; with less than one stage needs, it
    refuses in one line."""
    import llmx.calibration.calibrate as calibrate
    import llmx.memory_budget as budget

    art = Artifact.of(store.artifact("llama"))
    whole = int(calibrate.CALIBRATE_PEAK * art.size_bytes()) + budget.GiB
    monkeypatch.setattr(budget, "available_memory", lambda: whole - 1)
    logs: list[str] = []
    manifest = calibrate_artifact(art, tmp_path / "auto", text, CalibrationOptions(scheme="w4", block_size=32, **SMALL),
                                  log=logs.append)
    assert manifest.extras["quality"]["options"]["layered"] is True
    assert any("running the fp32 graphs one layer at a time" in line for line in logs)
    monkeypatch.setattr(budget, "available_memory", lambda: budget.GiB // 2)
    with pytest.raises(budget.ResourceError, match="layer by layer needs about"):
        calibrate_artifact(art, tmp_path / "refused", text, CalibrationOptions(scheme="w4", **SMALL))
    assert not (tmp_path / "refused").exists()


def test_layered_refuses_what_needs_the_whole_graph(store, text, tmp_path, capsys):
    """w8a8's calibrators and an int8 KV cache are refused in one line, nothing written."""
    for flags in (["--scheme", "w8a8"], ["--scheme", "w4", "--kv-cache", "int8"]):
        code, _, err = run(["calibrate", str(store.artifact("llama")), "--data", str(text), *flags, "--layered",
                            "--seq-len", "32", "-o", str(tmp_path / "x")], capsys)
        assert code != 0 and error_line(err).startswith("error: "), (flags, err)
        assert not (tmp_path / "x").exists()
    with pytest.raises(InputError, match="weight-only schemes"):
        CalibrationOptions(scheme="w8a8", layered=True).validate()
    with pytest.raises(InputError, match="not layer by layer"):
        CalibrationOptions(scheme="w4", kv_cache="int8", layered=True).validate()


def test_a_layered_w4_search_tries_awq_in_place_of_round_to_nearest(store, text, tmp_path):
    """Each recipe's blocks are the model once more on disk: layered, w4's tiers hold AWQ alone
    (round-to-nearest is in its grid), at every block size; a flag still fixes the recipe."""
    options = CalibrationOptions(scheme="w4", layered=True, search=SearchSpace(target=0.5, fallback=False), **SMALL)
    with pytest.raises(Exception, match="no configuration meets the target") as refused:
        calibrate_artifact(store.artifact("llama"), tmp_path / "y", text, options)
    assert "the best found, awq b" in str(refused.value)
    options = CalibrationOptions(scheme="w4", layered=True, **SMALL,
                                 search=SearchSpace(target=0.5, fallback=False, awq=(False,), block_sizes=(32,)))
    with pytest.raises(Exception, match="the best found, rtn b32"):
        calibrate_artifact(store.artifact("llama"), tmp_path / "z", text, options)


@pytest.mark.parametrize("layered", [False, True])
def test_scaled_recipes_keep_only_their_blocks(store, text, tmp_path, layered):
    """AWQ and SmoothQuant fold 1/s into the activations and multiply the fp32 weights by s only as
    they are quantized or kept, so a scaled source writes nothing (an 8B model's scaled copy: 30 GB
    a recipe) and a layered calibration runs them too: the blocks are those of the scaled weights;
    w8 + SmoothQuant with every MatMul kept in fp32 computes the fp32 model (a kept weight left
    unscaled would not)."""
    import onnxruntime as ort

    from llmx.artifact.onnx_files import load_graph
    from llmx.calibration import pipeline
    from llmx.calibration.candidates import Candidate
    from llmx.calibration.feeds import prefill_feed
    from llmx.calibration.matmuls import initializers, read_array, weight_matmuls
    from llmx.calibration.progress import silent
    from llmx.calibration.rounding import quantize_importance
    from llmx.calibration.sensitivity import group_keys
    from llmx.calibration.weight_only_builder import WeightOnlyBuilder

    art = Artifact.of(store.artifact("llama"))
    options = CalibrationOptions(scheme="w4", layered=layered, **SMALL)
    paths = pipeline.prepare_fp32(art, tmp_path / "fp32", share_weights=layered)
    feeds = pipeline.make_feeds(art, windows(3, 32), 1)
    stats = pipeline.LazyStatistics(pipeline.reference_graphs(art, paths, options), feeds, options, silent,
                                    tmp_path)
    builder = WeightOnlyBuilder(paths, "decode", stats, "w4", True)
    before = {p.name: p.stat().st_size for p in paths["decode"].parent.iterdir()}
    source = builder.source(Candidate(awq=True, block_size=32))
    assert source.scales and source.dir == paths["decode"].parent
    assert {p.name: p.stat().st_size for p in source.dir.iterdir()} == before  # nothing written
    fp32 = initializers(load_graph(paths["decode"]))
    weights = [mm.weight for mm in weight_matmuls(load_graph(paths["decode"]))]
    keys = group_keys(load_graph(paths["decode"]))
    scaled = next(w for w in weights if keys[w] in source.scales)
    s = source.scales[keys[scaled]]
    got = builder.blocks(source, [(scaled, 4)], 32)[scaled]
    want = quantize_importance(read_array(fp32[scaled], paths["decode"].parent) * s[:, None], 32,
                               stats().mean_square(scaled) / np.square(s))
    for tensor, (_, array) in zip(got.tensors, want.arrays(scaled)):
        np.testing.assert_array_equal(read_array(tensor, source.dir), array)

    out = tmp_path / f"w8-sq-{layered}"
    options = CalibrationOptions(scheme="w8", smoothquant=0.5, block_size=32, fallback=tuple(weights), layered=layered,
                                 **SMALL)
    assert calibrate_artifact(art, out, text, options).precision.smoothquant == 0.5
    feed = prefill_feed(windows(1, 16)[0])
    logits = [ort.InferenceSession(str(a / "prefill.onnx")).run(["logits"], feed)[0] for a in (art.root, out)]
    assert not np.allclose(read_array(initializers(load_graph(out / "prefill.onnx"))[scaled], out),
                           read_array(fp32[scaled], paths["decode"].parent))  # kept scaled: its input is divided
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_awq_builds_the_same_artifact_whole_and_layered(store, text, tmp_path):
    """... and says how far it is in what takes minutes on a big model: fitting AWQ's scales
    (a bar over the MatMul groups) and quantizing the recipe (a bar over the weights)."""
    built, bars = [], {}

    class Bar:
        def __init__(self, description, total):
            self.description, self.total, self.done = description, total, 0
            bars.setdefault(description, []).append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            self.done += n

    for layered in (False, True):
        out = tmp_path / f"awq-{layered}"
        options = CalibrationOptions(scheme="w4", awq=True, block_size=32, fallback=(), layered=layered, **SMALL)
        assert calibrate_artifact(store.artifact("llama"), out, text, options, progress=Bar).precision.awq
        built.append((out / "weights.bin").read_bytes())
    assert built[0] == built[1]
    fits = bars["fitting AWQ scales (block 32)"]
    quantized = next(v for k, v in bars.items() if k.startswith("quantizing") and k.endswith("(block 32)"))
    assert len(fits) == 2 and all(b.total == b.done > 0 for b in fits + quantized)


def test_stored_tensors_keep_no_copy_of_their_bytes(tmp_path):
    """The search keeps every weight's blocks as references into the blocks file; a reference made
    by clearing a message's raw_data would keep the bytes' memory as long as the reference lives
    (8B w4: 3.9 GB). 20 tensors of 32 MiB held: the process grows by far less than their size."""
    from llmx.artifact.onnx_files import WeightsFile

    def anon() -> int:
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon"))

    array = np.ones((8 << 20,), np.float32)  # 32 MiB
    before = anon()
    with WeightsFile(tmp_path) as data:
        kept = [data.tensor(f"w{i}", array + i) for i in range(20)]
    assert anon() - before < 160 << 20  # 640 MiB if each kept its bytes
    assert kept[3].external_data and not kept[3].raw_data and list(kept[3].dims) == [8 << 20]
    small = WeightsFile(tmp_path, name="small.bin")
    with small:
        inline = small.tensor("s", np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(np.frombuffer(inline.raw_data, np.float32), np.arange(4))
    offset = int(next(e.value for e in kept[3].external_data if e.key == "offset"))
    np.testing.assert_array_equal(np.fromfile(tmp_path / "weights.bin", np.float32, 8 << 20, offset=offset), array + 3)


def _extra_traced(call) -> tuple[object, int]:
    """(call's result, the most bytes numpy held during it beyond what was held before)."""
    import tracemalloc

    started = not tracemalloc.is_tracing()  # under `python -X tracemalloc` it stays on after
    if started:
        tracemalloc.start()
    try:
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = call()
        return result, tracemalloc.get_traced_memory()[1] - held
    finally:
        if started:
            tracemalloc.stop()


def test_importance_rounding_makes_nothing_the_size_of_the_weight_beside_it():
    """An 8B model's 2.1 GB LM head, rounded whole, took 6 GB more (transposed, padded, the codes
    in float32): the peak of its w4 calibration. Column chunk by chunk, the extra is the codes while
    they are packed (0.7x the float32 weight), and the blocks are those of each column alone,
    rounded on one thread or two."""
    from llmx.calibration.rounding import quantize_importance

    rng = np.random.default_rng(0)
    w = rng.standard_normal((1000, 2048)).astype(np.float32)  # K not a multiple of the block
    importance = rng.random(1000) ** 3
    serial, extra = _extra_traced(lambda: quantize_importance(w, 32, importance, threads=1))
    assert extra < w.nbytes  # 3.5x before (a second thread adds its chunk's temporaries, not the weight's)
    blocks = quantize_importance(w, 32, importance, threads=2)
    np.testing.assert_array_equal(blocks.packed, serial.packed)
    np.testing.assert_array_equal(blocks.scales, serial.scales)
    alone = quantize_importance(w[:, 700:703], 32, importance)  # chunks hold many columns: 700 is inside one
    np.testing.assert_array_equal(blocks.packed[700:703], alone.packed)
    np.testing.assert_array_equal(blocks.scales[700:703], alone.scales)


def test_awq_fits_on_evenly_spaced_columns_read_weight_by_weight(tmp_path, monkeypatch):
    """A group wider than the fit reads is fitted on evenly spaced columns of its weights side by
    side, taken from each weight as it is read: no copy of the whole group beside it (3x its
    size before; an 8B LM head is 2.1 GB)."""
    from onnx import TensorProto

    from llmx.calibration import awq

    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((64, n)).astype(np.float32) for n in (3000, 1000, 5)]
    inits, offset = [], 0
    with open(tmp_path / "weights.bin", "wb") as f:
        for i, part in enumerate(parts):
            f.write(part.tobytes())
            init = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=part.shape)
            init.data_location = TensorProto.EXTERNAL
            for key, value in (("location", "weights.bin"), ("offset", str(offset)), ("length", str(part.nbytes))):
                init.external_data.add(key=key, value=value)
            inits.append(init)
            offset += part.nbytes
    group = np.concatenate(parts, axis=1)
    monkeypatch.setattr(awq, "FIT_WEIGHTS", 64 * 500)
    fitted, extra = _extra_traced(lambda: awq.fit_columns(inits, tmp_path))
    np.testing.assert_array_equal(fitted, group[:, np.linspace(0, group.shape[1] - 1, 500).astype(np.int64)])
    assert extra < 1.5 * group.nbytes  # the widest weight read once, then its columns taken (3x before)
    monkeypatch.setattr(awq, "FIT_WEIGHTS", 64 * 5000)  # narrower than the cap: all of it, in order
    np.testing.assert_array_equal(awq.fit_columns(inits, tmp_path), group)


def test_the_statistics_keep_their_sampled_rows_on_disk(store, tmp_path):
    """The rows AWQ fits on (an 8B model's: 0.8 GB) wait on disk beside a candidate's session and
    read back exactly."""
    from llmx.calibration import pipeline
    from llmx.calibration.activations import collect_stats
    from llmx.calibration.on_disk import ArrayMapOnDisk
    from llmx.calibration.progress import silent

    art = Artifact.of(store.artifact("llama"))
    options = CalibrationOptions(scheme="w4", layered=False, **SMALL)
    paths = pipeline.prepare_fp32(art, tmp_path / "fp32")
    feeds = pipeline.make_feeds(art, windows(3, 32), 1)
    spilled = pipeline.statistics(paths, feeds, options, silent, tmp_path)
    kept = collect_stats({"prefill": paths["prefill"]}, feeds, threads=1)
    assert isinstance(spilled.rows, ArrayMapOnDisk) and sorted(spilled.rows) == sorted(kept.rows)
    assert (tmp_path / "activation-rows.f32").stat().st_size == sum(r.nbytes for r in kept.rows.values()) > 0
    for weight, rows in kept.rows.items():
        assert spilled.rows[weight].dtype == rows.dtype and np.array_equal(spilled.rows[weight], rows)


@pytest.mark.parametrize("layered", [False, True])
def test_a_memory_short_search_grows_its_fallbacks_from_below(layered):
    """The fallback count's first guess (97 of 129 here: the error is taken as proportional to the
    local error left) is tried as predicted in a whole run; layered, where each fallback's blocks
    add to the session that sets the peak, no guess goes past halfway from the last miss. Both
    bracket the true count (47) the same way."""
    from llmx.calibration.judge import DecoderJudge
    from llmx.calibration.search import Search

    class Probe(Search):
        def attempt(self, candidate, stage):
            n = len(candidate.fallback)
            self.tried.append(n)
            ratio = float(np.exp(0.1 * (129 - n) / 129)) if n < 47 else 1.0
            return {"meets": n >= 47, "perplexity_ratio": ratio}

    probe = Probe(DecoderJudge, None, 1.03, 1, lambda msg: None, layered=layered)
    probe.tried = []
    order = [f"w{i}" for i in range(129)]
    base = {"method": None, "smoothquant": None, "awq": False, "fallback": [], "block_size": 32,
            "perplexity_ratio": float(np.exp(0.1))}
    probe.fewest_fallbacks(base, order, {w: 1.0 for w in order})
    assert probe.tried[0] == (64 if layered else 97)
    assert max(probe.tried) == probe.tried[0] and min(n for n in probe.tried if n >= 47) <= 50
