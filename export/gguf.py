"""Reading a GGUF file (llama.cpp's format) as a checkpoint: a HF-style config and fp32 weights.

The ``gguf`` package reads the file memory-mapped. Its metadata (``{arch}.block_count``,
``{arch}.attention.head_count``, ...) becomes the config dict ``spec_from_hf_config`` reads
for a Hugging Face checkpoint, and its tensors are renamed to the HF names ``map_weights``
takes, so a GGUF goes through the same ModelSpec, torch modules and ONNX export as a
checkpoint directory. Quantized tensors are dequantized here; ``gguf_blocks`` keeps the
Q8_0/Q4_0/Q4_1 ones in their original blocks for MatMulNBits.

llama.cpp's converter permutes the rows of Llama's q and k projections (it applies RoPE to
interleaved pairs, HF to halves); ``unpermute_rows`` undoes that for the ``llama``
architecture, as transformers' GGUF loader does. Qwen2 GGUFs are not permuted (llama.cpp
runs them with NeoX-style RoPE).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from llmx.errors import CheckpointError, require

# GGUF general.architecture -> llmx family. Mistral GGUFs are written as "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# GGUF tensor names -> HF names ("{i}" is the layer).
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.")
ROPE_SCALING = {"none": None, "linear": "linear", "yarn": "yarn"}


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

    def _config(self) -> dict[str, Any]:
        arch, f = self.architecture, self.field
        need = {key: f(f"{arch}.{key}") for key in ("block_count", "embedding_length", "attention.head_count",
                                                     "feed_forward_length", "context_length")}
        if missing := [k for k, v in need.items() if v is None]:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{missing[0]}")
        if "rope_freqs.weight" in self.tensors:
            raise CheckpointError("GGUF has Llama-3-style rope frequency factors (rope_freqs.weight); not supported")
        embed = self._tensor("token_embd.weight")
        heads = int(need["attention.head_count"])
        cfg = {
            "model_type": ARCHITECTURES[arch],
            "vocab_size": int(embed.shape[1]),  # ggml dims: [hidden, vocab]
            "hidden_size": int(need["embedding_length"]),
            "num_hidden_layers": int(need["block_count"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(f(f"{arch}.attention.head_count_kv", heads)),
            "intermediate_size": int(need["feed_forward_length"]),
            "max_position_embeddings": int(need["context_length"]),
            "rms_norm_eps": _float32(f(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": _float32(f(f"{arch}.rope.freq_base", 10000.0)),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": f("tokenizer.ggml.bos_token_id"),
            "eos_token_id": f("tokenizer.ggml.eos_token_id"),
            "pad_token_id": f("tokenizer.ggml.padding_token_id"),
        }
        if (key_length := f(f"{arch}.attention.key_length")) is not None:
            cfg["head_dim"] = int(key_length)
        cfg.update(self._rope_scaling())
        return cfg

    def _rope_scaling(self) -> dict[str, Any]:
        arch, f = self.architecture, self.field
        kind = f(f"{arch}.rope.scaling.type", "none")
        if kind not in ROPE_SCALING:
            raise CheckpointError(f"GGUF rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_SCALING)})")
        if ROPE_SCALING[kind] is None:
            return {}
        scaling = {"rope_type": ROPE_SCALING[kind], "factor": _float32(f(f"{arch}.rope.scaling.factor", 1.0))}
        if (original := f(f"{arch}.rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return {"rope_scaling": scaling}

    # -- tensors ----------------------------------------------------------------------------

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise CheckpointError(f"GGUF lacks tensor {name!r}")
        return self.tensors[name]

    def hf_name(self, name: str) -> str:
        layer = _LAYER.match(name)
        pattern = _LAYER.sub("blk.{i}.", name) if layer else name
        if pattern not in TENSOR_NAMES:
            raise CheckpointError(f"GGUF tensor {name!r} has no counterpart in a {self.architecture} model")
        return TENSOR_NAMES[pattern].format(i=layer.group(1) if layer else "")

    def row_heads(self, name: str, heads: int, kv_heads: int) -> int | None:
        """Heads to unpermute ``name``'s rows by (llama q and k), or None."""
        if self.architecture != "llama":
            return None
        return heads if ".attn_q." in name else kv_heads if ".attn_k." in name else None

    def float32(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32 in HF layout ([out, in] for matrices)."""
        quants = require("gguf.quants", "reading GGUF files", "gguf")
        t = self.tensors[name]
        array = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        return array if array.flags.writeable else array.copy()  # F32 tensors come as read-only memory maps

    def hf_weights(self, heads: int, kv_heads: int) -> dict[str, "torch.Tensor"]:
        import torch

        out = {}
        for name in self.tensors:
            array = self.float32(name)
            if (by := self.row_heads(name, heads, kv_heads)) is not None:
                array = unpermute_rows(array, by)
            if array.ndim == 2:
                # Stored [in, out] (llmx's layout) and handed over as an [out, in] view: map_weights'
                # transpose is then free instead of a second copy of every matrix.
                out[self.hf_name(name)] = torch.from_numpy(np.ascontiguousarray(array.T)).t()
            else:
                out[self.hf_name(name)] = torch.from_numpy(np.ascontiguousarray(array))
        return out

    def quant_types(self) -> dict[str, int]:
        """How many tensors the file holds of each GGML type."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts


def _float32(value: float) -> float:
    # GGUF stores float32: 1e-6 reads back as 9.99999997e-07. The shortest decimal that is the
    # same float32 is the value the checkpoint had.
    return float(str(np.float32(value)))


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
