"""The scheduler: one thread owns the engine and batches every request's sequences continuously.

    HTTP threads --submit/cancel--> inbox --> scheduler thread --Update--> each ticket's queue

Each loop turn: take new requests and cancellations from the inbox, spend a prefill budget of
``prefill_chunk`` prompt tokens on waiting sequences (short prompts are prefilled together
into free rows; a longer prompt goes through ``ChunkedPrefill`` one chunk per turn), then
decode one token for every running sequence. So new requests join the running batch between
decode steps, finished ones leave at once, and a long prompt never stalls running streams for
longer than one chunk. Sequences, the KV cache and the backend's IO binding are touched only
by this thread; HTTP threads see ``Update`` messages (text, logprobs, finish reason).
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
from llmx.runtime.chunked_prefill import ChunkedPrefill
from llmx.runtime.sequence import Sequence, TokenLogprob
from llmx.serve.metrics import Metrics

log = logging.getLogger("llmx.serve")
INITIAL_KV_CAPACITY = 512  # per row; the cache grows by doubling up to the model's context


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


@dataclass
class Failure:
    message: str


class Ticket:
    """One request's sequences as its HTTP thread sees them: a queue of updates and a done flag."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs
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


class Scheduler:
    def __init__(self, load_engine: Callable[[], object], max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int = 256, metrics: Metrics | None = None):
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
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

    def submit(self, seqs: list[Sequence]) -> Ticket:
        with self._lock:
            if self._admitted + len(seqs) > self.capacity:
                raise QueueFull(f"{self._admitted} sequences running or queued (limit {self.capacity})")
            self._admitted += len(seqs)
        ticket = Ticket(seqs)
        self._inbox.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: stop its sequences and free their rows at the next turn."""
        self._inbox.put(("cancel", ticket))

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences, for health checks and tests."""
        with self._lock:
            admitted = self._admitted
        running = len(self.batch.active) + (self._prefill is not None) if self.batch else 0
        return running, max(admitted - running, 0)

    # -- the scheduler thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._load_engine()
            self._new_batch()
        except Exception as exc:  # noqa: BLE001 -- reported by /ready and every request
            self.load_error, self.load_exception = str(exc) or type(exc).__name__, exc
            log.error("engine failed to load: %s", self.load_error)
            return
        finally:
            self.settled.set()
        self.ready.set()
        while self._drain(block=not self._busy()):
            self.turn += 1
            try:
                self._publish(self._admit())
                self._publish(self.batch.step())
            except Exception as exc:  # noqa: BLE001 -- a failed step must not kill the server
                log.exception("generation step failed")
                self._fail_running(f"generation failed: {exc}")
            self._gauges()

    def _new_batch(self) -> None:
        backend = self.engine.backend
        self.batch = Batch(backend, rows=self.max_batch, capacity=min(backend.max_seq_len, INITIAL_KV_CAPACITY))

    def _busy(self) -> bool:
        return bool(self.batch.active or self._waiting or self._prefill)

    def _drain(self, block: bool) -> bool:
        """Apply inbox messages; wait for one when idle. False means stop."""
        while True:
            try:
                kind, ticket = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                ticket.queued_turn = self.turn + 1
                for i, seq in enumerate(ticket.seqs):
                    self._owners[seq.id] = _Owner(ticket, i)
                    self._waiting.append(seq)
            else:
                self._cancel(ticket)

    def _cancel(self, ticket: Ticket) -> None:
        self.metrics.cancelled.inc(self._drop(ticket))

    def _drop(self, ticket: Ticket, reason: str = "cancelled") -> int:
        """Stop every unfinished sequence of ``ticket`` wherever it is; returns how many."""
        gone = [s for s in ticket.seqs if s.id in self._owners]
        for seq in gone:
            seq.cancel(reason)
            self._finish(seq)
        self._waiting = deque(s for s in self._waiting if not s.finished)
        if self._prefill is not None and self._prefill.seq.finished:
            self._prefill = None
        self.batch.compact()
        return len(gone)

    def _admit(self) -> list[Event]:
        """Spend this turn's prefill budget: continue a chunked prompt, then admit short ones."""
        budget, events = self.prefill_chunk, []
        if self._prefill is not None:
            budget -= self._prefill.step()
            if self._prefill.finished:
                done, self._prefill = self._prefill, None
                events += self.batch.join(done.seq, done.entries(), done.logits)
        group: list[Sequence] = []
        free = self.batch.free_rows - (self._prefill is not None)
        while self._waiting and len(group) < free:
            n = len(self._waiting[0].prompt_ids)
            if n > self.prefill_chunk and self._prefill is None:
                self._prefill = ChunkedPrefill(self.engine.backend, self._take(), self.prefill_chunk)
                break  # its first chunk runs next turn, after a decode step
            if n > budget:
                break
            group.append(self._take())
            budget -= n
        return events + self.batch.admit(group)

    def _take(self) -> Sequence:
        seq = self._waiting.popleft()
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        return seq

    def _publish(self, events: list[Event]) -> None:
        now = time.perf_counter()
        for seq, text in events:
            own = self._owners.get(seq.id)
            if own is None:
                continue
            if own.tokens == 0:
                self.metrics.ttft.observe(now - own.ticket.arrival)
            else:
                self.metrics.itl.observe(now - own.last)
            new = seq.logprobs[own.tokens :] if seq.params.logprobs is not None else []
            own.tokens, own.last = len(seq.output_ids), now
            self.metrics.generation_tokens.inc()
            own.ticket.updates.put(Update(own.index, text, new, own.tokens, seq.finish_reason, self.turn))
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
        waiting = {s.id for s in self._waiting}
        tickets = {id(o.ticket): o.ticket for sid, o in self._owners.items() if sid not in waiting}
        self._prefill = None
        self._new_batch()
        for ticket in tickets.values():
            ticket.updates.put(Failure(message))  # before _drop sets ``done``
            self._drop(ticket, "error")

    def _gauges(self) -> None:
        running, waiting = self.counts()
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(waiting)
