"""The small integer inputs of a prefill or decode call, shared by every backend.

Positions come from the mask (``cumsum - 1``), so left- and right-padded batches give each
row the same positions it would have alone; a token at position p is stored in KV slot p.
"""

from __future__ import annotations

import numpy as np

from llmx.errors import InputError


def prompt_inputs(prompts: list[list[int]], padding: str = "right") -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """input_ids, attention_mask, position_ids [n, width] and the prompt lengths."""
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise InputError("a prompt must have at least one token")
    width = max(lengths)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        span = slice(width - len(p), width) if padding == "left" else slice(0, len(p))
        ids[i, span], mask[i, span] = p, 1
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, positions, lengths


def decode_inputs(lengths: np.ndarray, t: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """position_ids [n, t] continuing each row, attention_mask [n, width] over filled slots."""
    positions = lengths[:, None] + np.arange(t, dtype=np.int64)[None]
    mask = (np.arange(width)[None] < (lengths + t)[:, None]).astype(np.int64)
    return positions, mask


def bind_decode_inputs(binding, cache, input_ids: np.ndarray, first_row: int = 0) -> None:
    """An ONNX Runtime decode step of ``input_ids`` [n, T] on cache rows ``first_row``..: grow the
    cache to hold it and bind its ids, positions and mask (host arrays) to ``binding``."""
    n, t = input_ids.shape
    lengths = cache.lengths[first_row : first_row + n]
    total = int(lengths.max()) + t
    cache.ensure_capacity(total)
    positions, mask = decode_inputs(lengths, t, total)
    binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
    binding.bind_cpu_input("position_ids", positions)
    binding.bind_cpu_input("attention_mask", mask)
