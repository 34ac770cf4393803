"""Rotary position embedding frequencies (numpy, torch-free).

Follows the formulas of transformers' ``modeling_rope_utils`` for the supported rope types,
computed in float32 like the reference so exported graphs match it bit for bit where possible.
Both the torch modules (export) and the ONNX Runtime graph builder (optimize) call this.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmx.spec import ModelSpec


def inv_freq_and_scale(rope: dict, head_dim: int, max_positions: int, long: bool = False) -> tuple[np.ndarray, float]:
    """Inverse frequencies, shape [head_dim // 2], and the factor that multiplies cos/sin.

    ``long``: LongRoPE's set for sequences past ``long_context_threshold`` (other types have one set).
    """
    base = float(rope.get("rope_theta", 10000.0))
    dim = head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(base) ** exponents)).astype(np.float32)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return (inv_freq / np.float32(rope["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(rope, base, dim, max_positions)
    if kind == "longrope":
        return _longrope(rope, base, dim, max_positions, long)
    raise ValueError(f"rope type {kind!r} is not supported")


def _llama3(inv_freq: np.ndarray, rope: dict) -> np.ndarray:
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(rope: dict, base: float, dim: int, max_positions: int) -> tuple[np.ndarray, float]:
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_table(spec: "ModelSpec", layer: int) -> str | None:
    """Which rotary table layer ``layer`` uses: "main", "local" (sliding layers with their own RoPE) or none."""
    if spec.position != "rope" or (spec.rope_layers and not spec.rope_layers[layer]):
        return None
    sliding = bool(spec.sliding_layers and spec.sliding_layers[layer])
    return "local" if spec.rope_local and sliding else "main"


def long_context_threshold(rope: dict) -> int | None:
    """LongRoPE: a call whose largest position + 1 exceeds this uses the long factors, as transformers does."""
    return int(rope["original_max_position_embeddings"]) if rope.get("rope_type") == "longrope" else None


def _longrope(rope: dict, base: float, dim: int, max_positions: int, long: bool) -> tuple[np.ndarray, float]:
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(rope["long_factor" if long else "short_factor"], dtype=np.float32)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = np.float32(1.0) / (ext * (np.float32(base) ** exponents))
    return inv_freq.astype(np.float32), float(attention_factor)


def cos_sin_tables(inv_freq: np.ndarray, scale: float, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of shape [positions, head_dim // 2], as ORT's fused rotary kernels want them."""
    freqs = np.outer(np.arange(positions, dtype=np.float32), inv_freq).astype(np.float32)
    return (np.cos(freqs) * scale).astype(np.float32), (np.sin(freqs) * scale).astype(np.float32)
