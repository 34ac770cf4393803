"""The accuracy-aware search of ``llmx calibrate``: it falls back on exactly the MatMuls that carry
planted activation outliers, refuses a target it cannot reach, and its flags fix its dimensions."""

from __future__ import annotations

import argparse
import inspect
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from llmx.calibration import CalibrationOptions, calibrate_artifact
from llmx.calibration.search import SearchSpace, format_search
from llmx.artifact import Artifact
from llmx.artifact.manifest import load_manifest
from outliers import plant_outliers
from test_cli import error_line, leftovers, run

SMALL = dict(samples=4, seq_len=64, eval_samples=6, threads=1)
PLANTED_LAYERS = (1, 4)


@pytest.fixture(scope="module")
def stdlib_text(tmp_path_factory) -> tuple[Path, Path]:
    """Calibration text from the demo model's training modules, held-out text from modules it never saw."""
    import functools
    import shutil
    import string

    root = tmp_path_factory.mktemp("search-data")
    calib, held_out = root / "calib", root / "heldout"
    calib.mkdir(), held_out.mkdir()
    for module in (shutil, string):
        (calib / f"{module.__name__}.py").write_text(inspect.getsource(module))
    for module in (argparse, functools):
        (held_out / f"{module.__name__}.py").write_text(inspect.getsource(module))
    return calib, held_out


