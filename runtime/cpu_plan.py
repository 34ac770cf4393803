"""How many ONNX Runtime threads to run, and whether they spin, from the cores actually free.

Measured (docs/performance.md, "Threads and spinning"): on a quiet 2-core host, two intra-op
threads that spin decode 1.2-1.5x faster than two that sleep between operators (≈150 parallel
sections per decode step, each woken through a condition variable otherwise), and match
onnxruntime-genai configured with two threads. With a neighbour burning one core, two spinning
threads are 2-3x slower than one thread: a spinning worker that the OS deschedules stalls every
operator. So the plan is taken from the cores that are free when the backend loads:

- threads = the idle time of the cores this process may run on (``os.sched_getaffinity``, physical
  cores at most) over a short /proc/stat sample, in whole cores, at least 1;
- spin = on when that gives two or more threads, i.e. when there is a free core for each. With
  ``session.force_spinning_stop`` the workers spin only while a graph runs and sleep as soon as
  it returns, so an idle server burns nothing.

``--threads``/``--spin``/``--no-spin`` (or LLMX_THREADS, LLMX_SPIN=0|1) override either half; an
explicit thread count above the free cores gets no spinning unless asked for.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmx.errors import InputError

SAMPLE_S = 0.2  # long enough for a few scheduler ticks (10 ms each at HZ=100), short next to loading
FREE_MARGIN = 0.25


@dataclass(frozen=True)
class CpuPlan:
    threads: int
    spin: bool
    usable_cores: int
    free_cores: float | None  # idle cores over the sample (None: no /proc/stat)
    source: str  # why: "free cores", "--threads", "LLMX_THREADS", ...

    def describe(self) -> str:
        free = "unknown" if self.free_cores is None else f"{self.free_cores:.1f}"
        return (f"{self.threads} thread{'s' if self.threads > 1 else ''}, spinning {'on' if self.spin else 'off'} "
                f"({self.source}; {self.usable_cores} usable cores, {free} free)")


def cpu_times(stat: str) -> dict[int, tuple[int, int]]:
    """Per CPU number: (idle jiffies incl. iowait, total jiffies), from the text of /proc/stat."""
    times = {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            times[int(name[3:])] = (values[3] + values[4], sum(values))
    return times


def idle_per_cpu(before: str, after: str, cpus: set[int]) -> dict[int, float]:
    """Each CPU's idle fraction between two /proc/stat readings (CPUs with no ticks count as idle)."""
    a, b = cpu_times(before), cpu_times(after)
    idle = {}
    for cpu in cpus:
        if cpu in a and cpu in b:
            total = b[cpu][1] - a[cpu][1]
            idle[cpu] = (b[cpu][0] - a[cpu][0]) / total if total > 0 else 1.0
    return idle


def read_stat() -> str:
    return Path("/proc/stat").read_text()


def sample_idle(cpus: set[int], interval: float = SAMPLE_S, read: Callable[[], str] = read_stat,
                sleep: Callable[[float], None] = time.sleep) -> dict[int, float] | None:
    try:
        before = read()
        sleep(interval)
        return idle_per_cpu(before, read(), cpus) or None
    except OSError:
        return None


def usable_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def _env_threads(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise InputError(f"LLMX_THREADS must be a whole number of threads, at least 1, got {value!r}")
    return int(value)


def env_switch(env, name: str) -> bool | None:
    """An LLMX_* on/off variable: None when unset, else "1" or "0" (anything else is refused)."""
    if name not in env:
        return None
    if env[name] not in ("0", "1"):
        raise InputError(f"{name} must be 0 or 1, got {env[name]!r}")
    return env[name] == "1"


def plan_threads(threads: int | None = None, spin: bool | None = None, cpus: set[int] | None = None,
                 idle: dict[int, float] | None = None, physical: int | None = None,
                 env: dict[str, str] | None = None) -> CpuPlan:
    """The plan for explicit choices (None: decide); ``idle`` is per-CPU idle fractions, None to sample."""
    env = os.environ if env is None else env
    cpus = usable_cpus() if cpus is None else cpus
    usable = max(1, min(len(cpus), physical or physical_cores()))
    source = "--threads"
    if threads is None and env.get("LLMX_THREADS"):
        threads, source = _env_threads(env["LLMX_THREADS"]), "LLMX_THREADS"
    if spin is None and env.get("LLMX_SPIN"):
        spin = env_switch(env, "LLMX_SPIN")
    if idle is None and (threads is None or spin is None):
        idle = sample_idle(cpus)
    free_cores = None if idle is None else sum(idle.values())
    # Summed idle time, not idle CPUs: a neighbour that the scheduler moves between cores leaves two
    # half-idle cores, which are one free core. The margin rounds 1.8 idle cores up to 2, 1.6 down.
    free = usable if idle is None else min(usable, int(free_cores + FREE_MARGIN))
    if threads is None:
        threads, source = max(1, free), "free cores" if idle is not None else "usable cores (no /proc/stat)"
    if spin is None:
        spin = 1 < threads <= free
    return CpuPlan(threads, spin, usable, free_cores, source)
