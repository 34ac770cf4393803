"""The accuracy-aware search behind ``llmx calibrate --scheme``: the fastest recipe that meets a target.

    1. statistics: one fp32 pass over the calibration data (activations.py), one over the
       held-out split for reference outputs (judge.py); nothing later reruns the fp32 model
    2. recipes: range method x SmoothQuant alpha (w8a8; minmax first, whose ranges come free from
       the statistics, then percentile if no minmax recipe meets) or RTN/SmoothQuant (w8), RTN/AWQ
       (w4) x block size (128 first, then smaller blocks only if no block-128 recipe meets),
       scored for quality and timed; a tier stops at its first recipe that meets (its recipes
       build the same kernels, so none after it is faster); a later tier keeps the channel
       scaling the earlier ones found best
    3. if none meets the target: each MatMul's sensitivity in one local pass on the best recipe
       (its own output error on calibration rows, sensitivity.py), scaled by one short
       evaluation per layer, then the fewest most sensitive MatMuls kept in higher precision
       (the count predicted from the sensitivities, then checked by a few full evaluations)
    4. the fastest candidate meeting the target, by its measured cost per generated token;
       candidates within the timing noise of the fastest are told apart by fewest fallbacks,
       the larger block, then the lowest error

Every candidate's quality, speed, size and time goes into the report's ``search`` section, and
a pick slower than the fp32 graph is said loudly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from llmx.calibration.activations import ActivationStats
from llmx.calibration.candidates import Candidate, StaticBuilder, by_sensitivity
from llmx.calibration.judge import DecoderJudge, make_judge, meets, ratio_bound, session
from llmx.calibration.layered import layer_of
from llmx.calibration.progress import Progress, silent
from llmx.calibration.weight_only_builder import WeightOnlyBuilder
from llmx.errors import LlmxError

# Perplexity ratio per scheme (decoders); encoders: mean cosine to fp32.
DEFAULT_TARGETS = {"w8a8": 1.02, "w8": 1.005, "w4": 1.03}
ENCODER_TARGET = 0.99
METHODS = ("minmax", "percentile")  # entropy: slower and never ahead of these two here
ALPHAS = (None, 0.5, 0.8)
# w8/w4 input channels per scale, in the order tried. MatMulNBits is compute-bound on CPUs and
# 128 (the AWQ/GPTQ group size) decodes 7-12 % and prefills ~25 % faster than 32 on the
# SmolLM-135M shape; 32 (onnxruntime-genai's default, and the unsearched one) is the quality
# fallback; 64 is the step between (SmolLM2-135M w8 on an AVX-512 VNNI host, 128-token prompt + 128
# new tokens: b128 174 tok/s, b64 154, b32 149, b16 140; ppl x1.0037 / 1.0012 / 1.0007 / 1.0004).
# 4-bit blocks of 16 are 1.4-3.5x slower than 32, so w4 stops at 32.
BLOCK_SIZES = {"w8": (128, 64, 32, 16), "w4": (128, 64, 32)}
# Timings of one candidate vary by a few percent between back-to-back runs on a quiet box:
# candidates this close to the fastest are told apart by what is certain (fallbacks, block).
SPEED_TOLERANCE = 1.05
# The fallback count is predicted from local errors (Search.fewest_fallbacks): aim a little inside
# the target, and stop after a few full evaluations.
PREDICTION_MARGIN = 0.85
MAX_FALLBACK_EVALUATIONS = 8
LAYER_WINDOWS = 2  # held-out windows (encoders: batches) per layer in the sensitivity pass
# ... and their first tokens (decoders): half a 256-token window halves a pass that is most of a
# search's fp32-speed work (SmolLM2-135M: 31 layers, 0.74 s a whole window)
LAYER_TOKENS = 128


class TargetNotMetError(LlmxError):
    """No configuration the search tried holds the quality target (``--force`` keeps the best)."""


@dataclass
class SearchSpace:
    target: float | None = None  # None: the scheme's default
    methods: tuple[str, ...] = METHODS
    alphas: tuple[float | None, ...] = ALPHAS
    awq: tuple[bool, ...] = (False, True)  # w4 only (w8 searches SmoothQuant alphas instead)
    block_sizes: tuple[int, ...] | None = None  # w8/w4, one tier each in this order; None: BLOCK_SIZES
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
            # w8's error is mostly MatMulNBits' INT8 activations (rounded per block): SmoothQuant
            # flattens their loud channels. w4's is mostly its weights: AWQ, unless --smoothquant asks.
            if scheme == "w8" or self.alphas != ALPHAS:
                grid = [dict(alpha=a) for a in self.alphas]
            else:
                grid = [dict(awq=a) for a in self.awq]
            return [[Candidate(block_size=b, **g) for g in grid] for b in self.block_sizes or BLOCK_SIZES[scheme]]
        tiers = [[m for m in self.methods if m == "minmax"], [m for m in self.methods if m != "minmax"]]
        return [[Candidate(method=m, alpha=a) for a in self.alphas for m in tier] for tier in tiers if tier]


def describe_target(target: float, encoder: bool) -> str:
    return f"cosine mean >= {target:g}, min >= {1 - 2 * (1 - target):g}" if encoder else f"perplexity ratio <= {target:g}"


class Search:
    def __init__(self, judge, builder, target: float, threads: int | None, log: Callable[[str], None],
                 progress: Progress = silent, layered: bool = False):
        self.judge, self.builder, self.target, self.threads, self.log = judge, builder, target, threads, log
        # layered: the fp32 graphs run a layer at a time (layered.py), because memory is short
        self.progress, self.layered = progress, layered
        self.rows: list[dict] = []

    def score(self, candidate: Candidate) -> tuple[dict, dict, int]:
        """(quality, speed, graph bytes) of ``candidate``'s searched graph."""
        graph, size = self.builder.build(candidate)
        scorer = self.session(graph)
        with self.progress(f"scoring {candidate.label()}", len(self.judge.feeds)) as bar:
            quality = self.judge.score(scorer, bar.update, target=self.target)
        return quality, self.judge.speed(scorer), size

    def session(self, graph: Path):
        scorer = session(graph, self.threads)
        self.builder.discard(graph)  # the session holds the weights now; a search writes many graphs
        return scorer

    def attempt(self, candidate: Candidate, stage: str) -> dict:
        start = time.perf_counter()
        quality, speed, size = self.score(candidate)
        row = {"stage": stage, "label": candidate.label(), "method": candidate.method, "smoothquant": candidate.alpha,
               "awq": candidate.awq, "block_size": candidate.block_size, "fallback": list(candidate.fallback),
               **quality, **speed, "graph_bytes": size, "meets": meets(quality, self.target),
               "seconds": round(time.perf_counter() - start, 2)}
        self.rows.append(row)
        self.log(format_row(row))
        return row

    def sensitivity(self, base: Candidate, stats: ActivationStats) -> dict[str, float]:
        """Each MatMul's local error, scaled by what its layer does to the model's output.

        A local error says nothing of where it is: the same relative error costs more in the
        first and last layers and the LM head, whose errors every later layer carries (on a
        135M model, 4-bit LM head alone: KL 0.063; last layer 0.043; a middle layer 0.011). One
        cheap evaluation per layer (its MatMuls alone quantized, the rest fp32, LAYER_WINDOWS
        held-out windows) measures that; each MatMul gets its layer's share by local error.
        ``layered`` (a model whose fp32 graph does not fit: those evaluations are fp32 graphs): the
        local errors rank alone, and the full evaluations that check the predicted count make up
        for the ranking.
        """
        weights = self.builder.weights()
        with self.progress("sensitivity (one pass)", len(weights)) as bar:
            local = self.builder.local_errors(base, stats.rows, self.threads, bar.update)
        if self.layered:
            return local
        found = {}
        layers = by_layer(weights)
        cut = {"tokens": LAYER_TOKENS} if isinstance(self.judge, DecoderJudge) else {}
        with self.progress("sensitivity per layer", len(layers)) as bar:
            for members in layers:
                scorer = self.session(self.builder.only(base, members))
                damage = self.judge.error(self.judge.score(scorer, limit=LAYER_WINDOWS, **cut))
                share = sum(local[w] for w in members)
                for w in members:
                    found[w] = damage * local[w] / share if share > 0 else damage / len(members)
                bar.update(1)
        return found

    def fewest_fallbacks(self, base_row: dict, order: list[str], sensitivity: dict[str, float]) -> None:
        """The fewest of ``order`` (most sensitive first) kept in higher precision that meet the target.

        The count is predicted, then checked: the model's excess error (judge.excess) is taken as
        proportional to the local error still quantized, the factor fitted on the base recipe and
        refitted on every full evaluation; the counts known to miss and to meet bracket the next
        prediction, which once bracketed goes no higher than the midpoint (so the bracket at least
        halves). A few evaluations instead of doubling and bisecting (2 log2 n of them). Layered,
        no guess goes past halfway from the last miss to all of them.
        """
        base = candidate_of(base_row)
        errors = np.asarray([sensitivity[w] for w in order], np.float64)
        left = errors.sum() - np.concatenate([[0.0], np.cumsum(errors)])  # left[n]: local error still quantized
        budget = self.judge.budget(self.target) * PREDICTION_MARGIN
        factor = self.judge.excess(base_row) / max(left[0], 1e-30)
        low, high = 0, len(order) + 1  # low misses (the base recipe); high: none known to meet yet
        for _ in range(MAX_FALLBACK_EVALUATIONS):
            fits = np.nonzero(factor * left <= budget)[0]
            predicted = int(fits[0]) if len(fits) else len(order)
            if high <= len(order):  # bracketed: the prediction, but never above the midpoint
                n = min(max(predicted, low + 1), max((low + high) // 2, low + 1))
            else:
                # until a count meets, grow by half at least: a prediction that keeps falling short
                # (the error not proportional to the local one) still brackets the count in a few steps
                n = min(max(predicted, low + max(1, (low + 1) // 2)), high - 1)
                if self.layered:
                    # memory is short: grow from below, at most halfway to all of them. Each fallback's
                    # 8-bit blocks add to the candidate's session, the run's peak (Llama-3.1-8B shape:
                    # a first guess of 90 of 129 loaded 8.7 GiB of graph where 47 was chosen, 7.3)
                    n = min(n, max((low + len(order)) // 2, low + 1))
            if n <= low:
                return
            row = self.attempt(replace(base, fallback=tuple(order[:n])), "fallback")
            if row["meets"]:
                high = n
            else:
                low = n
            if left[n] > 0:
                factor = self.judge.excess(row) / left[n]
            # within a sixteenth of the fewest: not worth more evaluations (an evaluation is a few
            # seconds; a MatMul left at 8 bits costs its share of every decode step)
            if high - low <= max(1, high // 16):
                return

def run_search(paths: dict[str, Path], manifest, feeds, stats: Callable[[], ActivationStats], held_out: list[list[int]],
               options, space: SearchSpace, work: Path, log: Callable[[str], None] = lambda msg: None,
               progress: Progress = silent, reference: dict[str, Path] | None = None) -> tuple[Candidate, dict, object, object]:
    """(the chosen candidate, the search record, the builder that made its graphs, the judge) for
    ``options.scheme`` on the fp32 ``paths``; ``stats()`` gives the activation statistics,
    collected on first call. ``reference``: the fp32 graphs the judge runs, if not ``paths``
    (pipeline.reference_graphs)."""
    start = time.perf_counter()
    encoder = manifest.kind == "encoder"
    target = space.target_for(options.scheme, encoder)
    judge = make_judge(reference or paths, manifest, held_out, options.threads, bool(options.layered), work)
    reference_seconds = time.perf_counter() - start
    if options.scheme == "w8a8":
        builder = StaticBuilder(paths[judge.graph], judge.graph, stats(), feeds, options.per_channel, work)
    else:
        builder = WeightOnlyBuilder(paths, judge.graph, stats, options.scheme, options.symmetric, progress)
    log(f"search: {describe_target(target, encoder)} on {len(held_out)} held-out "
        f"{'sentences' if encoder else 'windows'} ({judge.graph} graph); fp32 {format_fp32(judge.fp32_speed)}")
    search = Search(judge, builder, target, options.threads, log, progress, layered=bool(options.layered))
    recipes: list[dict] = []
    tiers = space.recipes(options.scheme)
    for i, tier in enumerate(tiers):
        if recipes:
            best = min(recipes, key=judge.error)
            if i < len(tiers) - 1 and out_of_reach(best, tier[0], judge.excess(best), judge.budget(target)):
                log(f"search: skipping block {tier[0].block_size}: {best['label']} is too far from the target "
                    f"for it to meet (the smallest block is still tried)")
                continue
            tier = narrowed(tier, candidate_of(best))
        for candidate in tier:  # a tier's recipes build the same kernels: the first that meets is as fast
            recipes.append(search.attempt(candidate, "recipe"))
            if recipes[-1]["meets"]:
                break
        if recipes[-1]["meets"]:
            break
    sensitivity = {}
    if not any(r["meets"] for r in recipes) and space.fallback:
        best = min(recipes, key=judge.error)
        log(f"search: no recipe meets the target; ranking each MatMul's sensitivity on {best['label']}")
        sensitivity = search.sensitivity(candidate_of(best), stats())
        search.fewest_fallbacks(best, by_sensitivity(builder.weights(), sensitivity), sensitivity)
    chosen = pick(search.rows, judge.error)
    slower = judge.fp32_speed is not None and chosen["cost_ms"] > judge.fp32_speed["cost_ms"]
    if slower:
        log(f"WARNING: the chosen {chosen['label']} runs slower than the fp32 graph it came from "
            f"({format_speed(chosen)} vs fp32 {format_speed(judge.fp32_speed)}): no faster configuration "
            "met the target on this machine")
    record = {"target": target, "measure": describe_target(target, encoder), "graph": judge.graph,
              "held_out": len(held_out), "candidates": search.rows, "chosen": search.rows.index(chosen),
              "met": chosen["meets"], "sensitivity": sensitivity, "fp32": judge.fp32_speed,
              "slower_than_fp32": slower,
              "seconds": {"reference": round(reference_seconds, 2), "search": round(time.perf_counter() - start, 2)}}
    return candidate_of(chosen), record, builder, judge


def narrowed(tier: list[Candidate], best: Candidate) -> list[Candidate]:
    """A later tier's recipes at the channel scaling (SmoothQuant alpha, AWQ or none) the earlier
    tiers found best. A tier changes how values are rounded (range method, block size); which
    channels are loud, what the scaling decides, stays. Measured on SmolLM2-135M w8a8: sq0.8 best
    under both minmax and percentile (x1.052, x1.083), the other alphas 1.6-5x: 3 percentile
    recipes of 23 s each, now one."""
    kept = [c for c in tier if (c.alpha, c.awq) == (best.alpha, best.awq)]
    return kept or tier


# A smaller block cuts a recipe's error by at most this much per halving. The rounding error of a
# block goes with the square of its range, and the two halves' ranges are at most the whole's:
# their mean square is at least half of it. Measured, twice that margin: SmolLM2-135M w4 AWQ,
# KL 0.35 at block 128, 0.26 at 64, 0.15 at 32.
REACH_PER_HALVING = 4.0


def out_of_reach(best: dict, candidate: Candidate, excess: float, budget: float) -> bool:
    """Whether ``candidate``'s smaller block cannot bring ``best`` (its excess over fp32) within the
    target's budget: a tier between the first and the smallest is not worth building then (the
    fallbacks start from the best recipe, the smallest block's when it is closest)."""
    if candidate.block_size is None or best["block_size"] is None or candidate.block_size >= best["block_size"]:
        return False
    if budget <= 0:  # a target nothing meets (tests, --force): every tier is measured
        return False
    halvings = np.log2(best["block_size"] / candidate.block_size)
    return excess > budget * REACH_PER_HALVING ** halvings


def by_layer(weights: list[str]) -> list[list[str]]:
    """Weights grouped by decoder/encoder layer (``...layers.N....``); any other weight (the LM
    head) is a group of its own. Graph order."""
    groups: dict[str, list[str]] = {}
    for w in weights:
        layer = layer_of(w)
        groups.setdefault(f"layer {layer}" if layer >= 0 else w, []).append(w)
    return list(groups.values())


def candidate_of(row: dict) -> Candidate:
    return Candidate(method=row["method"], alpha=row["smoothquant"], awq=row["awq"], fallback=tuple(row["fallback"]),
                     block_size=row["block_size"])


def pick(rows: list[dict], error: Callable[[dict], float]) -> dict:
    """The fastest row meeting the target by measured cost; among rows within SPEED_TOLERANCE of
    it, fewest fallbacks, then the larger block, then the lowest error. If none meets: the lowest error."""
    meeting = [r for r in rows if r["meets"]]
    if not meeting:
        return min(rows, key=error)
    # More fallbacks of one recipe only add cost (fp32 or 8-bit MatMuls in place of quantized
    # ones), whatever a noisy timing says: each recipe keeps its fewest (then its fastest).
    fewest: dict[Candidate, dict] = {}
    for r in sorted(meeting, key=lambda r: (len(r["fallback"]), r["cost_ms"])):
        fewest.setdefault(replace(candidate_of(r), fallback=()), r)
    meeting = list(fewest.values())
    fastest = min(r["cost_ms"] for r in meeting)
    near = [r for r in meeting if r["cost_ms"] <= fastest * SPEED_TOLERANCE]
    return min(near, key=lambda r: (len(r["fallback"]), -(r["block_size"] or 0), error(r)))


def apply(options, candidate: Candidate):
    """The calibration options that build ``candidate`` into both graphs."""
    changes = dict(awq=candidate.awq, fallback=candidate.fallback)
    if options.scheme == "w8a8":
        changes.update(method=candidate.method, smoothquant=candidate.alpha)
    else:
        changes.update(block_size=candidate.block_size, smoothquant=candidate.alpha)
    return replace(options, **changes)


def format_row(row: dict) -> str:
    if "cosine_mean" in row:
        quality = f"cos mean {row['cosine_mean']:.5f} min {row['cosine_min']:.5f}"
    else:
        quality = (f"ppl x{row['perplexity_ratio']:.4f} (<= {ratio_bound(row):.4f}) top1 {row['top1_agreement']:6.2%} "
                   f"KL {row['mean_kl']:.5f}")
    mark = "meets" if row["meets"] else f"- (a certain miss after {row['scored']})" if "scored" in row else "-"
    return (f"  {row['stage']:9}{row['label']:28}{quality:56}{format_speed(row):>28}"
            f"{row['graph_bytes'] / 2**20:8.2f} MiB{row['seconds']:7.1f} s  {mark}")


def format_fp32(speed: dict | None) -> str:
    return "not timed (run a layer at a time: its graph does not fit in memory)" if speed is None else format_speed(speed)


def format_speed(speed: dict) -> str:
    if "decode_tok_s" in speed:
        return f"{speed['decode_tok_s']:7.1f} tok/s, prefill {speed['prefill_ms']:.0f} ms"
    if "embed_ms" in speed:
        return f"{speed['embed_ms']:.2f} ms/embedding"
    return ""  # a record written before the search timed its candidates


def format_search(record: dict) -> str:
    rows = [f"search ({record['measure']}, {record['graph']} graph, {record['held_out']} held-out):"]
    for i, row in enumerate(record["candidates"]):
        rows.append(format_row(row) + ("  <- chosen" if i == record["chosen"] else ""))
    if record["sensitivity"]:
        top = sorted(record["sensitivity"].items(), key=lambda kv: -kv[1])[:5]
        rows.append("  most sensitive MatMuls: " + ", ".join(f"{w} ({e:.3g})" for w, e in top))
    seconds = record["seconds"]
    if "fp32" in record:
        slower = "; the chosen one is SLOWER" if record["slower_than_fp32"] else ""
        rows.append(f"  fp32: {format_fp32(record['fp32'])}{slower}")
    rows.append(f"  search took {seconds['search']:.1f} s (fp32 reference {seconds['reference']:.1f} s)")
    return "\n".join(rows)
