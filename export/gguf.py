"""Reading a GGUF file (llama.cpp's format) as a checkpoint: a HF-style config and fp32 weights.

The ``gguf`` package reads the file memory-mapped. Its metadata (``{arch}.block_count``,
``{arch}.attention.head_count``, ...) becomes the config dict ``spec_from_hf_config`` reads
for a Hugging Face checkpoint, and its tensors are renamed to the HF names ``map_weights``
takes, so a GGUF goes through the same ModelSpec, torch modules and ONNX export as a
checkpoint directory. Quantized tensors are dequantized here; ``gguf_blocks`` keeps the
Q8_0/Q4_0/Q4_1 ones in their original blocks for MatMulNBits.

What llama.cpp's converter did to each family's tensors is undone (export/gguf_arch.py has the
table): q/k rows permuted for the families llama.cpp runs with interleaved RoPE (``llama``,
``granite``, ``smollm3``; ``unpermute_rows``, as transformers' GGUF loader does), Gemma's norms
stored as 1 + w, GPT-2's Conv1D weights transposed, MoE experts stacked into one tensor (each
expert's HF name reads its slice).
"""

from __future__ import annotations

import itertools
import mmap
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from llmx.errors import CheckpointError, require
from llmx.export.gguf_arch import ARCHITECTURES, Arch, float32_decimal, llama3_rope

