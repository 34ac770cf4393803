"""Streaming a checkpoint's weights into an artifact's weights.bin, one tensor at a time.

    model.safetensors (memory-mapped) --tensor--> rules (export/checkpoint.py) --> fp32 | w8 | w4 --> weights.bin
                                                  q|k|v, gate|up concatenated        (quantize_blocks)

The checkpoint is never loaded: safetensors files are read by their headers, a tensor at a time,
and each llmx weight is made from its source tensors only when its turn comes (``iter_weights``), converted, written
and dropped, so what is in memory is one combined weight (a layer's q|k|v, or the embedding
table) and not the model. What comes back is the ONNX side: an external-data TensorProto per
weight (name, dtype, dims, offset and length in weights.bin), which the fused graph builder
reads through the ``WeightSource`` protocol (llmx/fused/weights.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from llmx.artifact.onnx_files import WeightsFile, external_reference
from llmx.errors import CheckpointError
from llmx.export.checkpoint import iter_weights, parameters_on_meta
from llmx.export.modules import Decoder
from llmx.quant_blocks import NBitsWeight, quantize_blocks
from llmx.spec import ModelSpec
from llmx.weight_names import graph_name

# The weights the fused graphs multiply with a plain MatMul: the ones w8/w4 quantize (the
# graphs' other weights are lookups, norms, biases and the MoE op's expert tensors).
MATMUL_ROLES = ("qkv", "o", "up", "down", "lm_head", "router")


@dataclass(frozen=True)
class Quantization:
    """How ``--precision w8|w4`` stores MatMul weights: calibrate --no-search's blocks."""

    bits: int
    block_size: int
    symmetric: bool = True


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


@dataclass
class StreamedWeights:
    """The weights a streamed export wrote, as the fused graph builder reads them (a WeightSource).

    Every weight is stored under its own name, so the anchored look-ups ``SourceWeights`` needs
    for an exported graph (merged initializers) are plain look-ups here.
    """

    root: Path
    tensors: dict[str, onnx.TensorProto] = field(default_factory=dict)  # graph name -> external fp32 tensor
    quantized: dict[str, NBitsWeight] = field(default_factory=dict)  # graph name -> its MatMulNBits tensors
    lowered: dict[str, onnx.TensorProto] = field(default_factory=dict)  # graph name -> stored fp16/bf16 tensor
    bytes_written: int = 0

    def get(self, name: str) -> onnx.TensorProto:
        if name not in self.tensors:
            raise CheckpointError(f"internal error: the streamed weights have no {name!r}")
        return self.tensors[name]

    def array(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self.get(name), base_dir=str(self.root))

    def norm_before(self, matmul_weight: str, name: str, index: int = 0) -> onnx.TensorProto:
        return self.get(name)

    def bias_after(self, matmul_weight: str, name: str) -> onnx.TensorProto | None:
        return self.tensors.get(name)


def stream_weights(spec: ModelSpec, files: list[Path], out_dir: Path, quantization: Quantization | None = None,
                   low_dtype: str | None = None) -> StreamedWeights:
    """Write every weight of ``spec`` from checkpoint ``files`` to ``out_dir``/weights.bin, one at a time.

    With ``quantization`` the MatMul weights are stored as MatMulNBits blocks instead of fp32;
    their fp32 entry in ``tensors`` then describes the weight (name, dims) without data, for the
    graph builder to wire the MatMul that ``replace_matmuls`` swaps afterwards. With ``low_dtype``
    (float16 | bfloat16) every weight of rank >= 2 is stored in that dtype, rounded as
    llmx/low_precision.py rounds a graph's weights (``lowered``), and its fp32 entry in
    ``tensors`` likewise describes it without data.
    """
    if quantization is not None and low_dtype is not None:
        raise ValueError("weights are either quantized or lowered, not both")
    out = StreamedWeights(Path(out_dir))
    shapes = declared_shapes(spec)
    with WeightsFile(out_dir, background=True) as data:
        for role, name, tensor in iter_weights(spec, CheckpointTensors(files)):
            if tuple(tensor.shape) != shapes[name]:
                raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, but config.json implies {shapes[name]}")
            _write_weight(out, data, role, graph_name(name), tensor, quantization, low_dtype)
            # Dropped before the generator makes the next weight: an 8B model's embedding (2.1 GB
            # in fp32) would otherwise still be held while its 128256-row head is made.
            del tensor
    return out


def _write_weight(out: StreamedWeights, data: WeightsFile, role: str, name: str, tensor: torch.Tensor,
                  quantization: Quantization | None, low_dtype: str | None) -> None:
    if low_dtype is not None and tensor.dim() >= 2:
        out.tensors[name] = _described(name, np.empty(0, np.float32), tensor.shape)
        low = to_low_dtype(tensor, low_dtype)
        out.lowered[name] = _described(name, low)
        out.bytes_written += _store(data, out.lowered[name], low)
        return
    array = tensor.detach().numpy()
    out.tensors[name] = _described(name, array)
    if quantization is None or role not in MATMUL_ROLES:
        out.bytes_written += _store(data, out.tensors[name], array)
        return
    blocks = quantize_blocks(array, quantization.bits, quantization.block_size, quantization.symmetric)
    stored = []
    for tensor_name, values in blocks.arrays(name):
        stored.append(_described(tensor_name, values))
        out.bytes_written += _store(data, stored[-1], values)
    out.quantized[name] = NBitsWeight(blocks.bits, blocks.block_size, array.shape[0], blocks.n, stored)


def declared_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """llmx weight name -> the shape ``spec`` gives it: the decoder's parameters, built on the meta device."""
    with parameters_on_meta():
        model = Decoder(spec)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


_LOWER_BLOCK = 1 << 24  # elements lowered per step (64 MiB of fp32)


def to_low_dtype(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """An fp32 weight in float16 or bfloat16, clamped to the dtype's finite range first (as
    llmx/low_precision.py lowers a graph's weights: a value past fp16's 65504 becomes the largest
    finite one, not inf); round to nearest even, as numpy's and ml_dtypes' casts do."""
    import ml_dtypes  # an onnx dependency; numpy has no bfloat16

    low = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    limit = float(ml_dtypes.finfo(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16).max)
    lowered = torch.empty(tensor.shape, dtype=low)
    # A row block at a time: the clamped fp32 copy of a whole 2 GB table would sit beside it.
    step = max(1, _LOWER_BLOCK // max(1, tensor[0].numel()))
    for start in range(0, tensor.shape[0], step):
        lowered[start:start + step] = tensor[start:start + step].clamp(-limit, limit).to(low)
    if dtype == "float16":
        return lowered.numpy()
    return lowered.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def _described(name: str, array: np.ndarray, shape: tuple[int, ...] | None = None) -> onnx.TensorProto:
    proto = onnx.TensorProto()
    proto.name, proto.data_type = name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    proto.dims.extend(array.shape if shape is None else shape)
    return proto


def _store(data: WeightsFile, proto: onnx.TensorProto, array: np.ndarray) -> int:
    """Put ``array``'s bytes in ``proto``: inline if small, else appended to weights.bin; returns bytes written."""
    raw = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    if len(raw) <= data.inline_limit:
        proto.raw_data = bytes(raw)
        return 0
    external_reference(proto, *data.append(raw))
    return len(raw)