@pytest.fixture(scope="module")
def planted(demo_artifact, tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("planted") / "art"
    return out, plant_outliers(demo_artifact, out, PLANTED_LAYERS, factor=80)


def decode_logits(artifact: Path, window: list[int]) -> np.ndarray:
    """The decode graph's log-probabilities over ``window`` from an empty cache (as the search's judge feeds it)."""
    from llmx.calibration.judge import DecoderJudge, session
    from llmx.runtime.sampling import log_softmax

    decode = session(artifact / "decode.onnx", 1)
    feed = DecoderJudge._feed(decode, load_manifest(artifact), window)
    return log_softmax(decode.run(["logits"], feed)[0][0, :-1])


def test_planted_outliers_leave_the_fp32_function_unchanged(planted, demo_artifact):
    art, weights = planted
    assert weights == [f"model.layers.{i}.attn.qkv.weight" for i in PLANTED_LAYERS]
    window = list(range(5, 69))
    np.testing.assert_allclose(decode_logits(art, window), decode_logits(demo_artifact, window), atol=2e-3)


def test_search_falls_back_on_exactly_the_planted_outlier_matmuls(planted, stdlib_text, tmp_path):
    """Static per-tensor INT8 without smoothing collapses on the loud channels; the sensitivity pass
    ranks the two MatMuls that read them first, and keeping those (one or both: the held-out
    perplexity decides) in fp32 is what meets the target."""
    art, weights = planted
    calib, held_out = stdlib_text
    space = SearchSpace(target=1.01, methods=("minmax",), alphas=(None,))
    options = CalibrationOptions(scheme="w8a8", search=space, **SMALL)
    manifest = calibrate_artifact(art, tmp_path / "q", calib, options, eval_data=held_out)
    report = manifest.extras["quality"]
    search = report["search"]
    recipe, *fallbacks = search["candidates"]
    assert recipe["fallback"] == [] and not recipe["meets"] and recipe["perplexity_ratio"] > 1.01
    ranked = sorted(search["sensitivity"], key=search["sensitivity"].get, reverse=True)
    assert sorted(ranked[:2]) == weights and len(ranked) == 25  # 4 MatMuls x 6 layers + lm_head
    chosen = search["candidates"][search["chosen"]]
    kept = sorted(chosen["fallback"])
    assert kept and set(kept) <= set(weights) and chosen["meets"]
    assert all(not r["meets"] for r in fallbacks if len(r["fallback"]) < len(kept))  # the fewest that meet
    assert len(fallbacks) <= 4  # the count predicted from the ranking, then checked: no walk through 1, 2, 4, ...
    assert sorted(manifest.precision.fallback) == kept
    assert report["meets_target"] and report["perplexity_ratio"] <= 1.01
    for graph in ("prefill", "decode"):  # those MatMuls read fp32 inputs and fp32 weights
        model = onnx.load_model(str(tmp_path / "q" / f"{graph}.onnx"), load_external_data=False)
        inits = {i.name: i for i in model.graph.initializer}
        matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
        assert sorted(n.input[1] for n in matmuls) == kept
        assert all(inits[n.input[1]].data_type == onnx.TensorProto.FLOAT for n in matmuls)


def test_default_search_meets_w8a8_on_planted_outliers(planted, stdlib_text, tmp_path):
    """With the default grid, SmoothQuant undoes the planted outliers. The target is the one the
    recipe without smoothing misses on any CPU (the test above): with AVX-512 VNNI's int8 sums it
    measures about 1.0125, inside the default 1.02; AVX2's saturating ones put it far outside."""
    art, _ = planted
    calib, held_out = stdlib_text
    options = CalibrationOptions(scheme="w8a8", search=SearchSpace(target=1.01), **SMALL)
    report = calibrate_artifact(art, tmp_path / "q", calib, options, eval_data=held_out).extras["quality"]
    assert report["meets_target"] and report["perplexity_ratio"] <= 1.01
    chosen = report["search"]["candidates"][report["search"]["chosen"]]
    assert chosen["smoothquant"] is not None and chosen["fallback"] == []
    assert report["options"]["smoothquant"] == chosen["smoothquant"]
    assert report["calibration_seconds"] > 0 and report["search"]["seconds"]["search"] > 0


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(inspect.getsource(argparse))
    return path


def test_unreachable_target_is_refused_with_the_best_found(store, calib_text, tmp_path, capsys):
    args = ["calibrate", str(store.artifact("llama")), "--data", str(calib_text), "--scheme", "w8", "--samples", "2",
            "--seq-len", "32", "--eval-samples", "2", "--threads", "1", "--target", "0.5", "--no-fallback"]
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    code, out, err = run([*args, "-o", str(out_parent / "a")], capsys)
    assert code == 1 and "no configuration meets the target (perplexity ratio <= 0.5)" in error_line(err)
    assert re.search(r"the best found, (rtn|sq[\d.]+) b(128|64|32|16), measures perplexity x", error_line(err))
    assert "recipe   rtn b128" in err and out == "" and leftovers(out_parent) == []
    code, out, err = run([*args, "-o", str(out_parent / "b"), "--force"], capsys)  # kept, and the report says so
    assert code == 0, err
    report = json.loads((out_parent / "b" / "quality.json").read_text())
    assert report["meets_target"] is False and report["search"]["met"] is False
    assert "the artifact MISSES the target" in out
    # the later block sizes are tried at the SmoothQuant alpha the block-128 tier found best
    rows = report["search"]["candidates"]
    first, later = rows[:3], rows[3:]
    assert [r["block_size"] for r in first] == [128] * 3 and [r["block_size"] for r in later] == [64, 32, 16]
    assert {r["smoothquant"] for r in later} == {min(first, key=lambda r: r["mean_kl"])["smoothquant"]}


def test_later_tiers_keep_the_channel_scaling_found_best():
    from llmx.calibration.candidates import Candidate
    from llmx.calibration.search import SearchSpace, narrowed

    minmax, percentile = SearchSpace().recipes("w8a8")
    assert [c.label() for c in narrowed(percentile, Candidate(method="minmax", alpha=0.8))] == ["percentile+sq0.8"]
    *_, block_32 = SearchSpace().recipes("w4")
    assert [c.label() for c in narrowed(block_32, Candidate(block_size=128, awq=True))] == ["awq b32"]
    assert narrowed(percentile, Candidate(method="minmax", alpha=0.3)) == percentile  # none matches: all tried


def test_recipes_are_tried_cheapest_first(store, calib_text, tmp_path):
    """minmax recipes (ranges straight from the statistics) first; percentile only when none meets."""
    options = dict(scheme="w8a8", samples=2, seq_len=32, eval_samples=2, threads=1)
    easy = calibrate_artifact(store.artifact("llama"), tmp_path / "easy", calib_text,
                              CalibrationOptions(**options, search=SearchSpace(target=1.5, alphas=(None,), fallback=False)))
    assert [r["method"] for r in easy.extras["quality"]["search"]["candidates"]] == ["minmax"]
    hard = calibrate_artifact(store.artifact("llama"), tmp_path / "hard", calib_text,
                              CalibrationOptions(**options, search=SearchSpace(target=0.5, alphas=(None,), fallback=False)),
                              force=True)
    assert [r["method"] for r in hard.extras["quality"]["search"]["candidates"]] == ["minmax", "percentile"]


def test_flags_fix_the_search_dimensions(store, calib_text, tmp_path, capsys):
    base = ["calibrate", str(store.artifact("llama")), "--data", str(calib_text), "--scheme", "w8a8", "--samples", "2",
            "--seq-len", "32", "--eval-samples", "2", "--threads", "1", "--target", "1.5", "--json"]
    code, out, err = run([*base, "--method", "minmax", "--smoothquant", "off", "-o", str(tmp_path / "a")], capsys)
    assert code == 0, err
    search = json.loads(out)["search"]
    assert [(r["method"], r["smoothquant"]) for r in search["candidates"]] == [("minmax", None)]
    code, out, err = run([*base, "--method", "percentile", "-o", str(tmp_path / "b")], capsys)
    assert code == 0, err
    recipes = [(r["method"], r["smoothquant"]) for r in json.loads(out)["search"]["candidates"]]
    assert recipes == [("percentile", None)]  # it meets: the tier's other alphas build the same kernels
    code, out, err = run([*base[:-3], "--target", "0.5", "--json", "--method", "percentile", "--no-fallback",
                          "--force", "-o", str(tmp_path / "b2")], capsys)
    assert code == 0, err
    recipes = [(r["method"], r["smoothquant"]) for r in json.loads(out)["search"]["candidates"]]
    assert recipes == [("percentile", None), ("percentile", 0.5), ("percentile", 0.8)]  # none meets: all tried
    code, out, err = run([*base[:-3], "--json", "--no-search", "-o", str(tmp_path / "c")], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert "search" not in report and report["options"]["method"] == "percentile"
    code, _, err = run([*base, "--no-search", "-o", str(tmp_path / "d")], capsys)
    assert code == 2 and "--target needs the search" in error_line(err)


def graph_block_sizes(model) -> set[int]:
    """The block_size attribute of every MatMulNBits node of one graph."""
    return {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}


def nbits_block_sizes(artifact: Path) -> set[int]:
    """The block sizes of every MatMulNBits node in both graphs of ``artifact``."""
    return set().union(*(graph_block_sizes(onnx.load_model(str(artifact / f"{graph}.onnx"), load_external_data=False))
                         for graph in ("prefill", "decode")))


def weight_only_args(store, calib_text, scheme: str) -> list[str]:
    return ["calibrate", str(store.artifact("llama")), "--data", str(calib_text), "--scheme", scheme, "--samples", "2",
            "--seq-len", "32", "--eval-samples", "2", "--threads", "1", "--json"]


def test_block_128_is_built_when_it_meets_the_target(store, calib_text, tmp_path, capsys):
    """The faster block size comes first; when it holds the target, block 32 is never tried."""
    code, out, err = run([*weight_only_args(store, calib_text, "w4"), "--target", "1.5", "-o", str(tmp_path / "q")],
                         capsys)
    assert code == 0, err
    report = json.loads(out)
    search = report["search"]
    assert [r["label"] for r in search["candidates"]] == ["rtn b128"]  # met: AWQ (the same kernels) not tried
    assert search["candidates"][search["chosen"]]["block_size"] == 128 and search["met"]
    for measured in [*search["candidates"], search["fp32"]]:  # every candidate is timed, and fp32 beside them
        assert measured["decode_tok_s"] > 0 and measured["prefill_ms"] > 0
        assert measured["cost_ms"] > measured["step_ms"] == pytest.approx(1e3 / measured["decode_tok_s"], rel=0.01)
    assert re.search(r"recipe   rtn b128 .* tok/s, prefill \d+ ms", err) and "fp32: " in format_search(search)
    assert report["options"]["block_size"] == 128 and report == json.loads((tmp_path / "q" / "quality.json").read_text())
    assert load_manifest(tmp_path / "q").precision.block_size == 128
    assert nbits_block_sizes(tmp_path / "q") == {128}


def test_block_32_when_only_it_meets_the_target(store, calib_text, tmp_path, capsys):
    """A target set between the block sizes' measured bounds: the block-128 and block-64 tiers
    miss, so the block-32 tier runs after them and is chosen."""
    args = [*weight_only_args(store, calib_text, "w8"), "--no-fallback", "--force", "--smoothquant", "off"]
    code, out, err = run([*args, "--target", "0.5", "-o", str(tmp_path / "measure")], capsys)
    assert code == 0, err
    rows = json.loads(out)["search"]["candidates"]
    assert [r["label"] for r in rows] == ["rtn b128", "rtn b64", "rtn b32", "rtn b16"]  # 8-bit blocks of 16 decode fast
    coarse, middle, fine = (r["perplexity_ratio_upper"] for r in rows[:3])
    assert min(coarse, middle) > fine  # the premise: on this model block 32 is measurably closer to fp32
    code, out, err = run([*args, "--target", repr((min(coarse, middle) + fine) / 2), "-o", str(tmp_path / "q")], capsys)
    assert code == 0, err
    search = json.loads(out)["search"]
    assert [(r["label"], r["meets"]) for r in search["candidates"]] == [("rtn b128", False), ("rtn b64", False),
                                                                       ("rtn b32", True)]
    assert search["chosen"] == 2 and search["met"]
    assert load_manifest(tmp_path / "q").precision.block_size == 32 and nbits_block_sizes(tmp_path / "q") == {32}
    # a target 5x inside block 128's excess: block 64 (at best 4x closer) is skipped, 32 tried
    excess = max(np.log(rows[0]["perplexity_ratio_upper"]), rows[0]["mean_kl"])
    code, out, err = run([*args, "--target", repr(float(np.exp(excess / 5))), "-o", str(tmp_path / "far")], capsys)
    labels = [r["label"] for r in json.loads(out)["search"]["candidates"]]
    assert labels[:2] == ["rtn b128", "rtn b32"] and "rtn b64" not in labels and "skipping block 64" in err


def test_a_block_tier_out_of_reach_is_skipped():
    """Halving a block cuts a recipe's excess by at most REACH_PER_HALVING: a tier that even then
    could not meet is not built. Numbers: SmolLM2-135M w4, AWQ block 128 (excess 0.397, w4's budget ln 1.03)."""
    from llmx.calibration.candidates import Candidate
    from llmx.calibration.search import out_of_reach

    best, budget = {"block_size": 128}, float(np.log(1.03))
    assert out_of_reach(best, Candidate(block_size=64), 0.397, budget)
    assert not out_of_reach(best, Candidate(block_size=32), 0.397, budget)  # 16x: within reach
    assert not out_of_reach(best, Candidate(block_size=64), 0.1, budget)
    assert not out_of_reach(best, Candidate(method="minmax"), 10.0, budget)  # w8a8's tiers are not blocks
    assert not out_of_reach(best, Candidate(block_size=64), 0.397, float(np.log(0.5)))  # nothing meets: measure all


def test_scoring_stops_once_a_candidate_cannot_meet_the_target():
    """KL (and 1 - cosine) is never negative: once what the windows scored so far add up to exceeds
    the target's budget over every window, the candidate misses whatever the rest hold. Stopping
    there never changes a verdict; a candidate far off stops after its first window, one that
    meets is scored to the end (judge and sessions faked: random logits, noise of growing size)."""
    from llmx.calibration.judge import DecoderJudge, EncoderJudge, meets
    from llmx.runtime.sampling import log_softmax

    rng = np.random.default_rng(5)
    windows, vocab, tokens = 8, 6, 17
    logits = [rng.normal(size=(1, tokens, vocab)).astype(np.float32) for _ in range(windows)]
    decoder = object.__new__(DecoderJudge)
    decoder.feeds = list(range(windows))
    decoder.reference = [log_softmax(x[0, :-1]).astype(np.float16) for x in logits]
    decoder.targets = [rng.integers(0, vocab, tokens - 1) for _ in range(windows)]
    encoder = object.__new__(EncoderJudge)
    encoder.feeds = [{"input_ids": np.zeros((1, 4), np.int64), "i": i} for i in range(windows)]
    encoder.reference = np.concatenate([x[:, 0] for x in logits])

    class Session:
        def __init__(self, noise):
            self.noise, self.calls = noise, 0

        def run(self, names, feed):
            self.calls += 1
            if isinstance(feed, dict):  # an encoder's batch: one sentence's embedding
                return [logits[feed["i"]][:, 0] + self.noise[feed["i"]][:, 0]]
            return [logits[feed] + self.noise[feed]]

    outcomes = set()
    for judge, target in ((decoder, 1.02), (encoder, 0.99)):
        for scale in (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 3.0):
            noise = [scale * rng.normal(size=x.shape).astype(np.float32) for x in logits]
            full, early = judge.score(Session(noise)), judge.score(session := Session(noise), target=target)
            assert meets(early, target) == meets(full, target)
            if "scored" in early:
                assert early["scored"] == f"{session.calls}/{windows}" and session.calls < windows
            else:
                assert session.calls == windows and early == full
            outcomes.add((judge.graph, meets(full, target), session.calls))
        assert (judge.graph, True, windows) in outcomes and (judge.graph, False, 1) in outcomes


def test_block_size_flag_fixes_the_search_and_no_search_keeps_32(store, calib_text, tmp_path, capsys):
    args = weight_only_args(store, calib_text, "w4")
    code, out, err = run([*args, "--target", "1.5", "--block-size", "64", "-o", str(tmp_path / "a")], capsys)
    assert code == 0, err
    search = json.loads(out)["search"]
    assert [r["label"] for r in search["candidates"]] == ["rtn b64"]
    assert load_manifest(tmp_path / "a").precision.block_size == 64 and nbits_block_sizes(tmp_path / "a") == {64}
    code, out, err = run([*args, "--no-search", "-o", str(tmp_path / "b")], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert "search" not in report and report["options"]["block_size"] == 32
    assert load_manifest(tmp_path / "b").precision.block_size == 32 and nbits_block_sizes(tmp_path / "b") == {32}


def test_pick_prefers_fewer_fallbacks_then_the_larger_block():
    from llmx.calibration.search import pick

    def row(block: int, fallback: int, kl: float, meets: bool = True, cost: float = 10.0) -> dict:
        return {"method": None, "smoothquant": None, "awq": False, "block_size": block, "fallback": ["w"] * fallback,
                "mean_kl": kl, "meets": meets, "cost_ms": cost}

    error = lambda r: r["mean_kl"]  # noqa: E731
    rows = [row(128, 0, 0.02, meets=False), row(32, 0, 0.01), row(128, 1, 0.001), row(128, 0, 0.009, meets=False)]
    assert pick(rows, error) is rows[1]  # no fallback beats a larger block that needs one
    rows.append(row(128, 0, 0.015))
    assert pick(rows, error) is rows[-1]  # same fallbacks: the larger block, though its error is higher
    assert pick([row(128, 0, 0.02, False), row(32, 0, 0.01, False)], error)["block_size"] == 32  # none meets


def test_pick_takes_the_fastest_measured_row_beyond_the_timing_noise():
    """Speed is the objective: a row measured clearly faster wins over one with fewer fallbacks or a
    larger block; within SPEED_TOLERANCE of the fastest, the certain preferences decide."""
    from llmx.calibration.search import SPEED_TOLERANCE, pick

    def row(block: int, fallback: int, cost: float, meets: bool = True) -> dict:
        return {"method": None, "smoothquant": None, "awq": False, "block_size": block, "fallback": ["w"] * fallback,
                "mean_kl": 0.01, "meets": meets, "cost_ms": cost}

    error = lambda r: r["mean_kl"]  # noqa: E731
    slow, fast = row(128, 0, 20.0), row(32, 3, 10.0)
    assert pick([slow, fast], error) is fast
    near = row(128, 0, 10.0 * SPEED_TOLERANCE * 0.99)
    assert pick([slow, fast, near], error) is near
    assert pick([row(16, 0, 1.0, meets=False), slow], error) is slow  # a fast miss never wins
    few, more = row(128, 1, 12.0), row(128, 4, 9.0)  # one recipe: its extra fallbacks only add cost, timed or not
    assert pick([few, more], error) is few


def test_fallbacks_are_added_until_kl_holds_the_target_where_the_ratio_already_does():
    """The held-out ratio meets from the start, but the candidate's distributions are further from
    fp32's than the target allows (exp(mean KL) > target): the search keeps falling back until KL
    holds too, and picks the fewest that do. Judge and graphs are faked: KL falls with each of ten
    equally sensitive MatMuls kept, 0.05 x (10 - n) / 10; ln(1.02) = 0.0198 needs n = 7."""
    from llmx.calibration.candidates import Candidate
    from llmx.calibration.judge import DecoderJudge
    from llmx.calibration.search import Search, pick

    weights = [f"model.layers.{i}.mlp.down.weight" for i in range(10)]

    class Judge(DecoderJudge):
        feeds = [None]

        def __init__(self):
            pass

        def score(self, candidate, progress=lambda n: None, limit=None, target=None):
            kept = len(candidate.fallback)
            return {"perplexity_ratio": 1.0, "perplexity_ratio_upper": 1.001, "top1_agreement": 1.0,
                    "mean_kl": 0.05 * (10 - kept) / 10}

        def speed(self, candidate):
            return {"step_ms": 1.0, "prefill_ms": 1.0, "decode_tok_s": 1e3, "cost_ms": 1.0 + len(candidate.fallback)}

    class Builder:
        def build(self, candidate):
            return candidate, 0

    class Faked(Search):
        def session(self, graph):
            return graph

    search = Faked(Judge(), Builder(), 1.02, 1, lambda msg: None)
    base = search.attempt(Candidate(method="minmax", alpha=0.8), "recipe")
    assert base["perplexity_ratio_upper"] <= 1.02 and not base["meets"]  # the ratio alone would stop here
    search.fewest_fallbacks(base, weights, {w: 1.0 for w in weights})
    chosen = pick(search.rows, DecoderJudge.error)
    assert chosen["fallback"] == weights[:7] and chosen["meets"]
    assert all(not r["meets"] for r in search.rows if len(r["fallback"]) < 7)
    assert len(search.rows) <= 5  # predicted from the KL excess, then checked: not a walk from 1


def test_a_pick_slower_than_fp32_is_said_loudly(store, calib_text, tmp_path, capsys, monkeypatch):
    """The fp32 graph is timed first; when the quantized pick measures slower, the log and the
    record say so (here the timings are faked: quantized graphs twice as slow)."""
    from llmx.calibration.judge import DecoderJudge

    calls = []

    def speed(self, candidate) -> dict:
        calls.append(candidate)
        step = 1.0 if len(calls) == 1 else 2.0
        return {"step_ms": step, "prefill_ms": 10.0, "decode_tok_s": 1e3 / step, "cost_ms": step + 0.1}

    monkeypatch.setattr(DecoderJudge, "speed", speed)
    code, out, err = run([*weight_only_args(store, calib_text, "w8"), "--target", "1.5", "-o", str(tmp_path / "q")],
                         capsys)
    assert code == 0, err
    search = json.loads(out)["search"]
    assert search["slower_than_fp32"] and search["fp32"]["cost_ms"] == 1.1
    assert "WARNING: the chosen rtn b128 runs slower than the fp32 graph" in err


def test_weight_only_sensitivity_is_ranked_by_the_kernel_in_one_pass(planted, stdlib_text, tmp_path):
    """The local pass runs each MatMul's own MatMulNBits kernel (INT8 activations per block) on its
    calibration rows: the planted loud channels make exactly their two MatMuls the worst, and
    blocks of 16 (the loud channels spoil fewer neighbours) cut their error."""
    from llmx.calibration.activations import collect_stats
    from llmx.calibration.candidates import Candidate
    from llmx.calibration.weight_only_builder import WeightOnlyBuilder
    from llmx.calibration.data import read_text_data, token_windows
    from llmx.calibration.pipeline import make_feeds, prepare_fp32
    from llmx.runtime.tokenizer import Tokenizer

    art, weights = planted
    src = Artifact.open(art)
    windows = token_windows(Tokenizer(src), read_text_data(stdlib_text[0]), 64)[:4]
    paths = prepare_fp32(src, tmp_path / "fp32")
    stats = collect_stats(paths, make_feeds(src, windows, 1), threads=1)
    builder = WeightOnlyBuilder(paths, "decode", None, "w8", True)
    coarse = builder.local_errors(Candidate(block_size=128), stats.rows, threads=1)
    fine = builder.local_errors(Candidate(block_size=16), stats.rows, threads=1)
    assert sorted(coarse) == sorted(builder.weights())
    assert sorted(sorted(coarse, key=coarse.get)[-2:]) == weights
    assert all(fine[w] < coarse[w] for w in weights)


def test_w8_smoothquant_flattens_the_int8_activations(planted, stdlib_text, tmp_path):
    """MatMulNBits (accuracy level 4) rounds activations to INT8 per block, so w8's error is mostly
    loud channels: SmoothQuant moves them into the 8-bit weights, and the artifact records it."""
    from llmx.errors import InputError

    art, _ = planted
    calib, held_out = stdlib_text
    ratios = {}
    for alpha in (None, 0.5):
        options = CalibrationOptions(scheme="w8", block_size=128, smoothquant=alpha, **SMALL)
        manifest = calibrate_artifact(art, tmp_path / f"q{alpha}", calib, options, eval_data=held_out)
        ratios[alpha] = manifest.extras["quality"]["perplexity_ratio"]
        assert manifest.precision.smoothquant == alpha and manifest.precision.scheme == "w8"
    assert ratios[0.5] < ratios[None]
    with pytest.raises(InputError, match="--smoothquant and --awq"):
        CalibrationOptions(scheme="w4", smoothquant=0.5, awq=True).validate()


# -- the building blocks ---------------------------------------------------------------------

def test_ranges_from_statistics_are_what_the_ort_calibrators_find(store, calib_text, tmp_path):
    """The search derives minmax and percentile ranges from one statistics pass: minmax is what
    ORT's MinMax finds; percentile is exact, where ORT's histogram puts it up to one of its 2048
    bins lower."""
    from llmx.calibration.activations import TOP_ROWS, collect_stats
    from llmx.calibration.data import read_text_data, token_windows
    from llmx.calibration.pipeline import make_feeds, prepare_fp32
    from llmx.calibration.static import collect_ranges, ranges_from_stats
    from llmx.runtime.tokenizer import Tokenizer

    src = Artifact.open(store.artifact("llama"))
    windows = token_windows(Tokenizer(src), read_text_data(calib_text), 32)[:3]
    paths = prepare_fp32(src, tmp_path / "fp32")
    feeds = make_feeds(src, windows, 1)
    stats = collect_stats(paths, feeds, threads=1, top_rows=TOP_ROWS, top_graphs=tuple(paths))
    for graph, path in paths.items():
        model = onnx.load_model(str(path), load_external_data=False)
        for method in ("minmax", "percentile"):
            ours = ranges_from_stats(method, model, stats, graph)
            theirs = collect_ranges(path, feeds(graph), method)
            assert set(ours.keys()) == set(theirs.keys()) and len(ours.keys()) == 9
            for name in ours.keys():
                # what a symmetric range quantizes with (ORT clips percentile's to the signed extremes)
                top, found = (float(np.abs(t[name].range_value).max()) for t in (ours, theirs))
                if method == "minmax":
                    np.testing.assert_allclose(top, found, rtol=1e-6)
                else:
                    assert found <= top * (1 + 1e-6) and top - found <= top / 2048 * 1.001, (graph, name)
    assert ranges_from_stats("entropy", model, stats, graph) is None  # not decided by the statistics


def test_percentile_ranges_from_each_channels_largest_values_are_exact_or_refused(tmp_path):
    """Kept top rows decide the percentile of |X / s| for any channel scaling s: equal to sorting
    every value, within one histogram bin above ONNX Runtime's PercentileCalibrater on the same
    feeds; when one channel holds more of the clipped values than were kept, no range is given."""
    from onnxruntime.quantization import calibrate

    from llmx.calibration.activations import ActivationStats
    from llmx.calibration.sensitivity import PROBE_INPUT, probe_model
    from llmx.calibration.smoothquant import groups
    from llmx.calibration.static import percentile_ranges

    rng = np.random.default_rng(3)
    loud = np.linspace(0.5, 4, 16, dtype=np.float32)  # channels of different ranges, heavy tails
    xs = [rng.standard_t(3, size=(300, 16)).astype(np.float32) * loud for _ in range(4)]
    model = probe_model(rng.normal(size=(16, 8)))
    stats = ActivationStats(top_rows=48, top_graphs=("g",))
    for x in xs:
        stats.add("g", ["w"], x, rng)
    assert stats.seen["g"]["w"] == 1200 and stats.tops["g"]["w"].shape == (16, 48)
    onnx.save_model(model, str(tmp_path / "probe.onnx"))
    percentile, s = 99.8, np.linspace(2.0, 0.25, 16).astype(np.float32)
    for scales in (None, {groups(model)[0].key: s}):
        scale = np.ones(16, np.float32) if scales is None else s
        ours = percentile_ranges(model, stats.tops["g"], stats.seen["g"], scales, percentile)[PROBE_INPUT].range_value[1]
        values = np.sort(np.abs(np.concatenate(xs) / scale).ravel())
        exact = values[int(np.ceil(len(values) * percentile / 100)) - 1]  # the smallest with >= 99.8 % at or below
        assert ours == pytest.approx(exact, rel=1e-6) and len(values) - np.searchsorted(values, exact) == 39
        ort = calibrate.PercentileCalibrater(str(tmp_path / "probe.onnx"), ["MatMul"], str(tmp_path / "aug.onnx"),
                                             symmetric=True, num_bins=2048, percentile=percentile)
        ort.augment_graph()
        ort.create_inference_session()
        for x in xs:
            ort.collect_data(_Reader(x / scale))
        found = float(np.abs(ort.compute_data()[PROBE_INPUT].range_value).max())
        width = np.abs(xs[0] / scale).max() / 2048  # the first feed's bins
        assert found <= ours <= found + width * 1.001
    one = ActivationStats(top_rows=4, top_graphs=("g",))  # channel 0 alone holds the top 0.2 %: 4 of its values cannot say
    x = rng.normal(size=(1200, 16)).astype(np.float32)
    x[:, 0] = 100 + rng.random(1200, dtype=np.float32)
    one.add("g", ["w"], x, rng)
    assert percentile_ranges(model, one.tops["g"], one.seen["g"], None, percentile) is None
    assert percentile_ranges(model, one.tops["g"], one.seen["g"], None, 99.99) is not None  # the top 2: kept


class _Reader:
    """One feed, as ONNX Runtime's calibrators read data."""

    def __init__(self, x: np.ndarray):
        self.feed = {"x": x}

    def get_next(self):
        feed, self.feed = self.feed, None
        return feed


def test_awq_scale_beats_rounding_when_a_few_channels_are_salient():
    from llmx.calibration.awq import best_scale, fake_quantize

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 128)).astype(np.float32)
    x[:, :4] *= 30  # salient input channels
    w = rng.normal(size=(128, 64)).astype(np.float32)
    s = best_scale(x, w, np.abs(x).mean(0), block_size=32, bits=4)
    assert s is not None and s[:4].min() > np.median(s)  # salient rows scaled up
    rtn = ((x @ fake_quantize(w, 4, 32) - x @ w) ** 2).mean()
    awq = (((x / s) @ fake_quantize(w * s[:, None], 4, 32) - x @ w) ** 2).mean()
    assert awq < 0.8 * rtn
    flat = np.ones((256, 128), np.float32)  # no salience: plain rounding is kept
    assert best_scale(flat, w, np.ones(128), 32, 4) is None


@pytest.mark.parametrize("symmetric", [True, False])
def test_importance_rounding_beats_round_to_nearest_on_the_kernels_output(symmetric):
    """rounding.py picks each block's scale (and zero point) for the error x @ W makes, weighting
    each input channel by mean x^2: with a few loud channels the MatMulNBits kernel's own output
    is much closer to x @ W than with ONNX Runtime's round-to-nearest, and never farther by the
    weighted measure, block by block (its scale is in the grid)."""
    from llmx.calibration.rounding import quantize_importance
    from llmx.calibration.sensitivity import nbits_probe, quantized_product, relative_error
    from llmx.quant_blocks import quantize_blocks

    rng = np.random.default_rng(0)
    k, n, block = 200, 96, 32  # K not a multiple of the block: the last one is padded
    x = rng.normal(size=(512, k)).astype(np.float32)
    x[:, [3, 70, 150]] *= 25  # loud input channels
    w = rng.normal(size=(k, n)).astype(np.float32) + (0 if symmetric else 0.7)
    importance = np.square(x).mean(0)
    ours = quantize_importance(w, block, importance, symmetric)
    theirs = quantize_blocks(w, 4, block, symmetric)
    assert (ours.zero_points is None) == symmetric and ours.packed.shape == theirs.packed.shape

    def output_error(blocks):
        return relative_error(x @ w, quantized_product(x, nbits_probe(blocks.initializers("w", k), "w"), 1))

    def weighted_error(blocks):  # per block, from the kernel's own dequantization (x = identity rows)
        values = quantized_product(np.eye(k, dtype=np.float32), nbits_probe(blocks.initializers("w", k), "w"), 1)
        error = importance[:, None] * np.square(values - w)
        return np.pad(error, ((0, -k % block), (0, 0))).reshape(-1, block, n).sum(1)

    assert output_error(ours) < 0.6 * output_error(theirs)
    assert np.all(weighted_error(ours) <= weighted_error(theirs) * (1 + 1e-4) + 1e-6)


def test_awq_models_are_cached_per_block_size(store, monkeypatch, tmp_path):
    """AWQ's scales are fitted to the blocks they round in: one smoothed model per block size, reused."""
    import llmx.calibration.weight_only_builder as candidates
    from llmx.calibration.activations import ActivationStats
    from llmx.calibration.candidates import Candidate
    from llmx.calibration.weight_only_builder import WeightOnlyBuilder

    fitted = []
    monkeypatch.setattr(candidates, "awq_scales",
                        lambda model, base, stats, block, bits, progress: fitted.append(block) or {})
    shutil.copytree(store.artifact("llama"), tmp_path / "fp32")
    builder = WeightOnlyBuilder({"decode": tmp_path / "fp32" / "decode.onnx"}, "decode", ActivationStats, "w4", True)
    for block in (128, 32, 128):
        path, _ = builder.build(Candidate(awq=True, block_size=block))
        assert graph_block_sizes(onnx.load_model(str(path), load_external_data=False)) == {block}
    assert fitted == [128, 32]
    assert builder.source(Candidate(awq=False, block_size=128)).models is builder.fp32


@pytest.fixture
def tied_fp32(store, tmp_path):
    """A fused tied llama's decode graph (its lookup reads the head), untied as calibration
    prepares it, in a directory of its own; (path, weight names)."""
    from llmx.calibration.matmuls import name_nodes, untie_weights, weight_matmuls

    model = onnx.load_model(str(store.optimized("llama-tied-llama3rope-bias") / "decode.onnx"))
    name_nodes(model)
    untie_weights(model)
    onnx.save_model(model, str(tmp_path / "decode.onnx"), save_as_external_data=True, location="weights.bin")
    return tmp_path / "decode.onnx", [mm.weight for mm in weight_matmuls(model)]


@pytest.mark.parametrize("scheme", ["w8", "w4"])
def test_searched_graph_is_what_onnx_runtimes_quantizer_writes(scheme, tied_fp32, tmp_path):
    """The search and the artifact assemble each graph on disk from blocks quantized once per
    recipe (weight_only_builder.py); tensor for tensor it is what ONNX Runtime's own
    MatMulNBitsQuantizer writes, the tied lookup then reading the head's blocks."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from llmx.calibration.candidates import Candidate
    from llmx.calibration.weight_only import lookups_from_blocks
    from llmx.calibration.weight_only_builder import WeightOnlyBuilder

    fp32, weights = tied_fp32
    builder = WeightOnlyBuilder({"decode": fp32}, "decode", None, scheme, True)
    first, _ = builder.build(Candidate(block_size=32, fallback=(weights[1],)))
    path, size = builder.build(Candidate(block_size=32))  # reuses the first one's blocks
    ours = onnx.load_model(str(path))
    quantizer = MatMulNBitsQuantizer(onnx.load_model(str(fp32)), bits=8 if scheme == "w8" else 4, block_size=32,
                                     is_symmetric=True, accuracy_level=4, op_types_to_quantize=("MatMul",))
    quantizer.process()
    theirs = quantizer.model.model
    assert lookups_from_blocks(theirs) == 1
    assert [n.op_type for n in ours.graph.node] == [n.op_type for n in theirs.graph.node]
    ours_t = {i.name: onnx.numpy_helper.to_array(i, str(path.parent)) for i in ours.graph.initializer}
    theirs_t = {i.name: onnx.numpy_helper.to_array(i) for i in theirs.graph.initializer}
    assert sorted(ours_t) == sorted(theirs_t)
    for name, value in theirs_t.items():
        np.testing.assert_array_equal(ours_t[name], value, err_msg=name)
    assert size == sum(v.nbytes for v in ours_t.values())


@pytest.mark.parametrize("per_channel", [True, False])
def test_w8a8_graph_is_what_onnx_runtimes_quantizer_writes_unaided(per_channel, tied_fp32, tmp_path):
    """quantize_qdq hands ONNX Runtime's quantizer the per-channel weight scales and rounds each
    weight as one array (static.py: its own loop runs per output channel in Python); node for node
    and byte for byte the graph is what the quantizer writes on its own. The weights are planted
    with what the arithmetic must get right: a zero column (scale 1), a column whose largest |w| is
    negative, values on rounding halves, float16-sized tiny ones."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import save_tensors_data

    from llmx.calibration.matmuls import declare_activation_types, initializers, weight_matmuls
    from llmx.calibration.static import minmax_ranges, quantize_qdq

    fp32, weights = tied_fp32
    model = onnx.load_model(str(fp32))
    declare_activation_types(model)
    inits = initializers(model)
    for i, mm in enumerate(weight_matmuls(model)):
        w = onnx.numpy_helper.to_array(inits[mm.weight]).copy()
        w[:, 0] = 0.0
        w[:, 1] = -np.abs(w[:, 1]) * 3
        w[:, 2] = (np.arange(w.shape[0]) % 100 + 0.5) * 2.0 ** -(7 + i % 3)  # exact halves of the scale step:
        w[0, 2] = 127 * 2.0 ** -(7 + i % 3)  # scale 2^-(7..9), so w / scale lands on k + 0.5 (round half to even)
        w[:, 3] *= 1e-39
        inits[mm.weight].CopyFrom(onnx.numpy_helper.from_array(w, mm.weight))
    onnx.save_model(model, str(fp32), save_as_external_data=True, location="weights.bin")
    rng = np.random.default_rng(0)
    absmax = {mm.weight: rng.uniform(0.5, 4.0, inits[mm.weight].dims[0]).astype(np.float32) for mm in weight_matmuls(model)}
    ranges = minmax_ranges(model, absmax)
    ours, theirs = tmp_path / "ours" / "decode.onnx", tmp_path / "theirs" / "decode.onnx"
    ours.parent.mkdir(), theirs.parent.mkdir()
    skip = {weights[2]}
    quantize_qdq(fp32, ours, ranges, "minmax", per_channel=per_channel, skip=skip)
    cache = theirs.with_suffix(".ranges.json")
    save_tensors_data(ranges, cache)
    nodes = [mm.node.name for mm in weight_matmuls(model) if mm.weight not in skip]
    quantize_static(str(fp32), str(theirs), None, quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                    nodes_to_quantize=nodes, per_channel=per_channel, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8, calibration_cache_path=str(cache), use_external_data_format=True,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "MatMulConstBOnly": True,
                                   "OpTypesToExcludeOutputQuantization": ["MatMul"],
                                   "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1}})
    a, b = onnx.load_model(str(ours)), onnx.load_model(str(theirs))
    assert [(n.op_type, list(n.input), list(n.output)) for n in a.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in b.graph.node]
    mine = {i.name: onnx.numpy_helper.to_array(i) for i in a.graph.initializer}
    reference = {i.name: onnx.numpy_helper.to_array(i) for i in b.graph.initializer}
    assert sorted(mine) == sorted(reference)
    for name, value in reference.items():
        assert mine[name].dtype == value.dtype and mine[name].tobytes() == value.tobytes(), name
    scales = [v for k, v in reference.items() if k.endswith("_scale") and v.ndim == 1]
    assert (bool(scales) and any((v == 1.0).any() for v in scales)) == per_channel  # the zero column's scale


def test_w8a8_fallback_graphs_derived_from_the_recipe_graph_equal_the_quantizers(store, tied_fp32, tmp_path):
    """A w8a8 recipe is quantized by ONNX Runtime once; a fallback graph derived from it (the
    MatMuls left out read their activation and fp32 weight again) computes what the quantizer
    writes when told to skip them."""
    import onnxruntime as ort

    from llmx.artifact.manifest import load_manifest
    from llmx.calibration.candidates import fp32_matmuls
    from llmx.calibration.judge import DecoderJudge
    from llmx.calibration.matmuls import declare_activation_types, initializers, weight_matmuls
    from llmx.calibration.static import minmax_ranges, quantize_qdq

    fp32, weights = tied_fp32
    model = onnx.load_model(str(fp32), load_external_data=False)
    declare_activation_types(model)  # as calibration prepares its fp32 graphs: the quantizer needs them
    onnx.save_model(model, str(fp32))
    rng = np.random.default_rng(0)
    inits = initializers(model)
    absmax = {mm.weight: rng.uniform(0.5, 4.0, inits[mm.weight].dims[0]).astype(np.float32) for mm in weight_matmuls(model)}
    ranges = minmax_ranges(model, absmax)
    skip = {weights[0], weights[4], weights[-1]}
    recipe, direct = fp32.with_name("qdq-minmax.onnx"), tmp_path / "direct" / "decode.onnx"
    direct.parent.mkdir()
    quantize_qdq(fp32, recipe, ranges, "minmax")
    quantize_qdq(fp32, direct, ranges, "minmax", skip=skip)
    derived = onnx.load_model(str(recipe), load_external_data=False)
    by_node = {mm.node.name: mm.weight for mm in weight_matmuls(model)}
    fp32_matmuls(derived, {n: w for n, w in by_node.items() if w in skip}, inits)
    onnx.save_model(derived, str(fp32.with_name("derived.onnx")))
    ops = [n.op_type for n in derived.graph.node]
    assert ops.count("QuantizeLinear") == len(weights) - len(skip) == ops.count("MatMul") - len(skip)
    window = list(range(5, 5 + 24))
    manifest = load_manifest(store.optimized("llama-tied-llama3rope-bias"))
    outputs = []
    for path in (fp32.with_name("derived.onnx"), direct):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outputs.append(session.run(["logits"], DecoderJudge._feed(session, manifest, window))[0])
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=0, atol=1e-5 * np.abs(outputs[1]).max())


@pytest.mark.parametrize("scheme", ["w8", "w4"])
def test_weight_only_fallback_precision(scheme, tied_fp32, tmp_path):
    """w8 fallback: an fp32 MatMul (never accuracy level 0, which dequantizes per call); w4 fallback:
    8-bit weights in blocks of FALLBACK_BLOCK_8BIT; outside a per-layer graph's weights: fp32. Every MatMulNBits computes at
    accuracy level 4. The artifact's graphs are the searched graph's."""
    from llmx.calibration.candidates import Candidate
    from llmx.calibration.weight_only_builder import FALLBACK_BLOCK_8BIT, WeightOnlyBuilder

    fp32, weights = tied_fp32
    builder = WeightOnlyBuilder({"decode": fp32}, "decode", None, scheme, True)
    held = weights[0]
    searched = onnx.load_model(str(builder.build(Candidate(block_size=32, fallback=(held,)))[0]))
    models, _, record = builder.graphs(Candidate(block_size=32, fallback=(held,)))
    assert record == {} and [n.op_type for n in models["decode"].graph.node] == [n.op_type for n in searched.graph.node]
    for out, quantized in ((searched, set(weights) - ({held} if scheme == "w8" else set())),
                           (onnx.load_model(str(builder.only(Candidate(block_size=32), weights[2:4]))), set(weights[2:4]))):
        nodes = {n.input[1].rsplit("_Q", 1)[0]: n for n in out.graph.node if n.op_type == "MatMulNBits"}
        level = {w: {a.name: a.i for a in n.attribute}.get("accuracy_level", 0) for w, n in nodes.items()}
        bits = {w: {a.name: a.i for a in n.attribute}["bits"] for w, n in nodes.items()}
        blocks = {w: {a.name: a.i for a in n.attribute}["block_size"] for w, n in nodes.items()}
        assert set(nodes) == quantized and set(level.values()) == {4}
        fp32_matmuls = {n.input[1] for n in out.graph.node if n.op_type == "MatMul"}
        assert fp32_matmuls == set(weights) - quantized
        if out is searched and scheme == "w4":  # the 8-bit rung in wider blocks: fewer scales, as close
            assert bits[held] == 8 and all(bits[w] == 4 for w in nodes if w != held)
            assert blocks[held] == FALLBACK_BLOCK_8BIT and all(blocks[w] == 32 for w in nodes if w != held)
        elif out is searched:
            assert set(bits.values()) == {8} and set(blocks.values()) == {32}
        else:
            assert set(blocks.values()) == {32}


def test_sensitivity_groups_weights_by_layer_and_the_lm_head_alone():
    """The per-layer evaluations of the sensitivity pass: one group per layer, in graph order, and
    every other weight (the LM head) a group of its own."""
    from llmx.calibration.search import by_layer

    weights = ["model.layers.0.attn.qkv.weight", "model.layers.0.mlp.down.weight", "model.layers.10.attn.o.weight",
               "layers.2.mlp.up.weight", "model.lm_head.weight"]
    assert by_layer(weights) == [weights[:2], [weights[2]], [weights[3]], [weights[4]]]


def test_weight_only_statistics_watch_prefill_alone():
    """w8/w4 read the statistics merged over graphs; decode's MatMul inputs are prefill's values at
    some of the same positions, so the pass runs prefill only. w8a8 sets each graph's own ranges."""
    from llmx.calibration.activations import statistics_graphs

    paths = {"prefill": Path("p.onnx"), "decode": Path("d.onnx")}
    assert statistics_graphs(paths, "w8") == statistics_graphs(paths, "w4") == {"prefill": Path("p.onnx")}
    assert statistics_graphs(paths, "w8a8") == paths
    assert statistics_graphs({"embed": Path("e.onnx")}, "w8") == {"embed": Path("e.onnx")}


def test_a_search_record_from_before_the_timings_still_prints():
    """quality.json written before candidates were timed (no speed fields, no fp32 entry) prints as it did."""
    from llmx.calibration.search import format_search

    row = {"stage": "recipe", "label": "rtn b128", "perplexity_ratio": 1.001, "top1_agreement": 0.99, "mean_kl": 0.001,
           "graph_bytes": 2**20, "seconds": 1.0, "meets": True}
    text = format_search({"measure": "perplexity ratio <= 1.005", "graph": "decode", "held_out": 2, "candidates": [row],
                          "chosen": 0, "sensitivity": {}, "seconds": {"search": 1.0, "reference": 0.5}})
    assert "rtn b128" in text and "<- chosen" in text and "tok/s" not in text and "fp32:" not in text


def test_reference_arrays_on_disk_read_back_exactly(tmp_path):
    from llmx.calibration.on_disk import ArraysOnDisk

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 5)).astype(np.float16), rng.standard_normal(7).astype(np.float32),
              rng.standard_normal((2, 2, 2)).astype(np.float16)]
    stored = ArraysOnDisk(tmp_path / "a.bin")
    for a in arrays:
        stored.append(a)
    assert len(stored) == 3 and (tmp_path / "a.bin").stat().st_size == sum(a.nbytes for a in arrays)
    for a, b in zip(arrays, stored):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert np.array_equal(stored[1], arrays[1])


