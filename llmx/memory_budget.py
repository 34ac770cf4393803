"""Will a stage fit? The memory and disk it needs against what this machine has, checked before
the stage starts, so a model too big for the box ends in one line with numbers instead of the
kernel's OOM killer (the user sees only ``Killed``) or a full disk an hour in."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from llmx.errors import LlmxError

GiB = 1 << 30


class ResourceError(LlmxError):
    """The stage would need more memory or disk than this machine has free."""


@dataclass(frozen=True)
class Need:
    memory: int  # bytes held at the peak, beyond what the process holds already
    disk: int  # bytes written at the output


def available_memory() -> int:
    """Bytes a new allocation can get: /proc/meminfo's MemAvailable, or less under a cgroup limit."""
    available = _meminfo_available()
    for limit, usage in (("memory.max", "memory.current"),  # cgroup v2
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        headroom = _cgroup_headroom(Path("/sys/fs/cgroup") / limit, Path("/sys/fs/cgroup") / usage)
        if headroom is not None:
            available = min(available, headroom)
    return available


def free_disk(path: str | Path) -> int:
    """Free bytes on the filesystem ``path`` is (or would be) written to."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_fits(stage: str, need: Need, out: str | Path, alternatives: list[tuple[str, Need]] = (),
               hint: str | None = None) -> None:
    """Raise ResourceError, naming the first of ``alternatives`` (flags, their need) that would
    fit, or else ``hint``, if ``need`` exceeds the available memory or the free disk at ``out``."""
    memory, disk = available_memory(), free_disk(out)
    if need.memory <= memory and need.disk <= disk:
        return
    short = []
    if need.memory > memory:
        short.append(f"about {gib(need.memory)} of memory, {gib(memory)} available")
    if need.disk > disk:
        short.append(f"about {gib(need.disk)} of disk at {out}, {gib(disk)} free")
    fits = next(((flags, n) for flags, n in alternatives if n.memory <= memory and n.disk <= disk), None)
    if fits:
        hint = f"{fits[0]} would fit (about {gib(fits[1].memory)} of memory, {gib(fits[1].disk)} of disk)"
    raise ResourceError(f"{stage} needs {' and '.join(short)}; "
                        f"{hint or 'no option of this command fits: free memory or disk, or use a bigger machine'}")


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def _cgroup_headroom(limit: Path, usage: Path) -> int | None:
    try:
        text = limit.read_text().strip()
        if text == "max" or int(text) >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, int(text) - int(usage.read_text().strip()))
    except (OSError, ValueError):
        return None
