"""The engine side of serving: chunked prefill, joining a running batch, and the scheduler's
continuous batching, cancellation and queue bound, without HTTP. Results must equal the
plain generation loop's for the same settings: batching never changes what a request gets."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from llmx.runtime.batch import Batch
from llmx.runtime.chunked_prefill import ChunkedPrefill
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams
from llmx.runtime.sequence import Sequence
from llmx.serve.errors import ApiError
from llmx.serve import scheduler as scheduler_module
from llmx.serve.scheduler import QueueFull, Scheduler
from llmx.serve.service import Service

LONG = "def parse(text, *, strict=True):\n    for i, line in enumerate(text.splitlines()):\n        yield i, line.strip()\n"


@pytest.fixture(scope="module")
def engine(llama_artifact):
    """The scheduler's own engine: a backend's IO binding belongs to one thread at a time."""
    return Engine.load(llama_artifact, threads=1)


@contextmanager
def running(scheduler: Scheduler):
    """A started scheduler, stopped afterwards whatever happens."""
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.stop()


def sequence(engine, text: str, **params) -> Sequence:
    return Sequence(engine.encode(text), SamplingParams(**params), engine.tokenizer, engine.max_seq_len)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_prefill_and_joins_a_batch(llama_engine, chunk):
    backend, prompt = llama_engine.backend, llama_engine.encode(LONG)
    assert len(prompt) > 2 * 16
    whole = backend.new_cache(1, len(prompt))
    logits = backend.prefill(whole, [0], [prompt])[0].copy()
    params = dict(max_new_tokens=12, temperature=0.8, seed=4, ignore_eos=True)
    seq = sequence(llama_engine, LONG, **params)
    prefill = ChunkedPrefill(backend, seq, chunk)
    steps = 0
    while not prefill.finished:
        steps += prefill.step() > 0
    assert steps == -(-len(prompt) // chunk)
    np.testing.assert_allclose(prefill.logits, logits, atol=1e-4)
    for mine, ref in zip(prefill.entries(), whole.read(0)):
        np.testing.assert_allclose(mine, ref, atol=1e-4)
    batch = Batch(backend, rows=2, capacity=len(prompt) + 4)  # grows while decoding
    batch.join(seq, prefill.entries(), prefill.logits)
    while batch.active:
        batch.step()
    assert seq.output_ids == llama_engine.generate([LONG], SamplingParams(**params))[0].output_ids


def test_plain_rows_are_chosen_together_and_rows_with_per_row_work_keep_theirs(llama_engine):
    """Plain greedy rows take the batch's argmax and temperature-only rows one vectorized draw;
    logprobs, penalties, logit_bias and filtered sampling rows still run their own ``choose``:
    every row gets what it would get alone."""
    jobs = [("import os", dict(max_new_tokens=10, temperature=0, ignore_eos=True)),
            ("def f(", dict(max_new_tokens=10, temperature=0.9, seed=5, ignore_eos=True)),
            ("z = {", dict(max_new_tokens=10, temperature=1.3, seed=6, ignore_eos=True)),
            ("x = [", dict(max_new_tokens=10, temperature=0, logprobs=2, ignore_eos=True)),
            ("class A:", dict(max_new_tokens=10, temperature=0, repetition_penalty=1.3, ignore_eos=True)),
            ("y = ", dict(max_new_tokens=10, temperature=0, logit_bias={7: 30.0}, ignore_eos=True)),
            ("for i", dict(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)),
            ("if x", dict(max_new_tokens=10, temperature=0.9, seed=7, logprobs=1, ignore_eos=True))]
    seqs = [sequence(llama_engine, text, **p) for text, p in jobs]
    assert [s.plain_greedy for s in seqs] == [True] + [False] * 7
    assert [s.plain_sampled for s in seqs] == [False, True, True] + [False] * 5
    chosen = []
    for seq in seqs:  # the rows with per-row work must still be asked, and only they
        seq.choose = (lambda original, s: lambda logits: chosen.append(s.id) or original(logits))(seq.choose, seq)
    batch = Batch(llama_engine.backend, rows=len(seqs), capacity=32)
    batch.admit(seqs)
    while batch.active:
        batch.step()
    assert sorted(set(chosen)) == sorted(s.id for s in seqs[3:]) and len(chosen) == 50
    for (text, p), seq in zip(jobs, seqs):
        ref = llama_engine.generate([text], SamplingParams(**p))[0]
        assert seq.output_ids == ref.output_ids
        assert [lp.token_id for lp in seq.logprobs] == [lp.token_id for lp in ref.logprobs]


def drain(ticket, timeout=30.0):
    """All updates of a ticket, in order, once its choices have finished."""
    assert ticket.done.wait(timeout)
    out = []
    while not ticket.updates.empty():
        out.append(ticket.updates.get())
    return out


def test_scheduler_batches_continuously_and_results_equal_generate(engine, llama_engine):
    with running(Scheduler(lambda: engine, max_batch=3, max_queue=8, prefill_chunk=16)) as scheduler:
        assert scheduler.ready.wait(30)
        jobs = [("import os", dict(max_new_tokens=40, temperature=0, ignore_eos=True)),
                ("x = [", dict(max_new_tokens=10, temperature=0.9, seed=1)),
                (LONG, dict(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=2)),  # chunked: 16 per turn
                ("class A:", dict(max_new_tokens=8, temperature=1.0, top_k=20, seed=3, presence_penalty=0.5))]
        first = scheduler.submit([sequence(engine, *jobs[0][:1], **jobs[0][1])])
        first_update = first.updates.get(timeout=30)  # the first request is decoding now
        rest = [scheduler.submit([sequence(engine, text, **p)]) for text, p in jobs[1:]]
        updates = [[first_update] + drain(first)] + [drain(t) for t in rest]
        for (text, p), ticket, ups in zip(jobs, [first] + rest, updates):
            ref = llama_engine.generate([text], SamplingParams(**p))[0]
            assert ticket.seqs[0].output_ids == ref.output_ids
            assert "".join(u.text for u in ups) == ref.text
            assert ups[-1].finish_reason == ref.finish_reason and ups[-1].tokens == len(ref.output_ids)
        # The later requests joined while the first was still decoding, and shared its steps.
        value = scheduler.metrics.registry.get_sample_value
        one, steps = value("llmx_decode_batch_size_bucket", {"le": "1.0"}), value("llmx_decode_batch_size_count")
        assert one < steps, "no decode step ever held more than one sequence"


def test_running_streams_keep_decoding_while_a_long_prompt_is_prefilled(engine):
    with running(Scheduler(lambda: engine, max_batch=2, prefill_chunk=4)) as scheduler:
        decoding = scheduler.submit([sequence(engine, "def", max_new_tokens=150, temperature=0, ignore_eos=True)])
        decoding.updates.get(timeout=30)
        long = scheduler.submit([sequence(engine, LONG, max_new_tokens=2, temperature=0)])
        first = drain(long)[0]
        chunks = -(-len(engine.encode(LONG)) // 4)
        assert first.turn - long.queued_turn >= chunks  # one chunk per turn, never the whole prompt at once
        during = [u for u in drain(decoding) if long.queued_turn <= u.turn < first.turn]
        assert len(during) >= chunks - 1  # and every one of those turns decoded the running stream


def test_an_idle_batch_prefills_a_burst_at_once_a_busy_one_a_chunk_per_turn(engine):
    texts = ["import os", "x = [1, 2]", "class A:", "def f(a, b):"]
    chunk = max(len(engine.encode(t)) for t in texts)  # one prompt per chunk, all four in the idle budget
    assert 2 * min(len(engine.encode(t)) for t in texts) > chunk
    scheduler = Scheduler(lambda: engine, max_batch=5, prefill_chunk=chunk)
    burst = [scheduler.submit([sequence(engine, t, max_new_tokens=3, temperature=0)]) for t in texts]
    calls = engine.backend.prefill_calls
    with running(scheduler):  # the burst is waiting before the first turn: the batch is idle
        firsts = [drain(t)[0] for t in burst]
        assert engine.backend.prefill_calls - calls == 1
        assert len({u.turn for u in firsts}) == 1
        decoding = scheduler.submit([sequence(engine, "def", max_new_tokens=60, temperature=0, ignore_eos=True)])
        decoding.updates.get(timeout=30)
        busy = [scheduler.submit([sequence(engine, t, max_new_tokens=3, temperature=0)]) for t in texts]
        turns = [drain(t)[0].turn for t in busy]
        assert len(set(turns)) == len(texts)  # one chunk per turn while a stream decodes
        drain(decoding)
    for t, ticket in zip(texts, burst):
        assert ticket.seqs[0].output_ids == engine.generate([t], SamplingParams(max_new_tokens=3, temperature=0))[0].output_ids


def test_an_idle_server_gives_back_the_cache_a_long_request_grew(engine, llama_engine, monkeypatch):
    monkeypatch.setattr(scheduler_module, "INITIAL_KV_CAPACITY", 8)
    monkeypatch.setattr(scheduler_module, "IDLE_SHRINK_S", 0.05)
    params = dict(max_new_tokens=24, temperature=0, ignore_eos=True)
    with running(Scheduler(lambda: engine, max_batch=2)) as scheduler:
        assert scheduler.ready.wait(30) and scheduler.batch.cache.capacity == 8
        grown = scheduler.batch
        ticket = scheduler.submit([sequence(engine, LONG, **params)])
        drain(ticket)
        assert grown.cache.capacity >= len(engine.encode(LONG)) + 24
        deadline = time.monotonic() + 10
        while scheduler.batch is grown and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.batch is not grown and scheduler.batch.cache.capacity == 8
        again = scheduler.submit([sequence(engine, LONG, **params)])
        drain(again)
        assert again.seqs[0].output_ids == ticket.seqs[0].output_ids == llama_engine.generate([LONG], SamplingParams(**params))[0].output_ids


def test_a_short_pause_keeps_the_grown_cache(engine, monkeypatch):
    """Requests that each outgrow the initial cache, with pauses shorter than IDLE_SHRINK_S, grow
    it once: the next one runs on the same buffers instead of stalling to grow them again."""
    monkeypatch.setattr(scheduler_module, "INITIAL_KV_CAPACITY", 8)
    monkeypatch.setattr(scheduler_module, "IDLE_SHRINK_S", 60.0)
    params = dict(max_new_tokens=8, temperature=0, ignore_eos=True)
    with running(Scheduler(lambda: engine, max_batch=2)) as scheduler:
        assert scheduler.ready.wait(30)
        first = scheduler.submit([sequence(engine, LONG, **params)])
        drain(first)
        grown = scheduler.batch
        buffers, version = grown.cache.buffers[0], grown.cache.version
        assert version > 0
        time.sleep(0.2)  # idle, well inside the grace period
        second = scheduler.submit([sequence(engine, LONG, **params)])
        drain(second)
        assert scheduler.batch is grown and grown.cache.version == version and grown.cache.buffers[0] is buffers
        assert second.seqs[0].output_ids == first.seqs[0].output_ids


@pytest.mark.parametrize("interval", [0.0, 60.0])
def test_stream_interval_groups_a_streams_text_without_losing_any(engine, interval):
    """Every token is its own update at interval 0; with a long interval the first token still
    comes at once, and the rest arrives with the end: the same text, token count and logprobs."""
    params = dict(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    with running(Scheduler(lambda: engine, max_batch=2, stream_interval_s=interval)) as scheduler:
        assert scheduler.ready.wait(30)
        updates = drain(scheduler.submit([sequence(engine, "def", **params)]))
    plain = engine.generate(["def"], SamplingParams(**params))[0]
    assert "".join(u.text for u in updates) == plain.text
    assert [t.token_id for u in updates for t in u.logprobs] == plain.output_ids
    assert updates[-1].tokens == 12 and updates[-1].finish_reason == "length"
    assert len(updates) == (12 if interval == 0 else 2) and updates[0].tokens == 1


def test_the_server_refuses_a_negative_stream_interval(llama_artifact):
    from llmx.errors import InputError
    from llmx.serve.service import build_service

    with pytest.raises(InputError, match="stream_interval_ms"):
        build_service(llama_artifact, stream_interval_ms=-1)


def test_cancel_frees_the_row_at_once(engine):
    with running(Scheduler(lambda: engine, max_batch=1, max_queue=4)) as scheduler:
        long = scheduler.submit([sequence(engine, "def", max_new_tokens=200, temperature=0, ignore_eos=True)])
        waiting = scheduler.submit([sequence(engine, "x", max_new_tokens=4, temperature=0)])
        long.updates.get(timeout=30)
        assert scheduler.counts() == (1, 1)
        scheduler.cancel(long)
        drain(waiting)  # got the row
        seq = long.seqs[0]
        assert seq.finish_reason == "cancelled" and len(seq.output_ids) < 200
        assert scheduler.counts() == (0, 0)
        assert scheduler.metrics.registry.get_sample_value("llmx_cancelled_sequences_total") == 1


def test_queue_bound_counts_running_and_waiting(engine):
    with running(Scheduler(lambda: engine, max_batch=1, max_queue=1)) as scheduler:
        scheduler.ready.wait(30)
        held = [scheduler.submit([sequence(engine, "def", max_new_tokens=50, temperature=0, ignore_eos=True)]) for _ in range(2)]
        with pytest.raises(QueueFull):
            scheduler.submit([sequence(engine, "x", max_new_tokens=2)])
        for t in held:
            drain(t)
        drain(scheduler.submit([sequence(engine, "x", max_new_tokens=2)]))  # room again


def test_engine_errors_fail_the_requests_they_hit_and_the_server_goes_on(engine):
    class Flaky:  # a real backend whose next call of one method raises
        def __init__(self, backend):
            self.backend, self.fail = backend, None

        def __getattr__(self, name):
            return getattr(self.backend, name)

        def call(self, name, *args, **kwargs):
            if self.fail == name:
                self.fail = None
                raise RuntimeError(f"device lost in {name}")
            return getattr(self.backend, name)(*args, **kwargs)

        def decode(self, *args, **kwargs):
            return self.call("decode", *args, **kwargs)

        def prefill(self, *args, **kwargs):
            return self.call("prefill", *args, **kwargs)

    flaky = Engine(engine.artifact, Flaky(engine.backend), engine.tokenizer)
    with running(Scheduler(lambda: flaky, max_batch=2)) as scheduler:
        scheduler.ready.wait(30)
        broken = scheduler.submit([sequence(engine, "def", max_new_tokens=100, temperature=0, ignore_eos=True)])
        broken.updates.get(timeout=30)
        flaky.backend.fail = "decode"
        assert "device lost in decode" in drain(broken)[-1].message
        flaky.backend.fail = "prefill"
        assert "device lost in prefill" in drain(scheduler.submit([sequence(engine, "x", max_new_tokens=3)]))[-1].message
        ok = drain(scheduler.submit([sequence(engine, "x", max_new_tokens=3, temperature=0, ignore_eos=True)]))
        assert ok[-1].tokens == 3 and scheduler.alive and scheduler.counts() == (0, 0)


def test_time_between_tokens_is_recorded(engine):
    with running(Scheduler(lambda: engine)) as scheduler:
        drain(scheduler.submit([sequence(engine, "def", max_new_tokens=6, temperature=0, ignore_eos=True)]))
        value = scheduler.metrics.registry.get_sample_value
        assert value("llmx_time_to_first_token_seconds_count") == 1
        assert value("llmx_inter_token_latency_seconds_count") == 5 and value("llmx_inter_token_latency_seconds_sum") > 0
        assert value("llmx_generation_tokens_total") == 6 and value("llmx_prompt_tokens_total") == len(engine.encode("def"))


def test_not_ready_until_the_engine_loads(engine):
    gate = threading.Event()
    with running(Scheduler(lambda: gate.wait(30) and engine)) as scheduler:
        service = Service(scheduler, "llama")
        with pytest.raises(ApiError) as info:
            service.ready()
        assert info.value.status == 503 and info.value.headers() == {"Retry-After": "1"}
        assert service.health() == {"status": "ok"}
        gate.set()
        assert scheduler.ready.wait(30) and service.ready()["status"] == "ready"
