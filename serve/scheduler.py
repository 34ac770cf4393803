"""The scheduler: one thread owns the engine and batches every request's sequences continuously.

    HTTP threads --submit/cancel--> inbox --> scheduler thread --Update--> each ticket's queue

Each loop turn: take new requests and cancellations from the inbox, spend a prefill budget of
``prefill_chunk`` prompt tokens on waiting sequences (short prompts are prefilled together
into free rows; a longer prompt goes through ``ChunkedPrefill`` one chunk per turn), then
decode one token for every running sequence. So new requests join the running batch between
decode steps, finished ones leave at once, and a long prompt never stalls running streams for
longer than one chunk. Sequences, the KV cache and the backend's IO binding are touched only
by this thread; HTTP threads see ``Update`` messages (text, logprobs, finish reason).

Optional, per server: a prefix cache (a prompt whose start is cached skips prefill for it; see
prefix_cache.py), speculative decoding (the batch is a ``SpeculativeBatch``), and beam-search
requests, which run beside the batch in their own rows (beam_jobs.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from llmx.runtime.batch import Batch, Event
from llmx.runtime.beam import BeamParams
from llmx.runtime.chunked_prefill import ChunkedPrefill
from llmx.runtime.sequence import Sequence, TokenLogprob
from llmx.serve.beam_jobs import BeamJob
from llmx.serve.metrics import Metrics
from llmx.serve.prefix_cache import PrefixCache

log = logging.getLogger("llmx.serve")
INITIAL_KV_CAPACITY = 512  # per row; the cache grows by doubling up to the model's context
# How long an idle server keeps a KV cache that grew before giving it back: traffic with short
# pauses (a chat of ~400-token prompts crosses 512) would otherwise grow it again on every request,
# a stall of every stream each time (45-650 ms for 8 rows of a 135M model).
IDLE_SHRINK_S = 10.0
IDLE_PREFILL_CHUNKS = 4  # an idle batch's prefill budget, in chunks (see Scheduler._prefill_budget)


class QueueFull(Exception):
    """More sequences than ``max_batch`` running plus ``max_queue`` waiting."""


@dataclass
class Update:
    index: int  # the choice within its request
    text: str  # newly visible text
    logprobs: list[TokenLogprob]  # of the new token(s), when logprobs were asked for
    tokens: int  # tokens this choice has generated so far
    finish_reason: str | None
    turn: int = 0  # the scheduler turn that made it (orders updates across requests)
    cached_tokens: int = 0  # prompt tokens of this choice served from the prefix cache


@dataclass
class Failure:
    message: str
    status: int = 500  # what a whole (non-streamed) answer says: 500, or 503 when the server sheds work


class Ticket:
    """One request's sequences as its HTTP thread sees them: a queue of updates and a done flag."""

    def __init__(self, seqs: list[Sequence], beam: list[BeamParams] | None = None):
        self.seqs = seqs
        self.beam = beam  # beam search: one BeamParams per prompt; seqs are its choices, n per prompt
        self.updates: queue.SimpleQueue[Update | Failure] = queue.SimpleQueue()
        self.done = threading.Event()  # set when every choice has finished (or failed)
        self.arrival = time.perf_counter()
        self.open = len(seqs)  # choices still running; scheduler thread only
        self.queued_turn: int | None = None  # the turn the scheduler took it in


@dataclass
class _Owner:  # where a sequence's updates go
    ticket: Ticket
    index: int
    tokens: int = 0
    last: float = field(default_factory=time.perf_counter)
    held: str = ""  # text not handed over yet (Scheduler's stream_interval_s)


