"""Pre-quantized Hugging Face checkpoints: GPTQ, AWQ and compressed-tensors' pack-quantized int4/int8
weights, exported with the checkpoint's own integers (no second rounding).

    config.json quantization_config --> the format (``FORMATS``)
    model.safetensors: q_proj.qweight/.qzeros/.scales/.g_idx ... --> ``QuantLinear`` (codes, scales, zero points)
        --> stored_blocks: MatMulNBits blocks, W = (q - z) * s exactly (``Checkpoint.stored_blocks``)
        --> reader["...q_proj.weight"]: the same values as float32 (--precision fp32, portable, --verify)
    everything else (embeddings, norms, an unquantized head): read as it is stored

Each linear is decoded to one common form, ``QuantLinear``: unsigned codes [N, K], per-group scales
and integer zero points [N, G], and the group of every input channel (``g_idx`` [K]); its values
are (codes - zeros[:, g_idx]) * scales[:, g_idx]. Scales are fp16/bf16 in these files, so the
product of one with a code difference of at most 8 bits is exact in float32: the blocks, the
float32 reader and a float64 reference all give the same numbers. (The formats' own torch
dequantizers compute in the scales' dtype, e.g. AutoAWQ's ``dequantize_gemm`` in fp16, which
rounds that product again; the checkpoint's integers and scales are what is reproduced here.)

The on-disk layouts, as the reference code reads and writes them:

- GPTQ (gptqmodel ``nn_modules/qlinear/__init__.py`` ``pack_original``/``dequantize_weight``):
  ``qweight`` int32 [K / (32 / bits), N], input channel k = 32 / bits * row + field; ``qzeros``
  int32 [G, N / (32 / bits)] packed along N; ``scales`` [G, N]; ``g_idx`` int32 [K]. The classic
  format (``checkpoint_format`` "gptq", v1) stores every zero point minus 1, subtracted from the
  packed word as a whole (``convert_gptq_v2_to_v1_format_module``): it is undone as gptqmodel's
  loader undoes it, by adding 0x11111111 (4 bits) / 0x01010101 (8 bits) to each word, modulo 2^32
  (``convert_gptq_v1_to_v2_format_module``). "gptq_v2" stores them as they are.
- AWQ "gemm" (AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``,
  ``awq/utils/packing_utils.py`` ``dequantize_gemm``): ``qweight`` int32 [K, N / 8], nibble i of word
  j holding output channel 8 j + [0, 2, 4, 6, 1, 3, 5, 7][i]; ``qzeros`` int32 [K / g, N / 8] the
  same; ``scales`` [K / g, N]; zero points as they are.
- compressed-tensors "pack-quantized" (``compressors/pack_quantized/helpers.py``
  ``pack_to_int32``/``unpack_from_int32``, ``base.py``): ``weight_packed`` int32 [N, K * bits / 32],
  input channel k at bit k * bits of row n's words; values stored offset by 2^(bits - 1) (signed ->
  unsigned); ``weight_scale`` [N, G] (G = 1 per channel); asymmetric: ``weight_zero_point`` int32
  [N * bits / 32, G] packed along N, offset the same way; ``weight_shape`` [N, K]; with
  ``actorder: group`` a ``weight_g_idx`` [K].

MatMulNBits needs the blocks of one scale and zero point to be contiguous runs of input channels,
of a power-of-two size from 16 to 256. Each linear gets the largest power of two up to ``MAX_BLOCK``
that divides K and over whose runs ``g_idx`` is constant: a group of 128 gives blocks of 128, a
per-channel scale (GPTQ group_size -1, compressed-tensors "channel") blocks of 128 with the scale
repeated, exactly. GPTQ's ``desc_act`` (and compressed-tensors' ``actorder: group``) may permute
``g_idx``: where its groups are still whole runs of blocks (static groups, or groups permuted as
wholes) the blocks just take each run's group; where a group's channels are scattered (act-order
proper), the input channels are sorted by group, which makes every group a run of whole blocks,
and the graph gathers x in that order before the MatMulNBits (``Blocks.input_order``: K values
per row, nothing beside the weight's own bytes). Only groups that are not whole blocks even then
(a group size that is no multiple of 16) are refused, with one line naming the weight and
``--precision fp32``, which exports the exactly dequantized float weights instead.

Zero points are the kernel's default (2^(bits - 1), GPTQ's and compressed-tensors' symmetric
weights) or packed uint8 (AWQ, asymmetric GPTQ/compressed-tensors): both fast in ONNX Runtime's CPU
kernel (export/gguf_blocks.py); folded into the codes where every code still fits.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from llmx.errors import CheckpointError
from llmx.quant_blocks import DEFAULT_ZERO_POINT

SUPPORTED_TEXT = ("GPTQ (4/8-bit, checkpoint_format gptq or gptq_v2), AWQ (4-bit, version gemm) and "
                  "compressed-tensors pack-quantized (int4/int8 weights, W4A16/W8A16)")
MAX_BLOCK = 128  # ONNX Runtime takes 16..256; 64-256 ran alike here (4-bit, 2048x8192, level 4)
BLOCK_SIZES = tuple(b for b in (256, 128, 64, 32, 16) if b <= MAX_BLOCK)


# ---- one linear, decoded ---------------------------------------------------------------------

@dataclass
class QuantLinear:
    """A quantized linear [N out, K in]: W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g], g = g_idx[k]."""

    name: str  # the HF name of its float weight ("...q_proj.weight"), for messages
    bits: int
    codes: np.ndarray  # [N, K] uint8, unsigned
    scales: np.ndarray  # [N, G] float32 (the file's fp16/bf16/fp32, widened exactly)
    zeros: np.ndarray | None  # [N, G] uint8 unsigned; None: 2^(bits - 1)
    g_idx: np.ndarray  # [K] int64, input channel -> group
    input_order: np.ndarray | None = None  # [K]: the input channel each column reads (``in_group_order``)

    def __post_init__(self):
        n, k = self.codes.shape
        groups = self.scales.shape[1]
        if self.scales.shape[0] != n or (self.zeros is not None and self.zeros.shape != self.scales.shape) \
                or self.g_idx.shape != (k,) or (k and (self.g_idx.min() < 0 or self.g_idx.max() >= groups)):
            raise CheckpointError(f"{self.name}: quantized tensors do not agree: codes {n}x{k}, scales "
                                  f"{'x'.join(map(str, self.scales.shape))}, {groups} groups for {k} inputs")
        if self.codes.size and int(self.codes.max()) >= 1 << self.bits:
            raise CheckpointError(f"{self.name}: codes exceed {self.bits} bits")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def zero_points(self) -> np.ndarray:
        if self.zeros is not None:
            return self.zeros
        return np.full(self.scales.shape, DEFAULT_ZERO_POINT[self.bits], np.uint8)

    def dequantized(self) -> np.ndarray:
        """[N, K] float32: each value one exact float32 product (integer difference x scale)."""
        diff = self.codes.astype(np.float32) - self.zero_points().astype(np.float32)[:, self.g_idx]
        diff *= self.scales[:, self.g_idx]
        return diff

    def in_group_order(self) -> "QuantLinear":
        """The same linear with its input channels sorted by group (stably), which makes act-order's
        scattered groups contiguous; itself if they are in order already."""
        order = np.argsort(self.g_idx, kind="stable")
        if np.array_equal(order, np.arange(len(order))):
            return self
        return dataclasses.replace(self, codes=np.ascontiguousarray(self.codes[:, order]), g_idx=self.g_idx[order],
                                   input_order=order)

    def block_size(self) -> int | None:
        """The largest block size (a power of two, 16..MAX_BLOCK) dividing K whose runs of input
        channels each lie in one group; None if there is none (scattered act-order groups)."""
        k = self.codes.shape[1]
        for size in BLOCK_SIZES:
            if k % size == 0:
                runs = self.g_idx.reshape(-1, size)
                if np.array_equal(runs, np.broadcast_to(runs[:, :1], runs.shape)):
                    return size
        return None

    def blocks(self, block_size: int, zero_points: bool = False):
        """MatMulNBits blocks of ``block_size`` (which ``block_size()`` must allow); ``zero_points``:
        write them even when all are the default (to stack with parts that have others)."""
        from llmx.quant_blocks import Blocks, pack_codes

        n, k = self.codes.shape
        first = self.g_idx[::block_size]  # each block's group
        scales = np.ascontiguousarray(self.scales[:, first], dtype=np.float32)
        packed = pack_codes(self.codes.reshape(n, k // block_size, block_size), self.bits)
        zeros = None
        if self.zeros is not None or zero_points:
            z = self.zero_points()[:, first]
            if zero_points or np.any(z != DEFAULT_ZERO_POINT[self.bits]):
                zeros = _packed_zero_points(z, self.bits)
        return Blocks(self.bits, packed, scales, zeros, block_size, input_order=self.input_order)


def _packed_zero_points(z: np.ndarray, bits: int) -> np.ndarray:
    """[N, blocks] zero points as MatMulNBits reads them: uint8, 4 bits two per byte (block 2j low nibble)."""
    z = z.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(z)
    if z.shape[1] % 2:
        z = np.pad(z, ((0, 0), (0, 1)))
    return np.ascontiguousarray(z[:, 0::2] | (z[:, 1::2] << 4))


# ---- bit fields ------------------------------------------------------------------------------

def _words(tensor: torch.Tensor, what: str) -> np.ndarray:
    if tensor.dtype != torch.int32:
        raise CheckpointError(f"{what} is {str(tensor.dtype).removeprefix('torch.')}; int32 words expected")
    return tensor.numpy().view(np.uint32)


def _fields(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unpack uint32 ``words`` into 32 / bits unsigned fields each, field i at bits [i * bits, (i + 1) * bits),
    the fields of a word consecutive along ``axis`` (0: [R, C] -> [R * 32/bits, C]; 1: -> [R, C * 32/bits])."""
    per, mask = 32 // bits, np.uint32((1 << bits) - 1)
    rows, cols = words.shape
    out = np.empty((rows * per, cols) if axis == 0 else (rows, cols * per), np.uint8)
    for i in range(per):  # one field at a time: no [R, C, per] uint32 temporary
        field = ((words >> np.uint32(i * bits)) & mask).astype(np.uint8)
        if axis == 0:
            out[i::per] = field
        else:
            out[:, i::per] = field
    return out