if TYPE_CHECKING:
    import torch

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_LAYER = re.compile(r"^blk\.(\d+)\.")
ROPE_SCALING = {"none": None, "linear": "linear", "yarn": "yarn"}
YARN = {"yarn_attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names (a .gguf file, or a directory holding exactly one), else None."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"GGUF file {path} does not exist")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise CheckpointError(f"{path} holds {len(found)} .gguf files; name the one to export")
        return found[0] if found else None
    return None


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head: interleaved pairs -> two halves)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass
class GGUFSource:
    path: Path
    reader: Any  # gguf.GGUFReader

    # -- metadata ---------------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        found = self.reader.get_field(key)
        return found.contents() if found is not None else default

    @cached_property
    def architecture(self) -> str:
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(
                f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        return arch

    @cached_property
    def tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self.reader.tensors}

    def config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face config dict (what spec_from_hf_config reads)."""
        try:
            return self._config()
        except (TypeError, ValueError) as exc:  # e.g. per-layer head counts (arrays), which llmx cannot express
            raise CheckpointError(f"GGUF metadata has a value llmx cannot use: {exc}") from exc

    @property
    def arch(self) -> Arch:
        return ARCHITECTURES[self.architecture]

    def _config(self) -> dict[str, Any]:
        arch, f, table = self.architecture, self.field, self.arch
        need = {key: f(f"{arch}.{key}") for key in ("block_count", "embedding_length", "attention.head_count",
                                                     "feed_forward_length", "context_length")}
        if missing := [k for k, v in need.items() if v is None]:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{missing[0]}")
        embed = self._tensor("token_embd.weight")
        heads = int(need["attention.head_count"])
        experts = f(f"{arch}.expert_count")
        cfg = {
            "model_type": table.moe_family if experts and table.moe_family else table.family,
            "vocab_size": int(embed.shape[1]),  # ggml dims: [hidden, vocab]
            "hidden_size": int(need["embedding_length"]),
            "num_hidden_layers": int(need["block_count"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(f(f"{arch}.attention.head_count_kv", heads)),
            "intermediate_size": int(need["feed_forward_length"]),
            "max_position_embeddings": int(need["context_length"]),
            "rope_theta": float32_decimal(f(f"{arch}.rope.freq_base", 10000.0)),
            "hidden_act": table.hidden_act,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in self.tensors,
            "bos_token_id": f("tokenizer.ggml.bos_token_id"),
            "eos_token_id": f("tokenizer.ggml.eos_token_id"),
            "pad_token_id": f("tokenizer.ggml.padding_token_id"),
        }
        if table.norm == "layer":
            cfg["layer_norm_eps"] = float32_decimal(f(f"{arch}.attention.layer_norm_epsilon", 1e-5))
        else:
            cfg["rms_norm_eps"] = float32_decimal(f(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))
        if (key_length := f(f"{arch}.attention.key_length")) is not None:
            cfg["head_dim"] = int(key_length)
        if experts:
            cfg["num_experts"] = int(experts)
            cfg["num_experts_per_tok"] = int(f(f"{arch}.expert_used_count"))
            if (expert_ffn := f(f"{arch}.expert_feed_forward_length")) is not None:
                cfg["moe_intermediate_size"] = int(expert_ffn)
        for key, theirs in table.config.items():
            if (value := f(f"{arch}.{theirs}")) is not None:
                cfg[key] = float32_decimal(value) if isinstance(value, float) else value
        cfg.update(self._rope_scaling(cfg))
        if table.extra is not None:
            table.extra(self, cfg)
        return cfg

    def _rope_scaling(self, cfg: dict[str, Any]) -> dict[str, Any]:
        arch, f = self.architecture, self.field
        kind = f(f"{arch}.rope.scaling.type", "none")
        if kind == "longrope" and self.arch.config_tensors:  # Phi-3's factors: its config function reads them
            return {}
        if kind not in ROPE_SCALING:
            raise CheckpointError(f"GGUF rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_SCALING)})")
        if "rope_freqs.weight" in self.tensors:  # Llama 3.1/3.2: the llama3 factors, written out
            if ROPE_SCALING[kind] is not None:
                raise CheckpointError(f"GGUF has both rope_freqs.weight and {kind} rope scaling; not supported")
            dim = f(f"{arch}.rope.dimension_count") or cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            scaling = llama3_rope(self.float32("rope_freqs.weight"), cfg["rope_theta"], int(dim))
            return {"rope_scaling": scaling} if scaling else {}
        if ROPE_SCALING[kind] is None:
            return {}
        scaling = {"rope_type": ROPE_SCALING[kind], "factor": float32_decimal(f(f"{arch}.rope.scaling.factor", 1.0))}
        if (original := f(f"{arch}.rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(original)
        if kind == "yarn":  # what the converter copies from HF's yarn parameters, when they were there
            for ours, theirs in YARN.items():
                if (value := f(f"{arch}.rope.scaling.{ours}")) is not None:
                    scaling[theirs] = float32_decimal(value)
        return {"rope_scaling": scaling}

    # -- tensors ----------------------------------------------------------------------------

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise CheckpointError(f"GGUF lacks tensor {name!r}")
        return self.tensors[name]

    def weights(self) -> dict[str, tuple[str, int | None]]:
        """HF name -> (GGUF tensor, index of its slice or None) for every weight in the file."""
        names, out = self.arch.tensor_names(), {}
        for name, t in self.tensors.items():
            if name == "rope_freqs.weight" or name in self.arch.config_tensors:
                continue  # read into the config
            hf = self._hf_pattern(name, names)
            if "{e}" in hf:  # stacked along the first axis (ggml's last dim)
                out.update({hf.format(e=j): (name, j) for j in range(int(t.shape[-1]))})
            else:
                out[hf] = (name, None)
        return out

    def _hf_pattern(self, name: str, names: dict[str, str]) -> str:
        layer = _LAYER.match(name)
        pattern = _LAYER.sub("blk.{i}.", name) if layer else name
        if pattern not in names:
            raise CheckpointError(f"GGUF tensor {name!r} has no counterpart in a {self.architecture} model")
        return names[pattern].replace("{i}", layer.group(1) if layer else "")

    def pattern(self, name: str) -> str:
        return _LAYER.sub("blk.{i}.", name)

    def row_heads(self, name: str, heads: int, kv_heads: int) -> int | None:
        """Heads to unpermute ``name``'s rows by (q and k of a family llama.cpp permuted), or None."""
        if not self.arch.permuted:
            return None
        return heads if ".attn_q." in name else kv_heads if ".attn_k." in name else None

    def float32(self, name: str, index: int | None = None) -> np.ndarray:
        """A tensor (or its ``index``-th slice along the first axis) dequantized to float32 in HF
        layout ([out, in] for matrices)."""
        quants = require("gguf.quants", "reading GGUF files", "gguf")
        t = self.tensors[name]
        data = t.data if index is None else t.data[index]
        array = np.asarray(quants.dequantize(data, t.tensor_type), dtype=np.float32)
        return array if array.flags.writeable else array.copy()  # F32 tensors come as read-only memory maps

    def release(self, name: str, index: int | None = None) -> None:
        """Drop ``name``'s pages (those of its ``index``-th slice) of the memory-mapped file from the
        resident set once read: the mapping would otherwise keep every page touched, and a
        streamed export would end holding the whole file."""
        t, mapped = self.tensors[name], getattr(self.reader.data, "_mmap", None)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, size = t.data_offset, t.n_bytes
        if index is not None:
            size //= int(t.shape[-1])
            start += index * size
        begin = start // mmap.PAGESIZE * mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, begin, start + size - begin)

    def quant_types(self) -> Counter:
        """How many tensors the file holds of each GGML type."""
        return Counter(t.tensor_type.name for t in self.tensors.values())


def open_gguf(path: Path) -> GGUFSource:
    gguf = require("gguf", "reading GGUF files", "gguf")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # truncated or corrupt files raise many exception types
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"cannot read GGUF file {path.name}: {detail}") from exc
    source = GGUFSource(path, reader)
    source.architecture  # noqa: B018 -- refuse unsupported architectures before any work
    return source


