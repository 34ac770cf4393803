"""How far one model's outputs are from another's: the arithmetic every comparer shares.

``llmx export --verify`` (ONNX Runtime against PyTorch), ``llmx calibrate``'s search and report
(quantized against fp32) and ``llmx eval --reference`` all measure with these:

    max |got - want|                        exactness of logits or embeddings (verify)
    perplexity = exp(mean -log p(next token))
    its ratio's upper bound = ratio x exp(one standard error of the per-window log-ratios)
    top-1 agreement = share of positions where both models pick the same argmax
    mean KL = mean over positions of KL(p_reference || p_candidate)
    cosine of embeddings, row by row

Numpy only: the runtime imports this, and it must run without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def max_abs_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Largest elementwise |got - want| (0 for empty arrays; NaN or inf when either has them)."""
    return float(np.abs(got - want).max()) if got.size else 0.0


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of ``a`` [n, d] with the same row of ``b``: [n]."""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@dataclass
class Score:
    """Running negative log-likelihood of one model over the windows seen so far."""

    nll: float = 0.0
    tokens: int = 0
    windows: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def add(self, logprobs: np.ndarray, targets: np.ndarray) -> None:
        # logprobs: [T-1, V] for positions 0..T-2; targets: [T-1] the tokens that followed
        self.nll -= float(logprobs[np.arange(len(targets)), targets].sum(dtype=np.float64))
        self.tokens += len(targets)
        self.windows += 1


# A perplexity ratio measured on a few windows is a sample of the text's: windows differ (on
# SmolLM2-135M w8, per-window log-ratios spread 0.007 around a mean of 0.0037), and a recipe
# just inside a target on 16 windows missed it on the next 24 of other text (1.0057 against
# 1.005). The upper bound adds one standard error of the mean per-window log-ratio: what
# calibrate's search holds to its target.
RATIO_BOUND_SE = 1.0


def ratio_upper_bound(log_ratio: float, window_log_ratios: list[float]) -> float:
    """exp(log_ratio + RATIO_BOUND_SE standard errors of the windows' mean); the ratio itself
    for a single window (no spread to measure)."""
    n = len(window_log_ratios)
    se = float(np.std(window_log_ratios, ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    return math.exp(log_ratio + RATIO_BOUND_SE * se)


@dataclass
class Agreement:
    """How close a candidate's next-token distributions stay to a reference's."""

    reference: Score = field(default_factory=Score)
    candidate: Score = field(default_factory=Score)
    same_top1: int = 0
    kl_sum: float = 0.0
    window_log_ratios: list[float] = field(default_factory=list)  # per window: mean NLL candidate - reference

    def add(self, ref: np.ndarray, cand: np.ndarray, targets: np.ndarray) -> None:
        """One window's log-probabilities [T-1, V] of both models, and the tokens that followed."""
        ref_nll, cand_nll = self.reference.nll, self.candidate.nll
        self.reference.add(ref, targets)
        self.candidate.add(cand, targets)
        if len(targets):
            gained = (self.candidate.nll - cand_nll) - (self.reference.nll - ref_nll)
            self.window_log_ratios.append(gained / len(targets))
        self.same_top1 += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        self.kl_sum += float((np.exp(ref) * (ref - cand)).sum(dtype=np.float64))

    def summary(self) -> dict:
        n = self.reference.tokens
        return {
            "reference_perplexity": self.reference.perplexity,
            "perplexity": self.candidate.perplexity,
            "perplexity_ratio": self.candidate.perplexity / self.reference.perplexity,
            "perplexity_ratio_upper": ratio_upper_bound((self.candidate.nll - self.reference.nll) / n,
                                                        self.window_log_ratios) if n else float("nan"),
            "top1_agreement": self.same_top1 / n if n else float("nan"),
            "mean_kl": self.kl_sum / n if n else float("nan"),
            "tokens": n,
            "windows": self.reference.windows,
        }
