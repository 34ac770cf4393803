"""AWQ-style int4 recovery (Lin et al., 2024): scale salient input channels up before rounding.

For Y = X W quantized to 4 bits in blocks along the input axis, channels where |X| is large
matter most. With s_j = mean|X_j|^a (normalized), Y = (X / s)(diag(s) W): rounding diag(s) W
gives those rows finer steps. a is searched per MatMul group on a sample of calibration rows,
minimizing ||X W - (X / s) Q(diag(s) W)||; a = 0 (s = 1, plain rounding) is in the grid, so a
group never gets worse on the sample. 1/s folds into the norm before the group, or becomes a
Mul, exactly as SmoothQuant's scales do (``smoothquant.apply_smoothing``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from llmx.calibration.activations import ActivationStats
from llmx.calibration.matmuls import initializers, read_array
from llmx.calibration.smoothquant import groups

GRID = np.linspace(0.0, 1.0, 11)
# Output columns a group's exponent is fitted on. s is per input channel and every column's
# error sums into the objective, so evenly spaced columns estimate it: a 49k-column LM head
# costs what a 4k one does (on SmolLM2-135M it was half of AWQ's fitting time). The weights a
# fit reads (input rows x columns) are capped too: an 8B model's 14336-row down projection gets
# 1170 columns and costs what its 4096-row projections do (its fit was half of a layer's).
FIT_COLUMNS = 4096
FIT_WEIGHTS = 4096 * 4096


def fake_quantize(w: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """Symmetric round-to-nearest in blocks of ``block_size`` input rows of w [in, out], dequantized."""
    rows, cols = w.shape
    pad = -rows % block_size
    blocks = np.pad(w, ((0, pad), (0, 0))).reshape(-1, block_size, cols)
    top = 2 ** (bits - 1) - 1
    # in place after the padded copy: the fit calls this 11 times per group (an 8B down projection:
    # 59M weights each time), and every temporary of that size is a pass through memory
    scale = np.maximum(blocks.max(1, keepdims=True), -blocks.min(1, keepdims=True))
    scale /= top
    scale[scale == 0] = 1.0
    blocks /= scale
    np.round(blocks, out=blocks)
    np.clip(blocks, -top - 1, top, out=blocks)
    blocks *= scale
    return blocks.reshape(-1, cols)[:rows]


def awq_scales(model, base_dir: Path, stats: ActivationStats, block_size: int, bits: int = 4,
               progress: Callable[[int], None] = lambda n: None) -> dict[str, np.ndarray]:
    """s per MatMul group (keyed like SmoothQuant's), the best of GRID on each group's sample rows;
    ``progress(1)`` after each group."""
    inits = initializers(model)
    scales = {}
    for group in groups(model):
        progress(1)
        if group.key not in stats.rows:
            continue
        x = stats.rows[group.key].astype(np.float32)
        s = best_scale(x, fit_columns([inits[name] for name in group.weights], base_dir),
                       stats.mean_abs(group.key), block_size, bits)
        if s is not None:
            scales[group.key] = s
    return scales


def fit_columns(weights: list, base_dir: Path) -> np.ndarray:
    """The group's weights side by side [in, out], evenly spaced columns of them when there are
    more than the fit reads; taken from each weight as it is read, so no copy of the whole group
    (an 8B model's LM head: 2.1 GB) is made beside it."""
    widths = [int(init.dims[1]) for init in weights]
    columns = min(FIT_COLUMNS, max(1, FIT_WEIGHTS // int(weights[0].dims[0])))
    total = sum(widths)
    picked = np.linspace(0, total - 1, columns).astype(np.int64) if total > columns else np.arange(total)
    parts, start = [], 0
    for init, width in zip(weights, widths):
        mine = picked[(picked >= start) & (picked < start + width)] - start
        if len(mine):
            values = read_array(init, base_dir)
            parts.append(np.asarray(values if len(mine) == width else values[:, mine], np.float32))
        start += width
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def best_scale(x: np.ndarray, w: np.ndarray, mean_abs: np.ndarray, block_size: int, bits: int) -> np.ndarray | None:
    reference = x @ w
    best, best_error = None, float(((x @ fake_quantize(w, bits, block_size) - reference) ** 2).mean())
    salience = np.maximum(mean_abs, 1e-8)
    for alpha in GRID[1:]:
        s = salience ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        error = float((((x / s) @ fake_quantize(w * s[:, None], bits, block_size) - reference) ** 2).mean())
        if error < best_error:
            best, best_error = np.clip(s, 1e-4, 1e4).astype(np.float32), error
    return best
