"""Streaming a checkpoint's weights into an artifact's weights.bin, one tensor at a time.

    model.safetensors --tensor--> rules (export/checkpoint.py) --> fp32 | w8 | w4 | fp16 --> weights.bin
    (export/tensors.py)           q|k|v, gate|up concatenated        (quantize_blocks)
    a GGUF (export/gguf.py) -------------------------------------> the file's own blocks

The checkpoint is never loaded: safetensors files are read by their headers, a tensor at a time,
and each llmx weight is made from its source tensors only when its turn comes (``iter_weights``), converted, written
and dropped, so what is in memory is one combined weight (a layer's q|k|v, or the embedding
table) and not the model. What comes back is the ONNX side: an external-data TensorProto per
weight (name, dtype, dims, offset and length in weights.bin), which the fused graph builder
reads through the ``WeightSource`` protocol (llmx/fused/weights.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
from llmx.compact_blocks import MARK, Rebuilt, compact_arrays
from llmx.quant_blocks import Blocks, NBitsWeight, StackedBlocks, quantize_blocks
from llmx.spec import ModelSpec
from llmx.weight_names import graph_name, model_weights

# The weights the fused graphs multiply with a plain MatMul: the ones w8/w4 quantize (the
# graphs' other weights are lookups, norms, biases and the MoE op's expert tensors).
MATMUL_ROLES = ("qkv", "o", "up", "down", "lm_head", "router")


@dataclass(frozen=True)
class Quantization:
    """How ``--precision w8|w4`` stores MatMul weights: calibrate --no-search's blocks."""

    bits: int
    block_size: int
    symmetric: bool = True


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
    gathered: dict[str, NBitsWeight] = field(default_factory=dict)  # a table looked up from its blocks (llmx/fused/embedding.py)
    # Block tensors stored in fewer bits (llmx/compact_blocks.py): name -> (stored tensors, the
    # nodes rebuilding it), for ``expand_in_graph``; and the bytes they add back when loaded.
    rebuilt: dict[str, tuple[list[onnx.TensorProto], list]] = field(default_factory=dict)
    rebuilt_load_bytes: int = 0
    # A tied table is not written: the lookup reads the head's weight, fp32 or its blocks
    # (``gathered``), and multiplies by the embedding's factor (llmx/fused/embedding.py).
    lookup_from_head: bool = False
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


def stream_weights(spec: ModelSpec, tensors: Mapping[str, torch.Tensor], out_dir: Path,
                   quantization: Quantization | None = None, low_dtype: str | None = None,
                   stored: Callable[[list[str]], Blocks | None] | None = None,
                   lookup_from_head: bool = False) -> StreamedWeights:
    """Write every weight of ``spec`` from a checkpoint's ``tensors`` (by HF name, read lazily:
    ``Checkpoint.tensors()``) to ``out_dir``/weights.bin, one at a time.

    With ``quantization`` the MatMul weights are stored as MatMulNBits blocks instead of fp32;
    their fp32 entry in ``tensors`` then describes the weight (name, dims) without data, for the
    graph builder to wire the MatMul that ``replace_matmuls`` swaps afterwards. With ``low_dtype``
    (float16 | bfloat16) every weight of rank >= 2 is stored in that dtype, rounded as
    llmx/low_precision.py rounds a graph's weights (``lowered``), and its fp32 entry in
    ``tensors`` likewise describes it without data. ``stored`` (``Checkpoint.stored_blocks``: a
    GGUF's or a GPTQ/AWQ checkpoint's own blocks, see ``iter_weights``): MatMul weights the source
    keeps quantized are written as those blocks. ``lookup_from_head`` (graphs whose lookup can
    read the head, llmx/fused/embedding.py): a tied table is written once, as the head (fp32, or
    the head's w8/w4 blocks, which the lookup then dequantizes as the GGUF path does).
    """
    if quantization is not None and low_dtype is not None:
        raise ValueError("weights are either quantized or lowered, not both")
    out = StreamedWeights(Path(out_dir))
    shapes = declared_shapes(spec)
    # The blocks last written and their stored tensors: a tied head made from the same blocks as
    # the (quantized) embedding shares them, as the checkpoint does.
    shared: tuple[Blocks, NBitsWeight] | None = None
    head_holds_table = lookup_from_head and _head_holds_table(spec, quantization, low_dtype)
    table: str | None = None  # the tied table's name, once the head holds it
    with WeightsFile(out_dir, background=True) as data:
        for role, name, tensor in iter_weights(spec, tensors, stored):
            if isinstance(tensor, (Blocks, StackedBlocks)):
                if role == "lm_head" and out.lookup_from_head:
                    raise CheckpointError("internal error: a tied head came as blocks, its table as floats")
                written = shared[1] if shared is not None and shared[0] is tensor else None
                shared = tensor, _write_blocks(out, data, role, graph_name(name), tensor, shapes[name], written)
                del tensor
                continue
            if tuple(tensor.shape) != shapes[name]:
                raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, but config.json implies {shapes[name]}")
            name = graph_name(name)
            if role == "embed" and head_holds_table:
                table = name
                out.tensors[table] = _described(table, np.empty(0, np.float32), tensor.shape)
                out.lookup_from_head = True
                del tensor
                continue
            _write_weight(out, data, role, name, tensor, quantization, low_dtype)
            if role == "lm_head" and table is not None and name in out.quantized:
                out.gathered[table] = out.quantized[name]
            # Dropped before the generator makes the next weight: an 8B model's embedding (2.1 GB
            # in fp32) would otherwise still be held while its 128256-row head is made.
            del tensor
    return out


