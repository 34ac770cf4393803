"""The accuracy-aware search behind ``llmx calibrate --scheme``: the fastest recipe that meets a target.

    1. statistics: one fp32 pass over the calibration data (activations.py), one over the
       held-out split for reference outputs (judge.py); nothing later reruns the fp32 model
    2. recipes: range method x SmoothQuant alpha (w8a8; minmax first, whose ranges come free from
       the statistics, then percentile if no minmax recipe meets) or RTN/AWQ (w4) x block size
       (w8/w4; 128 first, the faster kernel, then 32 if no block-128 recipe meets), scored
    3. if none meets the target: each MatMul's sensitivity, measured once on the best recipe
       (the error it alone causes when it is the only quantized MatMul), then the fewest most
       sensitive MatMuls kept in higher precision (doubling, then bisecting the count)
    4. the fastest candidate meeting the target (fewest fallbacks, then the larger block; then
       the lowest error)

Every candidate's quality, size and time goes into the report's ``search`` section.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from llmx.calibration.candidates import Candidate, StaticBuilder, WeightOnlyBuilder, by_sensitivity
from llmx.calibration.judge import make_judge, meets, session
from llmx.errors import LlmxError

# Perplexity ratio per scheme (decoders); encoders: mean cosine to fp32.
DEFAULT_TARGETS = {"w8a8": 1.02, "w8": 1.005, "w4": 1.03}
ENCODER_TARGET = 0.99
METHODS = ("minmax", "percentile")  # entropy: slower and never ahead of these two here
ALPHAS = (None, 0.5, 0.8)
# w8/w4 input channels per scale, fastest first. MatMulNBits is compute-bound on CPUs and 128
# (the AWQ/GPTQ group size) decodes 7-12 % and prefills ~25 % faster than 32 on the SmolLM-135M
# shape; 32 (onnxruntime-genai's default, and the unsearched one) is the quality fallback.
BLOCK_SIZES = (128, 32)


class TargetNotMetError(LlmxError):
    """No configuration the search tried holds the quality target (``--force`` keeps the best)."""


@dataclass
class SearchSpace:
    target: float | None = None  # None: the scheme's default
    methods: tuple[str, ...] = METHODS
    alphas: tuple[float | None, ...] = ALPHAS
    awq: tuple[bool, ...] = (False, True)  # w4 only; w8 keeps round-to-nearest
    block_sizes: tuple[int, ...] = BLOCK_SIZES  # w8/w4, one tier each in this order
    fallback: bool = True

    def target_for(self, scheme: str, encoder: bool) -> float:
        if self.target is not None:
            return self.target
        return ENCODER_TARGET if encoder else DEFAULT_TARGETS[scheme]

    def recipes(self, scheme: str) -> list[list[Candidate]]:
        """Recipes in tiers, each tried only when no earlier tier meets the target. w8a8, cheapest
        first: minmax ranges follow from the statistics, the other methods rerun a calibrator.
        w8/w4, fastest first: one tier per block size."""
        if scheme != "w8a8":
            awq = self.awq if scheme == "w4" else (False,)
            return [[Candidate(awq=a, block_size=b) for a in awq] for b in self.block_sizes]
        tiers = [[m for m in self.methods if m == "minmax"], [m for m in self.methods if m != "minmax"]]
        return [[Candidate(method=m, alpha=a) for a in self.alphas for m in tier] for tier in tiers if tier]


def describe_target(target: float, encoder: bool) -> str:
    return f"cosine mean >= {target:g}, min >= {1 - 2 * (1 - target):g}" if encoder else f"perplexity ratio <= {target:g}"


class Search:
    def __init__(self, judge, builder, target: float, threads: int | None, log: Callable[[str], None]):
        self.judge, self.builder, self.target, self.threads, self.log = judge, builder, target, threads, log
        self.rows: list[dict] = []

    def score(self, candidate: Candidate, only: str | None = None) -> tuple[dict, int]:
        graph, size = self.builder.build(candidate) if only is None else self.builder.only(candidate, only)
        scorer = session(graph, self.threads)
        if isinstance(graph, Path):  # the session holds the weights now; a search writes many graphs
            shutil.rmtree(graph.parent)
        return self.judge.score(scorer), size

    def attempt(self, candidate: Candidate, stage: str) -> dict:
        start = time.perf_counter()
        quality, size = self.score(candidate)
        row = {"stage": stage, "label": candidate.label(), "method": candidate.method, "smoothquant": candidate.alpha,
               "awq": candidate.awq, "block_size": candidate.block_size, "fallback": list(candidate.fallback),
               **quality, "graph_bytes": size, "meets": meets(quality, self.target),
               "seconds": round(time.perf_counter() - start, 2)}
        self.rows.append(row)
        self.log(format_row(row))
        return row

    def sensitivity(self, base: Candidate) -> dict[str, float]:
        found = {}
        for weight in self.builder.weights():
            quality, _ = self.score(base, only=weight)
            found[weight] = self.judge.error(quality)
        return found

    def fewest_fallbacks(self, base: Candidate, order: list[str]) -> None:
        """Try 1, 2, 4, ... fallbacks until the target holds, then bisect down to the fewest."""
        def holds(n: int) -> bool:
            return self.attempt(replace(base, fallback=tuple(order[:n])), "fallback")["meets"]

        low, n = 0, 1
        while n < len(order) and not holds(n):
            low, n = n, n * 2
        if n >= len(order):
            n = len(order)
            if not holds(n):
                return
        while n - low > 1:  # holds(n) and not holds(low)
            middle = (low + n) // 2
            low, n = (low, middle) if holds(middle) else (middle, n)


def run_search(paths: dict[str, Path], manifest, feeds, stats, held_out: list[list[int]], options, space: SearchSpace,
               work: Path, log: Callable[[str], None] = lambda msg: None) -> tuple[Candidate, dict]:
    """(the chosen candidate, the search record) for ``options.scheme`` on the fp32 ``paths``."""
    start = time.perf_counter()
    encoder = manifest.kind == "encoder"
    target = space.target_for(options.scheme, encoder)
    judge = make_judge(paths, manifest, held_out, options.threads)
    reference_seconds = time.perf_counter() - start
    if options.scheme == "w8a8":
        builder = StaticBuilder(paths[judge.graph], judge.graph, stats, feeds, options.per_channel, work)
    else:
        builder = WeightOnlyBuilder(paths[judge.graph], judge.graph, stats, options.scheme, options.symmetric)
    log(f"search: {describe_target(target, encoder)} on {len(held_out)} held-out "
        f"{'sentences' if encoder else 'windows'} ({judge.graph} graph)")
    search = Search(judge, builder, target, options.threads, log)
    recipes: list[dict] = []
    for tier in space.recipes(options.scheme):
        if any(r["meets"] for r in recipes):
            break
        recipes += [search.attempt(c, "recipe") for c in tier]
    sensitivity = {}
    if not any(r["meets"] for r in recipes) and space.fallback:
        base = candidate_of(min(recipes, key=judge.error))
        log(f"search: no recipe meets the target; measuring each MatMul's sensitivity on {base.label()}")
        sensitivity = search.sensitivity(base)
        search.fewest_fallbacks(base, by_sensitivity(builder.weights(), sensitivity))
    chosen = pick(search.rows, judge.error)
    record = {"target": target, "measure": describe_target(target, encoder), "graph": judge.graph,
              "held_out": len(held_out), "candidates": search.rows, "chosen": search.rows.index(chosen),
              "met": chosen["meets"], "sensitivity": sensitivity,
              "seconds": {"reference": round(reference_seconds, 2), "search": round(time.perf_counter() - start, 2)}}
    return candidate_of(chosen), record


def candidate_of(row: dict) -> Candidate:
    return Candidate(method=row["method"], alpha=row["smoothquant"], awq=row["awq"], fallback=tuple(row["fallback"]),
                     block_size=row["block_size"])


def pick(rows: list[dict], error: Callable[[dict], float]) -> dict:
    """The fastest row meeting the target (fewest fallbacks, then the larger block, then lowest error);
    else the lowest error."""
    meeting = [r for r in rows if r["meets"]]
    if meeting:
        return min(meeting, key=lambda r: (len(r["fallback"]), -(r["block_size"] or 0), error(r)))
    return min(rows, key=error)


def apply(options, candidate: Candidate):
    """The calibration options that build ``candidate`` into both graphs."""
    changes = dict(awq=candidate.awq, fallback=candidate.fallback)
    if options.scheme == "w8a8":
        changes.update(method=candidate.method, smoothquant=candidate.alpha)
    else:
        changes.update(block_size=candidate.block_size)
    return replace(options, **changes)


def format_row(row: dict) -> str:
    if "cosine_mean" in row:
        quality = f"cos mean {row['cosine_mean']:.5f} min {row['cosine_min']:.5f}"
    else:
        quality = f"ppl x{row['perplexity_ratio']:.4f} top1 {row['top1_agreement']:6.2%} KL {row['mean_kl']:.5f}"
    mark = "meets" if row["meets"] else "-"
    return (f"  {row['stage']:9}{row['label']:28}{quality:44}{row['graph_bytes'] / 2**20:8.2f} MiB"
            f"{row['seconds']:7.1f} s  {mark}")


def format_search(record: dict) -> str:
    rows = [f"search ({record['measure']}, {record['graph']} graph, {record['held_out']} held-out):"]
    for i, row in enumerate(record["candidates"]):
        rows.append(format_row(row) + ("  <- chosen" if i == record["chosen"] else ""))
    if record["sensitivity"]:
        top = sorted(record["sensitivity"].items(), key=lambda kv: -kv[1])[:5]
        rows.append("  most sensitive MatMuls: " + ", ".join(f"{w} ({e:.3g})" for w, e in top))
    seconds = record["seconds"]
    rows.append(f"  search took {seconds['search']:.1f} s (fp32 reference {seconds['reference']:.1f} s)")
    return "\n".join(rows)
