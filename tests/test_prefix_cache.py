"""Prefix caching: a request whose prompt starts with cached blocks gets exactly the tokens a cold
request gets, the prefill graph does not run for the cached part (counted on the real backend),
usage reports ``prompt_tokens_details.cached_tokens``, and memory stays under the budget with
least-recently-used blocks (tails first) evicted."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from live_server import LiveServer
from llmx.runtime.engine import Engine
from llmx.runtime.generate import generate
from llmx.runtime.sampling import SamplingParams
from llmx.runtime.sequence import Sequence
from llmx.serve.prefix_cache import PrefixCache
from llmx.serve.scheduler import Scheduler

SYSTEM = ("You are a careful Python reviewer. Answer with code only, keep the style of the file, and never "
          "change behaviour you were not asked to change.\n")


class CountingBackend:
    """The real backend, counting the tokens each graph computes."""

    def __init__(self, backend):
        self.backend, self.prefill_tokens, self.decode_tokens = backend, 0, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def prefill(self, cache, rows, prompts, padding="right"):
        self.prefill_tokens += sum(len(p) for p in prompts)
        return self.backend.prefill(cache, rows, prompts, padding)

    def decode(self, cache, input_ids, last_only=False):
        self.decode_tokens += input_ids.size
        return self.backend.decode(cache, input_ids, last_only)


@pytest.fixture(scope="module")
def engine(llama_artifact):
    loaded = Engine.load(llama_artifact, threads=1)
    return Engine(loaded.artifact, CountingBackend(loaded.backend), loaded.tokenizer)


@contextmanager
def scheduler_for(engine, **options):
    scheduler = Scheduler(lambda: engine, **options).start()
    try:
        assert scheduler.ready.wait(30)
        yield scheduler
    finally:
        scheduler.stop()


def run(scheduler, engine, prompt: list[int], **params) -> Sequence:
    seq = Sequence(prompt, SamplingParams(**params), engine.tokenizer, engine.max_seq_len)
    ticket = scheduler.submit([seq])
    assert ticket.done.wait(60)
    return seq


@pytest.mark.parametrize("chunk", [256, 8])  # warm prompts prefilled at once, or chunk by chunk
def test_warm_request_skips_prefill_of_the_cached_prefix_and_matches_cold(engine, chunk):
    backend = engine.backend
    system = engine.encode(SYSTEM)
    first, second = system + engine.encode("def add(a, b):"), system + engine.encode("class Stack:")
    params = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    reference = [generate(backend, engine.tokenizer, [p], SamplingParams(**params))[0].output_ids for p in (first, second)]
    with scheduler_for(engine, prefill_chunk=chunk, prefix_cache_bytes=64 << 20) as scheduler:
        a = run(scheduler, engine, first, **params)
        prefills, computed = backend.prefill_tokens, backend.prefill_tokens + backend.decode_tokens
        b = run(scheduler, engine, second, **params)
        assert a.output_ids == reference[0] and b.output_ids == reference[1]
        # whole blocks, then the shared start of the next one: up to the first token that differs
        cached = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
        assert cached >= len(system)
        assert a.cached_tokens == 0 and b.cached_tokens == cached > 16
        assert backend.prefill_tokens == prefills  # the prefill graph never ran for the warm request
        work = backend.prefill_tokens + backend.decode_tokens - computed
        assert work == len(second) - cached + params["max_new_tokens"] - 1  # the uncached rest, then decode steps
        value = scheduler.metrics.registry.get_sample_value
        assert value("llmx_prefix_cache_hit_tokens_total") == cached
        assert 0 < value("llmx_prefix_cache_bytes") == scheduler.prefix_cache.nbytes


def test_generated_tokens_are_cached_for_the_next_turn(engine):
    """A chat's next turn starts with the previous prompt and answer: those blocks are reused."""
    params = dict(max_new_tokens=40, temperature=0, ignore_eos=True)
    with scheduler_for(engine, prefix_cache_bytes=64 << 20) as scheduler:
        turn1 = engine.encode(SYSTEM)
        answer = run(scheduler, engine, turn1, **params)
        turn2 = turn1 + answer.output_ids + engine.encode("\nand now in one line")
        again = run(scheduler, engine, turn2, **params)
        assert again.cached_tokens == ((len(turn1) + len(answer.output_ids) - 1) // 16) * 16  # the last token was never cached
        assert again.cached_tokens > len(turn1)


def test_lookup_walks_chained_blocks_and_leaves_a_token_to_compute(engine):
    backend, cache = engine.backend, PrefixCache(1 << 30, block=4)
    ids = engine.encode(SYSTEM)[:13]
    kv = backend.new_cache(1, len(ids))
    backend.prefill(kv, [0], [ids])
    assert cache.lookup(ids) is None
    assert cache.insert(ids, kv, 0) == 3  # 13 tokens: three full blocks of 4
    hit, entries = cache.lookup(ids + [5, 6])
    assert hit == 12
    for mine, ref in zip(entries, kv.read(0, 0, 12)):
        np.testing.assert_array_equal(mine, ref)
    assert cache.lookup(ids[:12])[0] == 11  # the last prompt token is always computed
    assert cache.lookup([ids[0] + 1] + ids[1:]) is None  # a different first block: no later block matches
    other = [t + 1 for t in ids[4:8]]
    assert cache.lookup(ids[:4] + other + ids[8:])[0] == 4  # same block 3 after another block 2: no hit


def test_a_missed_block_reuses_its_longest_cached_start_among_those_after_the_same_prefix(engine):
    """Chat prompts share the template up to the user's text, mid-block: those slots are reused
    to the token, from whichever cached continuation of the same prefix shares the most."""
    backend, cache = engine.backend, PrefixCache(1 << 30, block=4)
    ids = engine.encode(SYSTEM)[:12]
    variants = [ids[:5] + [t + 1 for t in ids[5:]], ids[:6] + [t + 1 for t in ids[6:]]]  # block 1 differs from slot 5 / 6 on
    kvs = []
    for tokens in variants:
        kv = backend.new_cache(1, len(tokens))
        backend.prefill(kv, [0], [tokens])
        cache.insert(tokens, kv, 0)
        kvs.append(kv)
    hit, entries = cache.lookup(ids + [9])
    assert hit == 6  # block 0 whole, then 2 slots of the second variant's block 1 (the first shares 1)
    for mine, ref in zip(entries, kvs[1].read(0, 0, 6)):
        np.testing.assert_array_equal(mine, ref)
    assert cache.lookup(ids[:7])[0] == 6 and cache.lookup(ids[:6])[0] == 5  # never the last prompt token
    assert cache.lookup(ids[:4] + [ids[4] + 1] + ids[5:])[0] == 4  # nothing after block 0 starts this way
    small = PrefixCache(2 * sum(e.nbytes for e in entries) // 6 * 4, block=4)  # room for two blocks
    for tokens, kv in zip(variants, kvs):
        small.insert(tokens, kv, 0)
    assert small.lookup(ids + [9])[0] == 6 and small.evictions == 1 and len(small) == 2  # v1: 2 in (a third would
    # evict its own start); v2: block 0 shared, its block 1 in for v1's, its block 2 would evict block 0
    assert sum(len(c) for c in small._children.values()) == len(small)  # evicted blocks left their parent's list


def test_memory_stays_under_budget_and_chains_lose_their_tails_first(engine):
    backend = engine.backend
    kv = engine.manifest.kv
    block_bytes = 2 * kv.num_layers * kv.num_kv_heads * 4 * kv.head_dim * 4  # k+v, layers, heads, 4 slots, fp32
    cache = PrefixCache(3 * block_bytes, block=4)
    ids = engine.encode(SYSTEM)[:17]
    kv = backend.new_cache(1, len(ids))
    backend.prefill(kv, [0], [ids])
    cache.insert(ids, kv, 0)  # four blocks offered, three fit: the chain's tail is not kept
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes and cache.evictions == 0
    assert cache.lookup(ids)[0] == 12
    other = engine.encode("import os, sys\n" * 3)[:9]
    kv2 = backend.new_cache(1, len(other))
    backend.prefill(kv2, [0], [other])
    cache.insert(other, kv2, 0)  # two new blocks: the older chain loses its last two blocks
    assert cache.lookup(ids)[0] == 4 and cache.lookup(other)[0] == 8 and cache.evictions == 2
    assert PrefixCache(block_bytes - 1, block=4).insert(ids, kv, 0) == 0  # a block over the budget is never kept


def test_usage_reports_cached_tokens_over_http(llama_artifact):
    system = SYSTEM * 2
    with LiveServer(artifact=llama_artifact, threads=1, max_batch=2, prefix_cache_mb=16) as live:
        client = live.client(max_retries=0, timeout=60)
        first = client.completions.create(model="llama", prompt=system + "def add(a, b):", max_tokens=4, temperature=0)
        warm = client.completions.create(model="llama", prompt=system + "class Stack:", max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.usage.prompt_tokens_details.cached_tokens >= 16
        ids = live.service.scheduler.engine.encode(system + "import os")  # a token-id prompt over 64 tokens
        assert len(ids) > 64
        as_ids = client.completions.create(model="llama", prompt=ids, max_tokens=4, temperature=0)
        assert as_ids.usage.prompt_tokens == len(ids) and as_ids.usage.prompt_tokens_details.cached_tokens >= 16
        chunks = list(client.chat.completions.create(
            model="llama", messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True}))
        again = client.chat.completions.create(
            model="llama", messages=[{"role": "system", "content": system}, {"role": "user", "content": "hello"}],
            max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True})
        usage = list(again)[-1].usage
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
        assert usage.prompt_tokens_details.cached_tokens >= 16 and usage.prompt_tokens > usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_off_reports_zero(llama_artifact):
    with LiveServer(artifact=llama_artifact, threads=1, prefix_cache_mb=0) as live:
        client = live.client(max_retries=0, timeout=60)
        for _ in range(2):
            out = client.completions.create(model="llama", prompt=SYSTEM * 2, max_tokens=2, temperature=0)
            assert out.usage.prompt_tokens_details.cached_tokens == 0
        assert live.scheduler.prefix_cache is None


def test_the_default_size_follows_the_model_not_a_fixed_256_mb(llama_artifact):
    from llmx.artifact.manifest import load_manifest
    from llmx.serve.prefix_cache import DEFAULT_CAP_BYTES, default_bytes
    from llmx.serve.service import build_service

    manifest = load_manifest(llama_artifact)
    kv = manifest.kv
    per_token = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * 4  # fp32 K and V
    service = build_service(llama_artifact, threads=1, max_batch=3)
    try:
        assert service.scheduler.prefix_cache.max_bytes == 3 * manifest.max_seq_len * per_token < DEFAULT_CAP_BYTES
    finally:
        service.scheduler.stop()
    assert default_bytes(manifest, 10**6) == DEFAULT_CAP_BYTES  # a big batch of a big model stays bounded


def test_evicted_slots_are_reused_in_place_with_the_new_blocks_kv(engine):
    """The cache's arrays are sized once; a turned-over cache writes new blocks into the slots
    evicted ones held (no allocation per block: the heap stays flat under load)."""
    backend = engine.backend
    kv = engine.manifest.kv
    block_bytes = 2 * kv.num_layers * kv.num_kv_heads * 4 * kv.head_dim * 4
    cache = PrefixCache(2 * block_bytes, block=4)
    prompts = [engine.encode(text)[:5] for text in ("def f(x):", "class A:\n", "import os\n", "while True:")]
    caches = []
    for ids in prompts:
        one = backend.new_cache(1, len(ids))
        backend.prefill(one, [0], [ids])
        caches.append(one)
        cache.insert(ids, one, 0)
        if len(caches) == 1:
            arrays = list(cache._slots)
    assert [a is b for a, b in zip(cache._slots, arrays)] == [True] * len(arrays) and len(arrays[0]) == 2
    assert cache.evictions == 2 and len(cache) == 2
    for gone in prompts[:2]:  # at most a partial start shared with a kept block (BOS)
        assert (cache.lookup(gone) or (0,))[0] < 4
    for ids, one in zip(prompts[2:], caches[2:]):
        hit, entries = cache.lookup(ids)
        assert hit == 4
        for mine, ref in zip(entries, one.read(0, 0, 4)):
            np.testing.assert_array_equal(mine, ref)


def test_the_server_reserves_its_prefix_cache_when_the_engine_loads(engine):
    """Its memory after start-up is its memory under load: every slot exists and was written
    before the first request, and caching blocks then allocates nothing."""
    kv = engine.manifest.kv
    block_bytes = 2 * kv.num_layers * kv.num_kv_heads * 16 * kv.head_dim * 4
    with scheduler_for(engine, max_batch=2, prefix_cache_bytes=5 * block_bytes + 7) as scheduler:
        cache = scheduler.prefix_cache
        assert len(cache) == 0 and sum(a.nbytes for a in cache._slots) == 5 * block_bytes
        assert all(a.shape[0] == 5 and not a.any() for a in cache._slots)  # touched: zeros written, not just mapped
        arrays = list(cache._slots)
        run(scheduler, engine, engine.encode(SYSTEM), max_new_tokens=4, temperature=0)
        assert len(cache) > 0 and all(a is b for a, b in zip(cache._slots, arrays))