def _head_holds_table(spec: ModelSpec, quantization: Quantization | None, low_dtype: str | None) -> bool:
    """Whether a tied model's head [hidden, vocab] holds the table, transposed: no factor is folded
    into the head (the embedding's own factor is a multiply after the lookup). A w8/w4 head holds
    it in symmetric blocks, which the lookup dequantizes (llama.cpp and onnxruntime-genai quantize
    a tied table with the head too); portable graphs in fp16/bf16 keep their own table."""
    return (spec.tie_word_embeddings and "lm_head" in model_weights(spec) and spec.logits_scale == 1.0
            and (quantization is None or quantization.symmetric) and low_dtype is None)


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
    _write_blocks(out, data, role, name, quantize_blocks(array, quantization.bits, quantization.block_size,
                                                         quantization.symmetric), array.shape)


def _write_blocks(out: StreamedWeights, data: WeightsFile, role: str, name: str, blocks: Blocks | StackedBlocks,
                  shape: tuple[int, ...], stored: NBitsWeight | None = None) -> NBitsWeight:
    """A MatMul weight [K, N] (or the embedding table [N, K]) as MatMulNBits blocks; its fp32
    entry describes it without data. ``stored``: the same blocks, already written."""
    n, k = shape if role == "embed" else shape[::-1]
    width = blocks.parts[0] if isinstance(blocks, StackedBlocks) else blocks
    if blocks.n != n or width.packed.shape[1] * width.block_size != k:
        raise CheckpointError(f"tensor {name} is stored as {blocks.n} rows of {width.packed.shape[1] * width.block_size} "
                              f"inputs, but the config implies {n} of {k}")
    out.tensors[name] = _described(name, np.empty(0, np.float32), shape)
    if stored is None:
        stored = _stored_blocks(out, data, name, blocks, k)
    (out.gathered if role == "embed" else out.quantized)[name] = stored
    return stored


def _stored_blocks(out: StreamedWeights, data: WeightsFile, name: str, blocks: Blocks | StackedBlocks,
                   k: int) -> NBitsWeight:
    if isinstance(blocks, StackedBlocks):
        parts = [_stored_blocks(out, data, f"{name}_part{j}", part, k) for j, part in enumerate(blocks.parts)]
        return NBitsWeight(0, 0, k, blocks.n, [], parts=parts)
    stored = []
    for item in compact_arrays(blocks, name):
        if isinstance(item, Rebuilt):
            parts = [_described(part, values) for part, values in item.stored]
            for proto, (_, values) in zip(parts, item.stored):
                out.bytes_written += _store(data, proto, values)
            out.rebuilt[item.name] = parts, item.nodes
            out.rebuilt_load_bytes += item.rebuilt_bytes - item.stored_bytes
            stored.append(_described(item.name, np.empty(0, item.dtype), item.shape))
            stored[-1].doc_string = MARK  # a placeholder: ``expand_in_graph`` swaps it for the parts
            continue
        tensor_name, values = item
        stored.append(_described(tensor_name, values))
        out.bytes_written += _store(data, stored[-1], values)
    return NBitsWeight.of(blocks, k, stored)


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