class GGUFTensors(Mapping):
    """A GGUF's tensors by their Hugging Face names, as float32 in HF layout, each dequantized (and
    its q/k rows put back in HF's order) only when asked for: what ``iter_weights`` streams."""

    def __init__(self, source: GGUFSource, heads: int, kv_heads: int):
        self.source, self.heads, self.kv_heads = source, heads, kv_heads
        self.by_hf = source.weights()  # HF name -> (GGUF name, slice index or None)
        self.kept: dict[str, str] = {}  # GGUF name -> its type, for the linears kept in their blocks
        self.requantized: dict[str, float] = {}  # GGUF name -> relative RMS error of the second rounding
        self._last: tuple[list[str] | None, Any] = (None, None)

    def __getitem__(self, hf: str) -> "torch.Tensor":
        import torch

        name, index = self.by_hf[hf]
        array = self.source.float32(name, index)
        self.source.release(name, index)
        if index is None and (by := self.source.row_heads(name, self.heads, self.kv_heads)) is not None:
            array = unpermute_rows(array, by)
        array = self.source.arch.undo(self.source.pattern(name), hf, array)
        return torch.from_numpy(np.ascontiguousarray(array))

    def __contains__(self, hf) -> bool:
        return hf in self.by_hf

    def __iter__(self):
        return iter(self.by_hf)

    def __len__(self) -> int:
        return len(self.by_hf)

    def stored_blocks(self, hf_names: list[str]):
        """The linear weight made of ``hf_names`` ([out, in] parts, stacked) in the file's own
        blocks as MatMulNBits reads them, or None when a part is stored as floats. Adjacent parts
        of one layout are concatenated; parts of different ones (llama.cpp's Q4_K_M gives v more
        bits than q and k) stay separate (StackedBlocks), each in its compact layout."""
        from llmx.export import gguf_blocks
        from llmx.quant_blocks import StackedBlocks, concat_rows

        if self._last[0] == hf_names:  # a tied head, made from the table the embedding was
            return self._last[1]
        found = [self.by_hf[n] for n in hf_names]
        names = [name for name, _ in found]
        tensors = [self.source.tensors[n] for n in names]
        if any(t.tensor_type.name in FLOAT_TYPES for t in tensors):
            return None
        arch = self.source.arch
        if any(index is not None or arch.changes(self.source.pattern(name), hf)
               for hf, (name, index) in zip(hf_names, found)):
            return None  # a slice of a stacked tensor, or one the converter changed: read as floats
        parts = []
        for name, t in zip(names, tensors):
            kind = t.tensor_type.name
            if kind in gguf_blocks.EXACT:
                blocks = gguf_blocks.from_gguf(t.data, kind)
            else:
                blocks, self.requantized[name] = gguf_blocks.requantized(t.data, kind, tuple(int(d) for d in t.shape[::-1]))
            self.source.release(name)
            if (by := self.source.row_heads(name, self.heads, self.kv_heads)) is not None:
                blocks = blocks.rows(unpermute_rows(np.arange(blocks.n), by))
            parts.append(blocks)
            self.kept[name] = kind
        runs = [concat_rows(list(run)) for _, run in itertools.groupby(parts, lambda b: (b.bits, b.block_size))]
        blocks = _fast(runs[0]) if len(runs) == 1 else StackedBlocks([_fast(b) for b in runs])
        self._last = hf_names, blocks
        return blocks

def _fast(blocks):
    """Float zero points (Q4_1, Q4_K, ...) as integer codes plus per-block offsets: ONNX Runtime's
    MatMulNBits runs float zero points ~40x slower at 4 bits and refuses them at 8."""
    from llmx.export.gguf_blocks import split_offsets

    if blocks.zero_points is None or blocks.zero_points.dtype != np.float32:
        return blocks
    main, offsets = split_offsets(blocks)
    main.offsets = offsets
    return main


def gguf_checkpoint(path: Path, keep_blocks: bool = True):
    """A GGUF file as a ``Checkpoint``: its metadata as config.json, its tensors read one at a
    time; with ``keep_blocks`` its quantized linear weights stay in their own blocks."""
    from llmx.export.checkpoint import Checkpoint
    from llmx.spec import spec_from_hf_config

    source = open_gguf(path)
    config = source.config()
    spec = spec_from_hf_config(config)
    tensors = GGUFTensors(source, spec.num_heads, spec.num_kv_heads)
    return Checkpoint(path, config, spec, [], reader=tensors, stored_blocks=tensors.stored_blocks if keep_blocks else None)
