"""Scoring a candidate graph against fp32 outputs computed once: the search's quality measure.

The search scores one graph per candidate: a decoder's ``decode`` graph fed each held-out
window with an empty cache (it returns logits at every position, the way ``llmx eval``'s
first half-window runs), an encoder's ``embed`` graph fed each held-out sentence. The fp32
outputs are computed once, here, so a candidate costs one run of its own graph per window.

    decoder: perplexity ratio, its upper bound over windows (<= target; llmx.compare) and
             exp(mean KL) (<= target: the ratio on the fp32 model's own text), top-1 agreement;
             error = mean KL
    encoder: cosine to fp32, mean (>= target) and min (>= 1 - 2 (1 - target)); error = 1 - mean

Speed is measured on the same session, right after: a decoder's single-token step after a
128-token past and a 128-token prefill (both on the decode graph, as the runtime uses it), an
encoder's embedding of one sentence; medians of repeated runs. ``cost`` is what the search
minimizes: a decoder's milliseconds per generated token when a 128-token prompt gets 128 new
tokens (the step, plus the prefill spread over the tokens), an encoder's milliseconds per call.
"""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from llmx.artifact.manifest import Manifest
from llmx.calibration.encoder import EncoderFeeds
from llmx.calibration.feeds import decode_feed
from llmx.calibration.layered import LayeredGraph
from llmx.calibration.on_disk import ArraysOnDisk
from llmx.compare import Agreement, cosine
from llmx.logits_to_keep import NAME as LOGITS_TO_KEEP
from llmx.runtime.onnx_backend import session_options
from llmx.runtime.sampling import log_softmax


def meets(quality: dict, target: float) -> bool:
    """Whether a measured quality (search row or final report) holds the target."""
    if "cosine_mean" in quality:
        return quality["cosine_mean"] >= target and quality["cosine_min"] >= 1 - 2 * (1 - target)
    return ratio_bound(quality) <= target and kl_ratio(quality) <= target


def kl_ratio(quality: dict) -> float:
    """exp(mean KL(fp32 || candidate)): the perplexity ratio expected on text the fp32 model itself
    would write, where a quantization error cannot cancel against the text's tokens.

    The held-out split is one text; a ratio measured on it can be lucky. On SmolLM2-135M, w8a8's
    pick measured x1.0052 on the calibration file's tail (code) with KL 0.029 (exp: x1.030), and
    x1.0238 on 24 windows of other prose: the text's ratio followed KL, not the split's ratio.
    Holding both keeps the target on text the split does not resemble. Records written before the
    judge measured KL hold the ratio alone."""
    return float(np.exp(quality.get("mean_kl", 0.0)))


def ratio_bound(quality: dict) -> float:
    """A decoder's perplexity ratio as the target judges it: the upper bound over windows where
    measured (llmx.compare.ratio_upper_bound)."""
    return quality.get("perplexity_ratio_upper", quality["perplexity_ratio"])


def session(model, threads: int | None):
    """An ORT CPU session over a graph path or an in-memory model (weights inline)."""
    import onnxruntime as ort

    source = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    return ort.InferenceSession(source, session_options(threads), providers=["CPUExecutionProvider"])


def opens(path: Path, threads: int | None, layered: bool):
    """A session over an fp32 graph: whole, or a LayeredGraph."""
    return LayeredGraph(path, threads) if layered else session(path, threads)


def logprobs_each(runner, feeds: list[dict]) -> Iterator[np.ndarray]:
    """Next-token log-probabilities [S-1, V] of each decode feed, in order, from a session or a
    LayeredGraph (all feeds in one pass)."""
    if isinstance(runner, LayeredGraph):
        logits = (values["logits"] for _, values in runner.run_each(["logits"], feeds))
    else:
        logits = (runner.run(["logits"], feed)[0] for feed in feeds)
    for value in logits:
        yield log_softmax(value[0, :-1])


SPEED_CONTEXT = 128  # prompt tokens before the timed step, and tokens of the timed prefill
STEP_RUNS, PREFILL_RUNS = 24, 3


def median_ms(run: Callable[[], object], runs: int) -> float:
    run()  # the first call allocates and plans: not what serving sees
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(float(np.median(times)) * 1e3, 3)


