"""Where a command's memory goes: `llmx` run in-process, its RSS sampled every 0.1 s with the stack.

    python benchmarks/memory_trace.py calibrate ART --data CALIB --scheme w4 -o OUT [llmx's own flags]

Prints to stderr, as the run goes:
- each new RSS high (every 0.1 GiB) with the main thread's innermost frames, so a peak is named
  by the code that made it, not guessed from coarse samples;
- before each ONNX Runtime session the calibration search or judge creates, the RSS and the
  allocation sites holding the most numpy/Python memory (tracemalloc, 4 frames deep);
- the kernel's peak (getrusage) at exit.

tracemalloc slows Python-heavy code; numpy-heavy code much less. This found the 8B w4 calibration's
real peak (issue 34: the LM head's importance rounding, not a candidate's session; docs/quantization.md).
Run a big model's shorter stack first (`big_export.py --layers 4`).
"""

from __future__ import annotations

import atexit
import os
import resource
import sys
import threading
import time
import tracemalloc

STEP_GIB = 0.1
T0 = time.time()


def status() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, GiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon", "RssFile", "VmHWM")):
                found[line.split(":")[0]] = round(int(line.split()[1]) / 2**20, 2)
    return found


def log(message: str) -> None:
    print(f"[mem {time.time() - T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def watch(main_id: int) -> None:
    peak = 0.0
    while True:
        now = status()
        if now["VmRSS"] > peak + STEP_GIB:
            peak = now["VmRSS"]
            frame, where = sys._current_frames().get(main_id), []
            while frame is not None and len(where) < 5:  # innermost first, no source lookups
                where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                frame = frame.f_back
            log(f"high {now} " + " < ".join(where))
        time.sleep(0.1)


def held_by_site(tag: str, top: int = 6) -> None:
    log(f"{tag}: {status()} traced {tracemalloc.get_traced_memory()[0] / 2**30:.2f} GiB")
    for stat in tracemalloc.take_snapshot().statistics("traceback")[:top]:
        where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in list(stat.traceback)[::-1])
        log(f"   {stat.size / 2**20:8.1f} MiB {stat.count:6d}  {where}")


def main() -> None:
    tracemalloc.start(4)
    threading.Thread(target=watch, args=(threading.main_thread().ident,), daemon=True).start()
    from llmx.calibration import judge, search

    make_session = judge.session

    def traced(model, threads):
        held_by_site(f"before a session of {getattr(model, 'name', 'an in-memory graph')}")
        made = make_session(model, threads)
        log(f"after it {status()}")
        return made

    judge.session = search.session = traced  # search imported the name: patch both
    atexit.register(lambda: log(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.3f} GiB"))
    from llmx.cli import main as llmx

    sys.argv = ["llmx", *sys.argv[1:]]
    llmx()


if __name__ == "__main__":
    main()