def _float32(tensor: torch.Tensor) -> np.ndarray:
    if not tensor.is_floating_point():
        raise CheckpointError(f"scales are {tensor.dtype}; floats expected")
    return tensor.to(torch.float32).numpy()


# ---- the formats -----------------------------------------------------------------------------

class _Format:
    method: str
    marker: str  # the tensor that makes a linear quantized: prefix + marker
    parts: tuple[str, ...]  # every tensor of a quantized linear, hidden from the reader

    def __init__(self, config: dict):
        self.config = config

    def decode(self, raw: Mapping[str, torch.Tensor], prefix: str) -> QuantLinear:
        raise NotImplementedError

    def check(self, raw: Mapping[str, torch.Tensor], linears: set[str]) -> None:
        """Refuse tensors the export would otherwise ignore silently."""

    def describe(self) -> str:
        raise NotImplementedError


def _get(raw: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in raw:
        raise CheckpointError(f"weights are missing tensor {name!r}")
    return raw[name]


class _GPTQ(_Format):
    method, marker = "gptq", ".qweight"
    parts = (".qweight", ".qzeros", ".scales", ".g_idx")

    def __init__(self, config: dict):
        super().__init__(config)
        self.bits = int(config.get("bits", 4))
        if self.bits not in (4, 8):
            raise CheckpointError(f"GPTQ with {self.bits}-bit weights is not supported; supported: 4 and 8 bits")
        fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
        self.v1 = fmt == "gptq"
        self.group_size = int(config.get("group_size", 128) or -1)

    def describe(self) -> str:
        sym = "symmetric" if self.config.get("sym", True) else "asymmetric"
        group = "per channel" if self.group_size <= 0 else f"group {self.group_size}"
        return (f"gptq {self.bits}-bit, {group}, {sym}" + (", desc_act" if self.config.get("desc_act") else "")
                + ("" if self.v1 else ", gptq_v2"))

    def decode(self, raw, prefix):
        bits, name = self.bits, prefix + ".weight"
        qweight = _words(_get(raw, prefix + ".qweight"), f"{prefix}.qweight")
        qzeros = _words(_get(raw, prefix + ".qzeros"), f"{prefix}.qzeros")
        scales = _float32(_get(raw, prefix + ".scales")).T  # [G, N] -> [N, G]
        n = qweight.shape[1]
        codes = _fields(qweight, bits, axis=0)  # [K, N]
        if self.v1:  # zero points were stored minus 1, subtracted word-wise (see the module docstring)
            qzeros = qzeros + np.uint32(0x11111111 if bits == 4 else 0x01010101)
        zeros = _fields(qzeros, bits, axis=1)[:, :n].T  # [G, N] -> [N, G]
        if prefix + ".g_idx" in raw:
            g_idx = raw[prefix + ".g_idx"].numpy().astype(np.int64)
        else:
            g_idx = np.arange(codes.shape[0]) // (self.group_size if self.group_size > 0 else codes.shape[0])
        codes = codes[:len(g_idx)]  # rows padded to whole words, if any
        return QuantLinear(name, bits, np.ascontiguousarray(codes.T), np.ascontiguousarray(scales),
                           np.ascontiguousarray(zeros), g_idx)


class _AWQ(_Format):
    method, marker = "awq", ".qweight"
    parts = (".qweight", ".qzeros", ".scales")
    ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i of a word holds column ORDER[i]

    def __init__(self, config: dict):
        super().__init__(config)
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        version = str(config.get("version") or config.get("format") or "gemm").lower()
        if self.bits != 4 or version != "gemm":
            raise CheckpointError(f"AWQ {self.bits}-bit version {version!r} is not supported; supported: 4-bit, version gemm")
        if config.get("zero_point", True) is False:
            raise CheckpointError("AWQ without zero points (zero_point: false) is not supported; supported: 4-bit gemm "
                                  "with zero points")

    def describe(self) -> str:
        return f"awq 4-bit gemm, group {self.config.get('group_size', self.config.get('q_group_size'))}"

    def _columns(self, words: np.ndarray) -> np.ndarray:
        fields = _fields(words, 4, axis=1).reshape(words.shape[0], -1, 8)  # [R, C, nibble]
        out = np.empty_like(fields)
        out[:, :, list(self.ORDER)] = fields
        return out.reshape(words.shape[0], -1)

    def decode(self, raw, prefix):
        name = prefix + ".weight"
        codes = self._columns(_words(_get(raw, prefix + ".qweight"), f"{prefix}.qweight"))  # [K, N]
        zeros = self._columns(_words(_get(raw, prefix + ".qzeros"), f"{prefix}.qzeros"))  # [G, N]
        scales = _float32(_get(raw, prefix + ".scales"))  # [G, N]
        k, groups = codes.shape[0], scales.shape[0]
        if groups == 0 or k % groups:
            raise CheckpointError(f"{name}: {groups} AWQ groups do not divide {k} inputs")
        g_idx = np.arange(k) // (k // groups)
        return QuantLinear(name, 4, np.ascontiguousarray(codes.T), np.ascontiguousarray(scales.T),
                           np.ascontiguousarray(zeros.T), g_idx)

    def check(self, raw, linears):
        # AutoAWQ's ScaledActivation (gpt_neox, starcoder2, ...): the activation divided per channel
        # before the next linear, which no MatMulNBits scale (per block of inputs) can hold.
        scaled = next((n for n in raw if n.endswith(".act.scales")), None)
        if scaled is not None:
            raise CheckpointError(f"AWQ's scaled activations ({scaled}) are not supported")


class _CompressedTensors(_Format):
    method, marker = "compressed-tensors", ".weight_packed"
    parts = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")

    def __init__(self, config: dict):
        super().__init__(config)
        fmt = config.get("format")
        groups = config.get("config_groups") or {}
        if not groups:
            raise CheckpointError("compressed-tensors quantization_config has no config_groups")
        self.group_sizes: set[int] = set()
        self.num_bits: set[int] = set()
        for name, group in groups.items():
            weights = group.get("weights") or {}
            kind = group.get("format") or fmt
            what = f"compressed-tensors group {name!r}"
            if kind != "pack-quantized":
                raise CheckpointError(f"{what}: format {kind!r} is not supported; supported: pack-quantized "
                                      "(int4/int8 weights, W4A16/W8A16)")
            if group.get("input_activations") or group.get("output_activations"):
                raise CheckpointError(f"{what} quantizes activations too (W4A8/W8A8); supported: weights only "
                                      "(W4A16/W8A16)")
            bits, strategy = weights.get("num_bits"), weights.get("strategy")
            if weights.get("type", "int") != "int" or bits not in (4, 8):
                raise CheckpointError(f"{what}: {weights.get('type')} {bits}-bit weights are not supported; "
                                      "supported: int 4 and 8 bits")
            if strategy not in ("group", "channel", "tensor"):
                raise CheckpointError(f"{what}: strategy {strategy!r} is not supported; supported: group, channel, tensor")
            self.num_bits.add(int(bits))
            if weights.get("group_size"):
                self.group_sizes.add(int(weights["group_size"]))
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise CheckpointError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
        if config.get("transform_config"):
            raise CheckpointError("compressed-tensors transforms (rotations, transform_config) are not supported")

    def describe(self) -> str:
        groups = self.config["config_groups"].values()
        return "compressed-tensors " + "; ".join(sorted({
            f"int{g['weights']['num_bits']} {g['weights']['strategy']}"
            + (f" {g['weights']['group_size']}" if g["weights"].get("group_size") else "")
            + (" symmetric" if g["weights"].get("symmetric", True) else " asymmetric") for g in groups}))

    def decode(self, raw, prefix):
        name = prefix + ".weight"
        packed = _words(_get(raw, prefix + ".weight_packed"), f"{prefix}.weight_packed")
        n, k = (int(v) for v in _get(raw, prefix + ".weight_shape").tolist())
        bits = next((b for b in sorted(self.num_bits) if -(-k * b // 32) == packed.shape[1]), None)
        if bits is None or packed.shape[0] != n:
            raise CheckpointError(f"{name}: weight_packed {packed.shape[0]}x{packed.shape[1]} holds no "
                                  f"{'/'.join(map(str, sorted(self.num_bits)))}-bit {n}x{k} weight")
        codes = _fields(packed, bits, axis=1)[:, :k]  # stored + 2^(bits-1): unsigned already
        scales = _float32(_get(raw, prefix + ".weight_scale"))
        scales = np.broadcast_to(scales.reshape(-1, scales.shape[-1]) if scales.ndim else scales.reshape(1, 1),
                                 (n, scales.shape[-1] if scales.ndim else 1)).astype(np.float32)
        groups = scales.shape[1]
        zeros = None
        if prefix + ".weight_zero_point" in raw:
            zp = raw[prefix + ".weight_zero_point"]
            if zp.dtype == torch.int32:  # packed along N (pack_to_int32(..., packed_dim=0))
                zeros = _fields(_words(zp, f"{prefix}.weight_zero_point"), bits, axis=0)[:n]
            else:  # a tensor-wide int8 zero point, signed
                zeros = (zp.numpy().astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
            zeros = np.ascontiguousarray(np.broadcast_to(zeros.reshape(-1, zeros.shape[-1]) if zeros.ndim
                                                         else zeros.reshape(1, 1), (n, groups)))
        if prefix + ".weight_g_idx" in raw:
            g_idx = raw[prefix + ".weight_g_idx"].numpy().astype(np.int64)
        elif groups == 1:
            g_idx = np.zeros(k, np.int64)
        else:
            size = next((g for g in sorted(self.group_sizes) if -(-k // g) == groups), None)
            if size is None and k % groups == 0:
                size = k // groups
            if size is None:
                raise CheckpointError(f"{name}: {groups} scale groups for {k} inputs match no group size")
            g_idx = np.arange(k) // size
        return QuantLinear(name, bits, np.ascontiguousarray(codes), np.ascontiguousarray(scales), zeros, g_idx)

    def check(self, raw, linears):
        for name in raw:
            if name.endswith(".weight_scale") and name[:-len(".weight_scale")] not in linears:
                raise CheckpointError(f"{name} has no weight_packed beside it: only compressed-tensors' "
                                      "pack-quantized linears are supported")


FORMATS: dict[str, type[_Format]] = {"gptq": _GPTQ, "awq": _AWQ, "compressed-tensors": _CompressedTensors}


def quant_format(config: dict) -> _Format | None:
    """The format of config.json's ``quantization_config``; None if it has none; refuses others in one line."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method") or qc.get("method") or "").lower() if isinstance(qc, dict) else ""
    if method not in FORMATS:
        what = f"has quant_method {method!r}" if method else "names no quant_method"
        raise CheckpointError(f"config.json's quantization_config {what}, which llmx cannot read; supported "
                              f"pre-quantized checkpoints: {SUPPORTED_TEXT}")
    return FORMATS[method](qc)


# ---- the checkpoint --------------------------------------------------------------------------

class PrequantizedTensors(Mapping):
    """A pre-quantized checkpoint's tensors by Hugging Face name: each quantized linear's own tensors
    (.qweight, .scales, ...) hidden, its ``.weight`` offered instead, dequantized (float32) when
    read; ``stored_blocks`` gives the same linears as MatMulNBits blocks."""

    def __init__(self, files: list[Path], fmt: _Format):
        from llmx.export.tensors import CheckpointTensors

        self.raw, self.format = CheckpointTensors(files), fmt
        self.linears = {name[:-len(fmt.marker)] for name in self.raw if name.endswith(fmt.marker)}
        if not self.linears:
            raise CheckpointError(f"config.json says {fmt.method}, but no tensor ends in {fmt.marker}")
        fmt.check(self.raw, self.linears)
        self.hidden = {prefix + part for prefix in self.linears for part in fmt.parts}
        self.names = [n for n in self.raw if n not in self.hidden] + sorted(
            p + ".weight" for p in self.linears if p + ".weight" not in self.raw)
        self.kept: set[str] = set()  # the linears written as their own blocks
        self._last: tuple[Any, Any] = (None, None)

    def quantized(self, name: str) -> str | None:
        """The prefix of quantized linear ``name`` ("...q_proj.weight"), else None."""
        prefix = name.removesuffix(".weight")
        return prefix if name.endswith(".weight") and prefix in self.linears else None

    def linear(self, name: str) -> QuantLinear:
        return self.format.decode(self.raw, self.quantized(name))

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.quantized(name) is None:
            return self.raw[name]
        return torch.from_numpy(self.linear(name).dequantized())

    def __contains__(self, name) -> bool:
        return self.quantized(name) is not None or (name in self.raw and name not in self.hidden)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def stored_blocks(self, hf_names: list[str]):
        """The linear made of ``hf_names`` ([out, in] parts, stacked) in its own integers as
        MatMulNBits blocks; None when a part is stored as floats (all are then read as floats).
        Parts of one bit width are concatenated (one block size: the smallest any needs); parts of
        different widths stay separate (StackedBlocks)."""
        from llmx.export.gguf_blocks import widen
        from llmx.quant_blocks import StackedBlocks, concat_rows

        if self._last[0] == hf_names:  # a tied head, made from the table the embedding was
            return self._last[1]
        if not all(self.quantized(n) for n in hf_names):
            return None
        linears = [_in_blocks(self.linear(n)) for n in hf_names]
        runs = []
        # Parts share a MatMulNBits when they have the bits and the order of inputs in common
        # (GPTQ's act-order derives it from the input's statistics: the same for q, k and v).
        for (bits, _), run in itertools.groupby(linears, lambda q: (q.bits, _order_key(q))):
            run = list(run)
            size = min(_block_size(q) for q in run)
            # Stacked parts share one zero-point input: all write theirs if any has others than the default.
            zeros = len(run) > 1 and any(q.zeros is not None and np.any(q.zeros != DEFAULT_ZERO_POINT[bits]) for q in run)
            blocks = concat_rows([q.blocks(size, zero_points=zeros) for q in run])
            runs.append(widen(blocks, bits, size))  # integer zero points folded into the codes where they fit
        self.kept.update(hf_names)
        blocks = runs[0] if len(runs) == 1 else StackedBlocks(runs)
        self._last = hf_names, blocks
        return blocks


def _in_blocks(q: QuantLinear) -> QuantLinear:
    """``q``, or ``q`` with its inputs sorted by group where only that makes its groups whole blocks."""
    if q.block_size() is not None:
        return q
    ordered = q.in_group_order()
    return ordered if ordered.block_size() is not None else q


def _order_key(q: QuantLinear) -> bytes | None:
    return None if q.input_order is None else q.input_order.tobytes()


def _block_size(q: QuantLinear) -> int:
    size = q.block_size()
    if size is not None:
        return size
    k = q.shape[1]
    if k % BLOCK_SIZES[-1]:
        raise CheckpointError(f"{q.name}: {k} inputs are not a multiple of {BLOCK_SIZES[-1]}, the smallest "
                              "MatMulNBits block; export with --precision fp32 to dequantize it")
    raise CheckpointError(f"{q.name}: its quantization groups (g_idx) are not runs of 16 or more inputs, the "
                          "smallest MatMulNBits block, even sorted by group; export with --precision fp32 to "
                          "dequantize it")


def prequantized_checkpoint(checkpoint):
    """``checkpoint`` (open_checkpoint's) as it is read when its config.json has a
    ``quantization_config``: its quantized linears dequantized when read as tensors, and offered in
    their own blocks (``stored_blocks``); a checkpoint without one comes back as it is."""
    if checkpoint.config.get("quantization_config") is None:
        return checkpoint
    fmt = quant_format(checkpoint.config)
    if checkpoint.spec.family == "gpt2":  # Conv1D weights are [in, out]: their rule never asks for blocks
        raise CheckpointError(f"pre-quantized gpt2 checkpoints ({fmt.method}) are not supported")
    tensors = PrequantizedTensors(checkpoint.weight_files, fmt)
    return dataclasses.replace(checkpoint, reader=tensors, stored_blocks=tensors.stored_blocks)


def is_prequantized(checkpoint) -> bool:
    return isinstance(checkpoint.reader, PrequantizedTensors)


def method(checkpoint) -> str:
    return checkpoint.reader.format.method


def prequantized_export_options(checkpoint, graphs: str | None, precision: str | None,
                                verify: bool) -> tuple[str, str]:
    """(graphs, precision) for exporting a pre-quantized ``checkpoint`` as a quantized GGUF is
    (``stored_blocks_options``): its own blocks, the precision named after the format ("gptq",
    "awq", "compressed-tensors")."""
    from llmx.export.checkpoint import stored_blocks_options

    return stored_blocks_options(checkpoint, graphs, precision, verify, source="checkpoint", label=method(checkpoint),
                                 quantized=checkpoint.reader.format.describe())


def prequantized_record(checkpoint) -> dict:
    """The manifest's record of the source's quantization: format, and which linears kept their blocks."""
    tensors = checkpoint.reader
    return {"method": tensors.format.method, "quantization": tensors.format.describe(),
            "quantized_linears": len(tensors.linears), "kept_in_their_blocks": len(tensors.kept),
            "dequantized_to_float32": len(tensors.linears) - len(tensors.kept)}


def finish_prequantized_manifest(manifest, checkpoint, log: Callable[[str], None]):
    manifest.lineage[0].details["format"] = method(checkpoint)
    record = manifest.extras["prequantized"] = prequantized_record(checkpoint)
    kept, count = record["kept_in_their_blocks"], record["quantized_linears"]
    log(f"{record['quantization']}: " + (f"{kept} of {count} quantized linears kept in their blocks (MatMulNBits)"
                                         if kept else f"its {count} quantized linears dequantized to float32"))
    return manifest