class DecoderJudge:
    graph = "decode"

    def __init__(self, fp32_graph: Path, manifest: Manifest, windows: list[list[int]], threads: int | None,
                 layered: bool = False, scratch: Path | None = None):
        """``layered``: the fp32 graph runs a layer at a time (layered.py), and is not timed.
        ``scratch``: where the reference goes on disk (default: beside the graph)."""
        self.threads, self.manifest = threads, manifest
        reference = opens(fp32_graph, threads, layered)
        self.feeds = [self._feed(reference, manifest, w) for w in windows]
        self.targets = [np.asarray(w[1:]) for w in windows]
        # The full-vocabulary log-probabilities of every held-out position would be most of the
        # search's memory (SmolLM2, 16 windows: 0.8 GB in float32): float16 on disk, one window
        # read back at a time. Rounding moves a perplexity ratio by about 1e-5 and KL by less
        # than its run-to-run noise.
        self.reference = ArraysOnDisk(Path(scratch or Path(fp32_graph).parent) / "reference-logprobs.f16")
        for logprobs in logprobs_each(reference, self.feeds):
            self.reference.append(logprobs.astype(np.float16))
        self._speed_feeds(reference, manifest, windows[0])
        self.fp32_speed = None if layered else self.speed(reference)

    @staticmethod
    def _feed(reference, manifest: Manifest, window: list[int], past_len: int = 0) -> dict:
        past = [i for i in reference.get_inputs() if i.name.startswith("past_key_values.")]
        presents = [np.zeros((1, p.shape[1], past_len, p.shape[3]), np.float32) for p in past]
        return decode_feed(manifest, window, presents, past_len, len(window) - past_len)

    def _speed_feeds(self, reference, manifest: Manifest, window: list[int]) -> None:
        self.context = min(SPEED_CONTEXT, manifest.max_seq_len - 1)
        tokens = (window * (1 + self.context // max(1, len(window))))[:self.context + 1]
        self.prefill = self._feed(reference, manifest, tokens[:self.context])
        self.step = self._feed(reference, manifest, tokens, past_len=self.context)  # a zero past: timing only
        if any(i.name == LOGITS_TO_KEEP for i in reference.get_inputs()):  # the runtime's prefill keeps one
            self.prefill[LOGITS_TO_KEEP] = np.asarray(1, np.int64)

    def speed(self, candidate) -> dict:
        step = median_ms(lambda: candidate.run(["logits"], self.step), STEP_RUNS)
        prefill = median_ms(lambda: candidate.run(["logits"], self.prefill), PREFILL_RUNS)
        return {"step_ms": step, "prefill_ms": prefill, "decode_tok_s": round(1e3 / step, 1),
                "cost_ms": round(step + prefill / self.context, 3)}

    def score(self, candidate, progress: Callable[[int], None] = lambda n: None, limit: int | None = None,
              target: float | None = None, tokens: int | None = None) -> dict:
        """Quality on the held-out windows (the first ``limit`` of them; their first ``tokens``: a
        causal model's logits there are the whole window's). ``target``: stop at the window after
        which the candidate cannot meet it (``scored`` then says how many were).

        KL is never negative, so once the KL summed so far exceeds log(target) times every
        prediction of the windows, exp(mean KL) over all of them is past the target whatever the
        rest hold: the remaining windows would only say by how much. A recipe far off (SmolLM2
        w4's round-to-nearest: KL 0.66 against a budget of 0.03) is known after one window of 16.
        A target nothing can meet (<= 1) asks for every candidate measured: no stop.
        """
        windows = list(islice(zip(self.feeds, self.reference, self.targets), limit))
        if tokens is not None:
            windows = [(self._first(feed, tokens), ref[:tokens - 1], targets[:tokens - 1]) for feed, ref, targets in windows]
        budget = np.inf if target is None or target <= 1 else float(np.log(target)) * sum(len(t) for _, _, t in windows)
        result = Agreement()
        for feed, ref, targets in windows:
            result.add(ref.astype(np.float32), log_softmax(candidate.run(["logits"], feed)[0][0, :-1]), targets)
            progress(1)
            if result.kl_sum > budget:
                break
        summary = result.summary()
        quality = {k: summary[k] for k in ("perplexity_ratio", "perplexity_ratio_upper", "top1_agreement", "mean_kl")}
        return {**quality, **scored(summary["windows"], len(windows))}

    def _first(self, feed: dict, tokens: int) -> dict:
        """``feed`` (a window on an empty cache) cut to its first ``tokens``."""
        window = feed["input_ids"][0, :tokens].tolist()
        empty = [np.zeros((1, p.shape[1], 0, p.shape[3]), p.dtype) for p in map(feed.get, self.manifest.kv.past_names())]
        return decode_feed(self.manifest, window, empty, 0, len(window))

    @staticmethod
    def error(quality: dict) -> float:
        return quality["mean_kl"]

    # The search's fallback count is predicted on this scale: how far past fp32 a candidate is,
    # and how far the target allows.
    @staticmethod
    def excess(quality: dict) -> float:
        return max(float(np.log(ratio_bound(quality))), float(np.log(kl_ratio(quality))), 0.0)

    @staticmethod
    def budget(target: float) -> float:
        return float(np.log(target))


class EncoderJudge:
    graph = "embed"

    def __init__(self, fp32_graph: Path, manifest: Manifest, inputs: list[list[int]], threads: int | None):
        self.feeds = list(EncoderFeeds(inputs)(self.graph))
        reference = session(fp32_graph, threads)
        self.reference = self._vectors(reference)
        self.fp32_speed = self.speed(reference)

    def _vectors(self, candidate, progress: Callable[[int], None] = lambda n: None,
                 limit: int | None = None, budget: float = np.inf) -> np.ndarray:
        """Embeddings of the held-out batches (the first ``limit``), until the cosine distance summed
        so far passes ``budget``."""
        vectors, done, lost = [], 0, 0.0
        for feed in self.feeds[:limit]:
            vectors.append(candidate.run(None, feed)[0])
            progress(1)
            if budget < np.inf:
                lost += float((1.0 - cosine(self.reference[done:done + len(vectors[-1])], vectors[-1])).sum())
                if lost > budget:
                    break
            done += len(vectors[-1])
        return np.concatenate(vectors)

    def speed(self, candidate) -> dict:
        embed = median_ms(lambda: candidate.run(None, self.feeds[0]), STEP_RUNS)
        return {"embed_ms": embed, "cost_ms": embed}

    def score(self, candidate, progress: Callable[[int], None] = lambda n: None, limit: int | None = None,
              target: float | None = None) -> dict:
        """Cosine to fp32 on the held-out inputs (the first ``limit`` batches of them). ``target``:
        stop once the mean cannot reach it (1 - cosine is never negative: DecoderJudge.score)."""
        feeds = self.feeds[:limit]
        sentences = sum(len(next(iter(feed.values()))) for feed in feeds)
        budget = np.inf if target is None or target >= 1 else (1.0 - target) * sentences
        vectors = self._vectors(candidate, progress, limit, budget)
        cos = cosine(self.reference[:len(vectors)], vectors)
        return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
                **scored(len(vectors), sentences)}

    @staticmethod
    def error(quality: dict) -> float:
        return 1.0 - quality["cosine_mean"]

    @staticmethod
    def excess(quality: dict) -> float:
        # both of meets()'s bounds on one scale: mean >= target, min >= 1 - 2 (1 - target)
        return max(1.0 - quality["cosine_mean"], (1.0 - quality["cosine_min"]) / 2)

    @staticmethod
    def budget(target: float) -> float:
        return 1.0 - target


def scored(done: int, of: int) -> dict:
    """What a score that stopped early records (a certain miss: DecoderJudge.score); nothing if complete."""
    return {} if done == of else {"scored": f"{done}/{of}"}


def make_judge(fp32_graphs: dict[str, Path], manifest: Manifest, held_out: list[list[int]], threads: int | None,
               layered: bool = False, scratch: Path | None = None):
    if manifest.kind == "encoder":
        return EncoderJudge(fp32_graphs[EncoderJudge.graph], manifest, held_out, threads)
    return DecoderJudge(fp32_graphs[DecoderJudge.graph], manifest, held_out, threads, layered, scratch)


def reference_logprobs(fp32_graph: Path, manifest: Manifest, windows: list[list[int]], threads: int | None,
                       layered: bool) -> Iterator[np.ndarray]:
    """Next-token log-probabilities [S-1, V] of each window from the fp32 ``decode`` graph fed the
    whole window on an empty cache (what the judge's reference is, in float32)."""
    reference = opens(fp32_graph, threads, layered)
    yield from logprobs_each(reference, [DecoderJudge._feed(reference, manifest, w) for w in windows])
