"""Scoring a candidate graph against fp32 outputs computed once: the search's quality measure.

The search scores one graph per candidate: a decoder's ``decode`` graph fed each held-out
window with an empty cache (it returns logits at every position, the way ``llmx eval``'s
first half-window runs), an encoder's ``embed`` graph fed each held-out sentence. The fp32
outputs are computed once, here, so a candidate costs one run of its own graph per window.

    decoder: perplexity ratio (<= target), top-1 agreement, mean KL; error = mean KL
    encoder: cosine to fp32, mean (>= target) and min (>= 1 - 2 (1 - target)); error = 1 - mean
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmx.artifact.manifest import Manifest
from llmx.calibration.encoder import EncoderFeeds
from llmx.calibration.feeds import decode_feed
from llmx.compare import Agreement, cosine
from llmx.runtime.onnx_backend import session_options
from llmx.runtime.sampling import log_softmax


def meets(quality: dict, target: float) -> bool:
    """Whether a measured quality (search row or final report) holds the target."""
    if "cosine_mean" in quality:
        return quality["cosine_mean"] >= target and quality["cosine_min"] >= 1 - 2 * (1 - target)
    return quality["perplexity_ratio"] <= target


def session(model, threads: int | None):
    """An ORT CPU session over a graph path or an in-memory model (weights inline)."""
    import onnxruntime as ort

    source = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    return ort.InferenceSession(source, session_options(threads), providers=["CPUExecutionProvider"])


class DecoderJudge:
    graph = "decode"

    def __init__(self, fp32_graph: Path, manifest: Manifest, windows: list[list[int]], threads: int | None):
        self.threads = threads
        reference = session(fp32_graph, threads)
        self.feeds = [self._feed(reference, manifest, w) for w in windows]
        self.targets = [np.asarray(w[1:]) for w in windows]
        self.reference = [log_softmax(reference.run(["logits"], f)[0][0, :-1]) for f in self.feeds]

    @staticmethod
    def _feed(reference, manifest: Manifest, window: list[int]) -> dict:
        past = [i for i in reference.get_inputs() if i.name.startswith("past_key_values.")]
        empty = [np.zeros((1, p.shape[1], 0, p.shape[3]), np.float32) for p in past]
        return decode_feed(manifest, window, empty, 0, len(window))

    def score(self, candidate) -> dict:
        result = Agreement()
        for feed, ref, targets in zip(self.feeds, self.reference, self.targets):
            result.add(ref, log_softmax(candidate.run(["logits"], feed)[0][0, :-1]), targets)
        summary = result.summary()
        return {k: summary[k] for k in ("perplexity_ratio", "top1_agreement", "mean_kl")}

    @staticmethod
    def error(quality: dict) -> float:
        return quality["mean_kl"]


class EncoderJudge:
    graph = "embed"

    def __init__(self, fp32_graph: Path, manifest: Manifest, inputs: list[list[int]], threads: int | None):
        self.feeds = list(EncoderFeeds(inputs)(self.graph))
        self.reference = self._vectors(session(fp32_graph, threads))

    def _vectors(self, candidate) -> np.ndarray:
        return np.concatenate([candidate.run(None, feed)[0] for feed in self.feeds])

    def score(self, candidate) -> dict:
        cos = cosine(self.reference, self._vectors(candidate))
        return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}

    @staticmethod
    def error(quality: dict) -> float:
        return 1.0 - quality["cosine_mean"]


def make_judge(fp32_graphs: dict[str, Path], manifest: Manifest, held_out: list[list[int]], threads: int | None):
    kind = EncoderJudge if manifest.kind == "encoder" else DecoderJudge
    return kind(fp32_graphs[kind.graph], manifest, held_out, threads)
