"""The host KV cache's growth: what a row has filled survives, nothing else is copied."""

from __future__ import annotations

import numpy as np

from llmx.runtime.kv_cache import KVCache


def test_growth_keeps_every_rows_filled_slots_and_copies_nothing_else():
    cache = KVCache(num_layers=2, kv_heads=2, head_dim=4, rows=3, capacity=8, max_capacity=64)
    rng = np.random.default_rng(0)
    for buf in cache.buffers:
        buf[...] = rng.standard_normal(buf.shape)  # row 1 holds stale data past its length
    cache.lengths[:] = [8, 3, 0]
    before = [buf.copy() for buf in cache.buffers]
    cache.ensure_capacity(9)
    assert cache.capacity == 16 and cache.version == 1
    for old, new in zip(before, cache.buffers):
        np.testing.assert_array_equal(new[0, :, :8], old[0, :, :8])
        np.testing.assert_array_equal(new[1, :, :3], old[1, :, :3])
        assert not new[1, :, 3:].any() and not new[2].any() and not new[:, :, 8:].any()
    assert all(np.array_equal(a, b[1, :, :3]) for a, b in zip(cache.read(1), before))
