"""Streaming a checkpoint's weights into an artifact's weights.bin, one tensor at a time.

    model.safetensors (memory-mapped) --tensor--> rules (export/checkpoint.py) --> fp32 | w8 | w4 --> weights.bin
                                                  q|k|v, gate|up concatenated        (quantize_blocks)

The checkpoint is never loaded: safetensors files are memory-mapped and each llmx weight is
made from its source tensors only when its turn comes (``iter_weights``), converted, written
and dropped, so what is in memory is one combined weight (a layer's q|k|v, or the embedding
table) and not the model. What comes back is the ONNX side: an external-data TensorProto per
weight (name, dtype, dims, offset and length in weights.bin), which the fused graph builder
reads through the ``WeightSource`` protocol (llmx/fused/weights.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from llmx.artifact.onnx_files import WeightsFile, external_reference
from llmx.errors import CheckpointError
from llmx.export.checkpoint import iter_weights
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

    safetensors files are memory-mapped (``safe_open``); ``pytorch_model.bin`` files are
    opened with ``torch.load(mmap=True)``, whose tensors are mapped, not read, as well.
    """

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self.where: dict[str, object] = {}
        for file in files:
            try:
                if file.suffix == ".safetensors":
                    handle = safe_open(str(file), framework="pt")
                    self.where.update(dict.fromkeys(handle.keys(), handle))
                else:
                    self.where.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
            except Exception as exc:  # corrupt files raise many exception types
                raise CheckpointError(f"cannot read weights from {file.name}: {str(exc).splitlines()[0]}") from exc

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.where[name]
        return source if isinstance(source, torch.Tensor) else source.get_tensor(name)

    def __contains__(self, name) -> bool:
        return name in self.where

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


@dataclass
class StreamedWeights:
    """The weights a streamed export wrote, as the fused graph builder reads them (a WeightSource).

    Every weight is stored under its own name, so the anchored look-ups ``SourceWeights`` needs
    for an exported graph (merged initializers) are plain look-ups here.
    """

    root: Path
    tensors: dict[str, onnx.TensorProto] = field(default_factory=dict)  # graph name -> external fp32 tensor
    quantized: dict[str, NBitsWeight] = field(default_factory=dict)  # graph name -> its MatMulNBits tensors
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


def stream_weights(spec: ModelSpec, files: list[Path], out_dir: Path,
                   quantization: Quantization | None = None) -> StreamedWeights:
    """Write every weight of ``spec`` from checkpoint ``files`` to ``out_dir``/weights.bin, one at a time.

    With ``quantization`` the MatMul weights are stored as MatMulNBits blocks instead of fp32;
    their fp32 entry in ``tensors`` then describes the weight (name, dims) without data, for the
    graph builder to wire the MatMul that ``replace_matmuls`` swaps afterwards.
    """
    out = StreamedWeights(Path(out_dir))
    with WeightsFile(out_dir) as data:
        for role, name, tensor in iter_weights(spec, CheckpointTensors(files)):
            name, array = graph_name(name), tensor.detach().numpy()
            out.tensors[name] = _described(name, array)
            if quantization is None or role not in MATMUL_ROLES:
                out.bytes_written += _store(data, out.tensors[name], array)
                continue
            blocks = quantize_blocks(array, quantization.bits, quantization.block_size, quantization.symmetric)
            stored = []
            for tensor_name, values in blocks.arrays(name):
                stored.append(_described(tensor_name, values))
                out.bytes_written += _store(data, stored[-1], values)
            out.quantized[name] = NBitsWeight(blocks.bits, blocks.block_size, array.shape[0], blocks.n, stored)
    return out


def _described(name: str, array: np.ndarray) -> onnx.TensorProto:
    proto = onnx.TensorProto()
    proto.name, proto.data_type = name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    proto.dims.extend(array.shape)
    return proto


def _store(data: WeightsFile, proto: onnx.TensorProto, array: np.ndarray) -> int:
    """Put ``array``'s bytes in ``proto``: inline if small, else appended to weights.bin; returns bytes written."""
    raw = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    if len(raw) <= data.inline_limit:
        proto.raw_data = bytes(raw)
        return 0
    external_reference(proto, *data.append(raw))
    return len(raw)
