"""What an export will hold and write, estimated from the checkpoint's headers before it starts.

The estimate runs the same weight rules as the export (``iter_weights``) on the header's shapes
(``_Shape``): the shapes of every llmx weight, combined and transposed, at no cost. Streamed (--graphs fused):
the largest weight in flight (its fp32 sources and the fp32 result, plus its blocks when
quantized) and the constants the graphs carry (RoPE tables, the MoE op's expert copies).
Portable decoders stream too (traced on fake weights): the largest weight in flight plus the
exporter's ~1 GiB. What loads the fp32 model (``--verify``, encoders): 1.65x of it at the
measured peak (docs/export.md) plus the exporter's ~1 GiB.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmx.export.checkpoint import Checkpoint, iter_weights
from llmx.export.streaming import MATMUL_ROLES
from llmx.export.tensors import CheckpointTensors
from llmx.memory_budget import GiB, Need, check_fits
from llmx.quant_blocks import BITS

LOW_BYTES = {"fp16": 2, "bf16": 2}
PORTABLE_PEAK = 1.65  # x the fp32 weights: measured, docs/export.md
EXPORTER_OVERHEAD = 1 * GiB


def check_export_fits(checkpoint: Checkpoint, out: str | Path, graphs: str, precision: str, block_size: int,
                      verify: bool = False) -> None:
    """Refuse an export that would not fit in memory or on disk, naming the flags that would."""
    shapes = weight_shapes(checkpoint)
    if shapes is None:
        return
    need = export_need(checkpoint, shapes, graphs, precision, block_size, verify)
    options = [("fused", "--graphs fused", "fp32"), ("portable", "--precision fp16", "fp16"),
               ("fused", "--graphs fused --precision w8", "w8"), ("fused", "--precision w4", "w4")]
    alternatives = [(flags, export_need(checkpoint, shapes, kind, p, block_size)) for kind, flags, p in options
                    if (graphs, precision) != (kind, p)]
    check_fits(f"exporting {checkpoint.path.name} ({graphs}, {precision})", need, out, alternatives)


def export_need(checkpoint: Checkpoint, shapes: list[tuple[str, int, int]], graphs: str, precision: str,
                block_size: int, verify: bool = False) -> Need:
    """``shapes``: (role, elements, source bytes) of every llmx weight."""
    spec = checkpoint.spec
    fp32 = sum(4 * n for _, n, _ in shapes)
    if graphs == "portable" and (verify or spec.kind == "encoder"):  # the fp32 model is loaded
        return Need(int(PORTABLE_PEAK * fp32) + EXPORTER_OVERHEAD, fp32)
    if graphs == "portable":  # streamed weights, traced on fake ones
        width = LOW_BYTES.get(precision, 4)  # fp16/bf16: the fp32 weight and its lowered copy in flight
        disk = sum((width if _is_matrix(role) else 4) * n for role, n, _ in shapes)
        in_flight = max(source + 4 * n + (width * n if width != 4 else 0) for _, n, source in shapes)
        return Need(in_flight + EXPORTER_OVERHEAD, disk)
    bits = BITS.get(precision)

    def stored(role: str, n: int) -> int:
        if bits is None or role not in MATMUL_ROLES:
            return 4 * n
        return n * bits // 8 + 4 * (n // block_size) + n // block_size  # blocks, scales, (zero points)

    in_flight = max(source + 4 * n + stored(role, n) for role, n, source in shapes)
    rope = 4 * 4 * spec.max_position_embeddings * spec.head_dim  # cos, sin (and LongRoPE's second set), two graphs
    experts = sum(4 * n for role, n, _ in shapes if role.startswith("experts_"))  # the MoE op's re-laid copies
    return Need(in_flight + rope + experts, sum(stored(role, n) for role, n, _ in shapes) + rope + experts)


def _is_matrix(role: str) -> bool:
    # Lowered exports store weights of rank >= 2 in 16 bits; norms and biases (mostly rank 1) stay fp32.
    return not role.endswith(("norm", "bias"))


def weight_shapes(checkpoint: Checkpoint) -> list[tuple[str, int, int]] | None:
    """(role, elements, bytes of its source tensors) per llmx weight, from the headers only; None
    when the weights are not safetensors (their shapes cost a read)."""
    if checkpoint.reader is not None or any(f.suffix != ".safetensors" for f in checkpoint.weight_files):
        return None  # a GGUF streams one tensor at a time; .bin files cost a read to size
    tensors = _MetaTensors(checkpoint.weight_files)
    shapes = []
    for role, _, tensor in iter_weights(checkpoint.spec, tensors):
        shapes.append((role, tensor.numel(), tensors.read_since()))
    return shapes


class _MetaTensors(CheckpointTensors):
    """A checkpoint's tensors as ``_Shape``s of their header shapes, counting the bytes asked for."""

    read = 0

    def __getitem__(self, name: str) -> "_Shape":
        file = self.where[name]
        shape = _Shape(file.shape(name))
        self.read += shape.numel() * file.dtype(name).itemsize
        return shape

    def read_since(self) -> int:
        read, self.read = self.read, 0
        return read


class _Shape:
    """A tensor's shape and nothing else, through what the weight rules do to a tensor.

    Meta tensors would do, but their torch.cat runs torch's Python reference kernels, whose first
    call imports torch._dynamo (about 4 s here) for an export that never traces (--graphs fused).
    """

    def __init__(self, shape):
        self.shape = torch.Size(shape)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        parts, dim = args[0], (kwargs or {}).get("dim", args[1] if len(args) > 1 else 0)
        if func is torch.cat:
            shape = list(parts[0].shape)
            shape[dim] = sum(p.shape[dim] for p in parts)
            return cls(shape)
        if func is torch.stack:
            return cls([len(parts), *parts[0].shape])
        return NotImplemented

    def numel(self) -> int:
        return self.shape.numel()

    def dim(self) -> int:
        return len(self.shape)

    def to(self, *args, **kwargs) -> "_Shape":
        return self

    contiguous = clone = to
    __add__ = __mul__ = __truediv__ = to

    def t(self) -> "_Shape":
        return _Shape(self.shape[::-1])

    def transpose(self, a: int, b: int) -> "_Shape":
        shape = list(self.shape)
        shape[a], shape[b] = shape[b], shape[a]
        return _Shape(shape)

    def reshape(self, *shape) -> "_Shape":
        return _Shape(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def expand(self, *sizes) -> "_Shape":
        old = [None] * (len(sizes) - len(self.shape)) + list(self.shape)
        return _Shape([o if s == -1 else s for s, o in zip(sizes, old)])

    def unsqueeze(self, dim: int) -> "_Shape":
        shape = list(self.shape)
        shape.insert(dim, 1)
        return _Shape(shape)
