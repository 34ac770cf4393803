"""A checkpoint's tensors read from its files by name, one at a time (what a streamed export reads).

safetensors files are read by their headers, each tensor with a plain read of its bytes;
``pytorch_model.bin`` files are opened with ``torch.load(mmap=True)``, whose tensors are mapped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from llmx.errors import CheckpointError


class CheckpointTensors(Mapping):
    """A checkpoint's tensors by their Hugging Face names, read from disk only when asked for.

    safetensors files are read by their headers, each tensor with a plain read of its bytes
    (``SafetensorsFile``); ``pytorch_model.bin`` files are opened with ``torch.load(mmap=True)``,
    whose tensors are mapped, not read.
    """

    def __init__(self, files: list[Path]):
        self.where: dict[str, object] = {}
        for file in files:
            try:
                if file.suffix == ".safetensors":
                    handle = SafetensorsFile(file)
                    self.where.update(dict.fromkeys(handle.header, handle))
                else:
                    self.where.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
            except Exception as exc:  # corrupt files raise many exception types
                raise CheckpointError(f"cannot read weights from {file.name}: {str(exc).splitlines()[0]}") from exc

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.where[name]
        return source if isinstance(source, torch.Tensor) else source.tensor(name)

    def __contains__(self, name) -> bool:
        return name in self.where

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


class SafetensorsFile:
    """One ``.safetensors`` file: its header (names, dtypes, shapes, offsets) and one tensor per read.

    Each tensor is read into its own buffer rather than viewed in a memory map of the file: the
    pages of a mapping stay in the process's resident set until it is unmapped, so a streamed
    export would end holding the whole checkpoint; a read's buffer goes when its tensor does.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= size - 8:
                raise ValueError(f"header length {length} does not fit a file of {size} bytes")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self.start, self.header = 8 + length, header
        for name, info in header.items():
            begin, end = info["data_offsets"]
            if info["dtype"] not in DTYPES or not 0 <= begin <= end <= size - self.start:
                raise ValueError(f"tensor {name!r}: dtype {info['dtype']} or offsets {begin}-{end} out of range")

    def shape(self, name: str) -> list[int]:
        return self.header[name]["shape"]

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.header[name]["dtype"]]

    def tensor(self, name: str) -> torch.Tensor:
        begin, end = self.header[name]["data_offsets"]
        if begin == end:
            return torch.empty(self.shape(name), dtype=self.dtype(name))
        data = torch.empty(end - begin, dtype=torch.uint8)  # not zero-filled, as a bytearray would be
        with open(self.path, "rb") as f:
            f.seek(self.start + begin)
            if f.readinto(data.numpy()) != end - begin:
                raise CheckpointError(f"cannot read weights from {self.path.name}: {name!r} is truncated")
        return data.view(self.dtype(name)).reshape(self.shape(name))


DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
