"""Arrays the search keeps for later but does not need in memory: on disk, read back one at a time.

At 8B scale what calibration holds beside a candidate's session is what decides whether it fits
(the issue's bound: the quantized artifact + 2 GiB): the judge's reference log-probabilities and
the statistics' sampled rows (0.8 GB) live here instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np


class ArraysOnDisk:
    """Arrays appended to one file and read back one at a time, by index or in order."""

    def __init__(self, path: Path):
        self.path, self._layout, self._end = path, [], 0  # layout: (offset, dtype, shape) per array
        path.write_bytes(b"")

    def append(self, array: np.ndarray) -> None:
        self._layout.append((self._end, array.dtype, array.shape))
        with open(self.path, "ab") as f:
            f.write(np.ascontiguousarray(array).tobytes())
        self._end += array.nbytes

    def __len__(self) -> int:
        return len(self._layout)

    def __getitem__(self, i: int) -> np.ndarray:
        offset, dtype, shape = self._layout[i]
        return np.fromfile(self.path, dtype, int(np.prod(shape)), offset=offset).reshape(shape)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class ArrayMapOnDisk(Mapping):
    """A read-only dict of arrays, written once to one file; each lookup reads its array back."""

    def __init__(self, path: Path, arrays: Mapping[str, np.ndarray]):
        self._arrays, self._index = ArraysOnDisk(path), {}
        for key, array in arrays.items():
            self._index[key] = len(self._arrays)
            self._arrays.append(array)

    def __getitem__(self, key: str) -> np.ndarray:
        return self._arrays[self._index[key]]

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)