class Scheduler:
    def __init__(self, load_engine: Callable[[], object], max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int = 256, metrics: Metrics | None = None, prefix_cache_bytes: int = 0,
                 load_drafter: Callable[[object], object] | None = None, stream_interval_s: float = 0.0):
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        # A stream's new text goes to its HTTP thread at most this often (its first token and its
        # end at once). A small model steps in a fraction of a millisecond, and one hand-off per
        # token per stream wakes every stream's thread every step to contend for the GIL and the
        # cores with the graph; a step of the models people serve takes longer than the server's
        # 10 ms, so their streams still get every token as it comes.
        self.stream_interval_s = stream_interval_s
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._load_drafter = load_drafter  # engine -> drafter, run in this thread after loading
        self.drafter = None
        self._spec_counted = (0, 0)  # drafter totals already counted in metrics
        self._beam_waiting: deque[BeamJob] = deque()
        self._beams: list[BeamJob] = []  # running beam searches, stepped once per turn
        self.metrics = metrics or Metrics()
        self.engine = None
        self.ready = threading.Event()  # the engine is loaded and the loop runs
        self.settled = threading.Event()  # loading is over, one way or the other
        self.load_error: str | None = None
        self.load_exception: BaseException | None = None
        self._load_engine = load_engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._admitted = 0  # sequences submitted and not yet finished (guarded by _lock)
        self._waiting: deque[Sequence] = deque()
        self._prefill: ChunkedPrefill | None = None
        self._owners: dict[int, _Owner] = {}
        self.batch: Batch | None = None
        self.turn = 0
        self._thread = threading.Thread(target=self._run, name="llmx-scheduler", daemon=True)

    # -- called from HTTP threads ----------------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def capacity(self) -> int:
        return self.max_batch + self.max_queue

    def submit(self, seqs: list[Sequence], beam: list[BeamParams] | None = None) -> Ticket:
        with self._lock:
            if self._admitted + len(seqs) > self.capacity:
                raise QueueFull(f"{self._admitted} sequences running or queued (limit {self.capacity})")
            self._admitted += len(seqs)
        ticket = Ticket(seqs, beam)
        self._inbox.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: stop its sequences and free their rows at the next turn."""
        self._inbox.put(("cancel", ticket))

    def shed(self, message: str, running: bool = False) -> None:
        """End queued requests (and, with ``running``, every request) with a 503 Failure: the
        server is shutting down. Requests already generating keep going unless ``running``."""
        self._inbox.put(("shed", (message, running)))

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences, for health checks and tests."""
        with self._lock:
            admitted = self._admitted
        running = len(self.batch.active) + (self._prefill is not None) if self.batch else 0
        running += sum(len(job.ticket.seqs) for job in self._beams)
        return running, max(admitted - running, 0)

    # -- the scheduler thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._load_engine()
            if self._load_drafter is not None:
                self.drafter = self._load_drafter(self.engine)
            if self.prefix_cache is not None:
                reserved = self.prefix_cache.reserve(self.engine.backend.new_cache(1, self.prefix_cache.block))
                log.info("prefix cache: %.1f MiB reserved", reserved / 2**20)
            self._new_batch()
        except Exception as exc:  # noqa: BLE001 -- reported by /ready and every request
            self.load_error, self.load_exception = str(exc) or type(exc).__name__, exc
            log.error("engine failed to load: %s", self.load_error)
            return
        finally:
            self.settled.set()
        self.ready.set()
        idle_since = time.monotonic()
        while True:
            idle, wait = not self._busy(), None
            if not idle:
                idle_since = time.monotonic()
            elif self._cache_grown():
                wait = IDLE_SHRINK_S - (time.monotonic() - idle_since)
                if wait <= 0:
                    self._shrink_idle_cache()
                    continue
            if not self._drain(block=idle, timeout=wait):
                break
            self.turn += 1
            try:
                self._publish(self._admit())
                self._publish(self.batch.step())
                self._publish(self._step_beams())
            except Exception as exc:  # noqa: BLE001 -- a failed step must not kill the server
                log.exception("generation step failed")
                self._fail_running(f"generation failed: {exc}")
            self._gauges()

    def _initial_capacity(self) -> int:
        return min(self.engine.backend.max_seq_len, INITIAL_KV_CAPACITY)

    def _new_batch(self) -> None:
        backend = self.engine.backend
        capacity = self._initial_capacity()
        if self.drafter is None:
            self.batch = Batch(backend, rows=self.max_batch, capacity=capacity)
        else:
            from llmx.runtime.speculative import SpeculativeBatch

            self.batch = SpeculativeBatch(backend, self.max_batch, capacity, self.drafter)
        if self.prefix_cache is not None:
            self.batch.on_leave = self._remember_leaving

    def _shrink_idle_cache(self) -> None:
        """A batch idle for IDLE_SHRINK_S whose KV cache grew for a long request starts afresh at
        the initial size: a quiet server holds a small cache, not the one its longest request
        needed (rows x layers x context, hundreds of MB after one 8k-token request)."""
        self._new_batch()

    def _cache_grown(self) -> bool:
        return self.batch.cache.capacity > self._initial_capacity()

    def _busy(self) -> bool:
        return bool(self.batch.active or self._waiting or self._prefill or self._beams or self._beam_waiting)

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply inbox messages; wait for one when idle (at most ``timeout`` s). False means stop."""
        while True:
            try:
                kind, ticket = self._inbox.get(block=block, timeout=timeout)  # timeout: only while blocking
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "shed":
                self._shed(*ticket)
                continue
            if kind == "submit":
                ticket.queued_turn = self.turn + 1
                for i, seq in enumerate(ticket.seqs):
                    self._owners[seq.id] = _Owner(ticket, i)
                    if ticket.beam is None:
                        self._waiting.append(seq)
                if ticket.beam is not None:
                    self._beam_waiting.append(BeamJob(ticket, ticket.beam, len(ticket.seqs) // len(ticket.beam)))
            else:
                self._cancel(ticket)

    def _shed(self, message: str, running: bool) -> None:
        waiting = {s.id for s in self._waiting} | {s.id for job in self._beam_waiting for s in job.ticket.seqs}
        tickets = {id(o.ticket): o.ticket for o in self._owners.values()}
        for ticket in tickets.values():
            if running or all(s.id in waiting for s in ticket.seqs if s.id in self._owners):
                ticket.updates.put(Failure(message, 503))  # before _drop sets ``done``
                self._drop(ticket, "error")

    def _cancel(self, ticket: Ticket) -> None:
        self.metrics.cancelled.inc(self._drop(ticket))

    def _drop(self, ticket: Ticket, reason: str = "cancelled") -> int:
        """Stop every unfinished sequence of ``ticket`` wherever it is; returns how many."""
        gone = [s for s in ticket.seqs if s.id in self._owners]
        for seq in gone:
            seq.cancel(reason)
            self._finish(seq)
        self._waiting = deque(s for s in self._waiting if not s.finished)
        self._beams = [job for job in self._beams if job.ticket is not ticket]
        self._beam_waiting = deque(job for job in self._beam_waiting if job.ticket is not ticket)
        if self._prefill is not None and self._prefill.seq.finished:
            self._prefill = None
        self.batch.compact()
        return len(gone)

    def _admit(self) -> list[Event]:
        """Spend this turn's prefill budget: continue a chunked prompt, then admit short ones
        (a prompt whose start is in the prefix cache computes only the rest)."""
        budget, events = self._prefill_budget(), []
        if self._prefill is not None:
            budget -= self._prefill.step()
            if self._prefill.finished:
                done, self._prefill = self._prefill, None
                events += self._join(done)
        group: list[Sequence] = []
        free = self.batch.free_rows - (self._prefill is not None)
        while self._waiting and len(group) < free:
            seq = self._waiting[0]
            prefix = self.prefix_cache.lookup(seq.prompt_ids) if self.prefix_cache else None
            rest = len(seq.prompt_ids) - (prefix[0] if prefix else 0)
            if rest > self.prefill_chunk and self._prefill is None:
                self._prefill = ChunkedPrefill(self.engine.backend, self._take(prefix), self.prefill_chunk, prefix)
                break  # its first chunk runs next turn, after a decode step
            if rest > budget:
                break
            budget -= rest
            if prefix is None:
                group.append(self._take())
                continue
            warm = ChunkedPrefill(self.engine.backend, self._take(prefix), rest, prefix)
            warm.step()
            events += self._join(warm)
            free -= 1
        events += self.batch.admit(group)
        self._remember_prompts(group)
        return events

    def _prefill_budget(self) -> int:
        """Prompt tokens this turn may prefill. The chunk bounds how long running streams wait for
        their next token; with none running there is nobody to stall, so a burst of short prompts
        is prefilled in one larger group (one graph run, and every row then decodes from the first
        step on) instead of a chunk's worth per turn with partial decode steps in between."""
        if self.batch.active or self._beams:
            return self.prefill_chunk
        return IDLE_PREFILL_CHUNKS * self.prefill_chunk

    def _join(self, done: ChunkedPrefill) -> list[Event]:
        if self.prefix_cache is not None:
            self.prefix_cache.insert(done.seq.prompt_ids, done.cache, 0)
        return self.batch.join(done.seq, done.entries(), done.logits)

    def _remember_prompts(self, seqs: list[Sequence]) -> None:
        """Prefix-cache the prompts just prefilled (those still running: the rest left already)."""
        if self.prefix_cache is None:
            return
        for seq in seqs:
            if not seq.finished:
                self.prefix_cache.insert(seq.prompt_ids, self.batch.cache, self.batch.active.index(seq))

    def _remember_leaving(self, seq: Sequence, cache, row: int) -> None:
        """A sequence leaves its row: keep the KV of its prompt and what it generated."""
        self.prefix_cache.insert(seq.prompt_ids + seq.output_ids, cache, row)

    def _step_beams(self) -> list[Event]:
        """Start beam searches whose rows fit, then one step of every running one."""
        used = sum(job.rows for job in self._beams)
        while self._beam_waiting and used + self._beam_waiting[0].rows <= self.max_batch:
            job = self._beam_waiting.popleft()
            self._beams.append(job)
            used += job.rows
            self.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in job.ticket.seqs[:: job.n]))
        events = []
        for job in list(self._beams):
            done = job.step(self.engine.backend, self.engine.tokenizer.eos_token_ids)
            if done:
                self._beams.remove(job)
                events += done
        return events

    def _take(self, prefix: tuple | None = None) -> Sequence:
        seq = self._waiting.popleft()
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        if prefix is not None:
            seq.cached_tokens = prefix[0]
            self.metrics.prefix_cache_hit_tokens.inc(prefix[0])
        return seq

    def _publish(self, events: list[Event]) -> None:
        now = time.perf_counter()
        for seq, text in events:
            own = self._owners.get(seq.id)
            if own is None:
                continue
            if own.tokens and not seq.finished and now - own.last < self.stream_interval_s:
                own.held += text
                continue
            text, own.held = own.held + text, ""
            if own.tokens == 0:
                self.metrics.ttft.observe(now - own.ticket.arrival)
            else:
                self.metrics.itl.observe(now - own.last)
            new = seq.logprobs[own.tokens :] if seq.params.logprobs is not None else []
            self.metrics.generation_tokens.inc(len(seq.output_ids) - own.tokens)  # several with speculation
            own.tokens, own.last = len(seq.output_ids), now
            own.ticket.updates.put(Update(own.index, text, new, own.tokens, seq.finish_reason, self.turn,
                                          seq.cached_tokens))
            if seq.finished:
                self._finish(seq)
        if self.batch.active:
            self.metrics.batch_size.observe(len(self.batch.active))

    def _finish(self, seq: Sequence) -> None:
        own = self._owners.pop(seq.id)
        with self._lock:
            self._admitted -= 1
        own.ticket.open -= 1
        if own.ticket.open == 0:
            self.metrics.e2e.observe(time.perf_counter() - own.ticket.arrival)
            own.ticket.done.set()

    def _fail_running(self, message: str) -> None:
        """After an engine error the cache is suspect: fail every request past the waiting line
        (running, prefilling, or taken for a prefill that raised), start afresh."""
        waiting = {s.id for s in self._waiting} | {s.id for job in self._beam_waiting for s in job.ticket.seqs}
        tickets = {id(o.ticket): o.ticket for sid, o in self._owners.items() if sid not in waiting}
        self._prefill = None
        self._beams = []
        self._new_batch()
        for ticket in tickets.values():
            ticket.updates.put(Failure(message))  # before _drop sets ``done``
            self._drop(ticket, "error")

    def _gauges(self) -> None:
        running, waiting = self.counts()
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(waiting)
        if self.prefix_cache is not None:
            self.metrics.prefix_cache_bytes.set(self.prefix_cache.nbytes)
        if self.drafter is not None:  # the drafter's totals, as counter increments
            stats, (drafted, accepted) = self.drafter.stats, self._spec_counted
            self.metrics.draft_tokens.inc(stats.drafted - drafted)
            self.metrics.accepted_tokens.inc(stats.accepted - accepted)
            self._spec_counted = (stats.drafted, stats.accepted)
