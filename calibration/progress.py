"""How calibration reports progress: ``progress(description, total)`` gives a context manager
whose value has ``.update(n)``; the CLI passes tqdm, library callers get ``silent``."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int], object]


class _Silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass


def silent(description: str, total: int) -> _Silent:
    return _Silent()
