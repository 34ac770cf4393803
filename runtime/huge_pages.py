"""Back a session's packed weights with 2 MiB pages (Linux transparent huge pages).

Every decode step reads every weight once, hundreds of MB through 4 KiB pages: one TLB entry per
4 KiB. ONNX Runtime packs the weights into anonymous memory at session load, and on the usual
``transparent_hugepage=madvise`` setting nothing asks the kernel for huge pages there. After a
session loads, the anonymous memory it added is marked ``MADV_HUGEPAGE`` and collapsed into
2 MiB pages at once with ``MADV_COLLAPSE`` (Linux 6.1+). Measured on the SmolLM-135M shape, 2
threads (docs/performance.md): decode +2-4 % fp32, +4-5 % w8, 0-2 % w4; load +1 s per ~450 MB
collapsed (fp32 135M), ~0.03-0.3 s for its quantized artifacts; PSS unchanged.

Only memory that appeared while the session loaded is touched, never the host program's. Where
the kernel cannot (older kernels, THP ``never``, other systems) nothing changes. ``LLMX_HUGE_PAGES=0``
turns it off.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import sys
from contextlib import contextmanager
from typing import Iterator

from llmx.runtime.cpu_plan import env_switch

log = logging.getLogger(__name__)

HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

Spans = list[tuple[int, int]]


def enabled(env: dict[str, str] | None = None) -> bool:
    return env_switch(os.environ if env is None else env, "LLMX_HUGE_PAGES") is not False and sys.platform == "linux"


def anonymous_spans(maps: str) -> Spans:
    """Writable private anonymous mappings (and the brk heap) in the text of /proc/<pid>/maps."""
    spans = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        name = fields[5] if len(fields) > 5 else ""
        if name and name != "[heap]":
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        spans.append((start, end))
    return spans


def added(before: Spans, after: Spans) -> Spans:
    """The parts of ``after`` covered by no span of ``before`` (mappings merge and grow, so a span
    that was there before may come back longer). Spans of one reading never overlap."""
    before = sorted(before)
    starts = [s for s, _ in before]
    out = []
    for start, end in after:
        i, cur = max(bisect.bisect_right(starts, start) - 1, 0), start
        while i < len(before) and before[i][0] < end:
            b_start, b_end = before[i]
            if b_end > cur:
                if b_start > cur:
                    out.append((cur, b_start))
                cur = b_end
            i += 1
        if cur < end:
            out.append((cur, end))
    return out


def whole_pages(spans: Spans) -> Spans:
    """Each span shrunk to the 2 MiB pages it holds entirely."""
    aligned = [(-(-s // HUGE) * HUGE, e // HUGE * HUGE) for s, e in spans]
    return [(s, e) for s, e in aligned if e > s]


def _maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def collapse(spans: Spans) -> int:
    """Ask for huge pages on ``spans`` and collapse them now; the bytes that collapsed."""
    madvise, done = _madvise(), 0
    for start, end in whole_pages(spans):
        madvise(start, end - start, MADV_HUGEPAGE)
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
    return done


@contextmanager
def backing(active: bool = True) -> Iterator[None]:
    """Collapse the anonymous memory added inside the block (a session's packed weights)."""
    if not active:
        yield
        return
    try:
        before = anonymous_spans(_maps())
    except OSError:
        before = None
    yield
    if before is None:
        return
    try:
        done = collapse(added(before, anonymous_spans(_maps())))
    except (OSError, AttributeError) as exc:  # no /proc, no madvise: nothing to gain, nothing lost
        log.debug("huge pages unavailable: %s", exc)
        return
    log.debug("collapsed %d MiB of new session memory into huge pages", done >> 20)