def test_a_layer_is_judged_on_the_first_tokens_of_its_windows(store, tmp_path):
    """The per-layer sensitivity pass scores the first LAYER_TOKENS of a few windows: fed alone they
    give the whole window's logits there (causal), so the judge's quality on them equals the
    agreement of the whole windows' first rows (real decode graph; a candidate with position-
    dependent noise on its logits)."""
    import onnxruntime as ort

    from llmx.calibration.judge import DecoderJudge
    from llmx.compare import Agreement
    from llmx.runtime.sampling import log_softmax

    art = store.optimized("llama-tied-llama3rope-bias")
    rng = np.random.default_rng(2)
    windows = [rng.integers(5, 200, 24).tolist() for _ in range(3)]
    judge = DecoderJudge(art / "decode.onnx", load_manifest(art), windows, 1, scratch=tmp_path)
    fp32 = ort.InferenceSession(str(art / "decode.onnx"), providers=["CPUExecutionProvider"])

    class Noisy:
        def run(self, names, feed):
            logits = fp32.run(names, feed)[0]
            positions = feed["position_ids"][0]
            return [logits + 0.3 * np.sin(positions[None, :, None] * np.arange(logits.shape[-1]) + 1.0)]

    cut = judge.score(Noisy(), limit=2, tokens=10)
    want = Agreement()
    for feed, window in zip(judge.feeds[:2], windows):
        full = log_softmax(Noisy().run(["logits"], feed)[0][0, :-1])
        reference = log_softmax(fp32.run(["logits"], feed)[0][0, :-1])
        want.add(reference[:9], full[:9], np.asarray(window[1:10]))
    summary = want.summary()
    assert summary["tokens"] == 18 and cut["mean_kl"] > 1e-3
    for key in ("perplexity_ratio", "top1_agreement", "mean_kl"):
        assert cut[key] == pytest.approx(summary[key], rel=2e-3, abs=1e-5)  # the judge's reference is float16
    assert judge.score(Noisy(), limit=2)["mean_kl"] != pytest.approx(cut["mean_kl"], rel=1e-3)  # whole windows differ
