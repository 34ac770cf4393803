"""Reading a local Hugging Face checkpoint directory: config and weights.

Weights come from ``*.safetensors`` (single or sharded with an index) or ``pytorch_model.bin``
(single or sharded). They are renamed into llmx's module names by one rule table per family
(``WEIGHT_RULES``). llmx's linear weights are [in, out]: HF Linear weights ([out, in]) are
transposed, GPT-2's Conv1D weights ([in, out]) are not; q/k/v and gate/up are concatenated
along the output axis so each becomes one matmul.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmx.errors import CheckpointError, InputError
from llmx.spec import ModelSpec, spec_from_hf_config
from llmx.weight_names import layer_weights, model_weights

# (llmx weight role (llmx.weight_names), HF names relative to a layer or the model, how to combine).
# "{i}" is the layer.
_LLAMA = {
    "prefixes": ("model.",),
    "model": [
        ("embed", ["embed_tokens.weight"], "copy"),
        ("norm", ["norm.weight"], "copy"),
    ],
    "head": ("lm_head", ["lm_head.weight"], "transpose"),
    "layer": [
        ("attn_norm", ["input_layernorm.weight"], "copy"),
        ("qkv", ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"], "concat_t"),
        ("qkv_bias", ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"], "concat"),
        ("o", ["self_attn.o_proj.weight"], "transpose"),
        ("o_bias", ["self_attn.o_proj.bias"], "copy"),
        ("mlp_norm", ["post_attention_layernorm.weight"], "copy"),
        ("up", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "concat_t"),
        ("up_bias", ["mlp.gate_proj.bias", "mlp.up_proj.bias"], "concat"),
        ("down", ["mlp.down_proj.weight"], "transpose"),
        ("down_bias", ["mlp.down_proj.bias"], "copy"),
    ],
    "layer_prefix": "layers.{i}.",
}

# GPT-2 stores Conv1D weights as [in, out] already.
_GPT2 = {
    "prefixes": ("transformer.",),
    "model": [
        ("embed", ["wte.weight"], "copy"),
        ("pos_embed", ["wpe.weight"], "copy"),
        ("norm", ["ln_f.weight"], "copy"),
        ("norm_bias", ["ln_f.bias"], "copy"),
    ],
    "head": ("lm_head", ["lm_head.weight"], "transpose"),
    "layer": [
        ("attn_norm", ["ln_1.weight"], "copy"),
        ("attn_norm_bias", ["ln_1.bias"], "copy"),
        ("qkv", ["attn.c_attn.weight"], "copy"),
        ("qkv_bias", ["attn.c_attn.bias"], "copy"),
        ("o", ["attn.c_proj.weight"], "copy"),
        ("o_bias", ["attn.c_proj.bias"], "copy"),
        ("mlp_norm", ["ln_2.weight"], "copy"),
        ("mlp_norm_bias", ["ln_2.bias"], "copy"),
        ("up", ["mlp.c_fc.weight"], "copy"),
        ("up_bias", ["mlp.c_fc.bias"], "copy"),
        ("down", ["mlp.c_proj.weight"], "copy"),
        ("down_bias", ["mlp.c_proj.bias"], "copy"),
    ],
    "layer_prefix": "h.{i}.",
}

# BERT is post-norm: attn_norm/mlp_norm here are the LayerNorms *after* each residual add.
_BERT = {
    "prefixes": ("bert.", "model."),
    "model": [
        ("embed", ["embeddings.word_embeddings.weight"], "copy"),
        ("pos_embed", ["embeddings.position_embeddings.weight"], "copy"),
        ("type_embed", ["embeddings.token_type_embeddings.weight"], "copy"),
        ("embed_norm", ["embeddings.LayerNorm.weight"], "copy"),
        ("embed_norm_bias", ["embeddings.LayerNorm.bias"], "copy"),
    ],
    "head": None,
    "layer": [
        ("qkv", ["attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight"], "concat_t"),
        ("qkv_bias", ["attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias"], "concat"),
        ("o", ["attention.output.dense.weight"], "transpose"),
        ("o_bias", ["attention.output.dense.bias"], "copy"),
        ("attn_norm", ["attention.output.LayerNorm.weight"], "copy"),
        ("attn_norm_bias", ["attention.output.LayerNorm.bias"], "copy"),
        ("up", ["intermediate.dense.weight"], "transpose"),
        ("up_bias", ["intermediate.dense.bias"], "copy"),
        ("down", ["output.dense.weight"], "transpose"),
        ("down_bias", ["output.dense.bias"], "copy"),
        ("mlp_norm", ["output.LayerNorm.weight"], "copy"),
        ("mlp_norm_bias", ["output.LayerNorm.bias"], "copy"),
    ],
    "layer_prefix": "encoder.layer.{i}.",
}

def _llama_with(*rows: tuple[str, list[str], str]) -> dict:
    """Llama's layout with these layer rows added or (same role) replaced."""
    roles = {row[0] for row in rows}
    return {**_LLAMA, "layer": [r for r in _LLAMA["layer"] if r[0] not in roles] + list(rows)}


_QK_NORM = [("q_norm", ["self_attn.q_norm.weight"], "copy"), ("k_norm", ["self_attn.k_norm.weight"], "copy")]
# Gemma 2/3 and OLMo 2 name the norm after attention post_attention_layernorm (Llama's name for the pre-MLP norm).
_POST_NORMS = [("post_attn_norm", ["post_attention_layernorm.weight"], "copy"),
               ("post_mlp_norm", ["post_feedforward_layernorm.weight"], "copy")]
_GEMMA2 = _llama_with(("mlp_norm", ["pre_feedforward_layernorm.weight"], "copy"), *_POST_NORMS)
# Phi-3 stores q/k/v and gate/up fused already, in llmx's order.
_PHI3 = _llama_with(("qkv", ["self_attn.qkv_proj.weight"], "transpose"), ("up", ["mlp.gate_up_proj.weight"], "transpose"))

WEIGHT_RULES_A = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gpt2": _GPT2, "bert": _BERT,
    "qwen3": _llama_with(*_QK_NORM),
    "gemma": _LLAMA,
    "gemma2": _GEMMA2,
    "gemma3_text": {**_GEMMA2, "layer": _GEMMA2["layer"] + _QK_NORM},
    "granite": _LLAMA,
    "olmo2": _llama_with(*_QK_NORM, *_POST_NORMS),
    "smollm3": _LLAMA,
    "phi3": _PHI3,
}

# -- phi, gpt_neox, stablelm, starcoder2, mixtral, qwen3_moe (issue 14) ---------------------
# Extra ways to combine: "{e}" in a name repeats it per expert and stacks the results (experts
# first); "{h}" per q head, "{hk}" per kv head; "heads_q"/"heads_k" repeat one [D] norm weight for
# every head; "neox_qkv(_t)" reorders GPT-NeoX's per-head [q_h k_h v_h] rows into [q | k | v].
_LN = lambda role, hf: [(role, [f"{hf}.weight"], "copy"), (f"{role}_bias", [f"{hf}.bias"], "copy")]  # noqa: E731
_QKV = ["self_attn.q_proj.{}", "self_attn.k_proj.{}", "self_attn.v_proj.{}"]
_PHI = {
    "prefixes": ("model.",),
    "model": [("embed", ["embed_tokens.weight"], "copy"), *_LN("norm", "final_layernorm"),
              ("lm_head_bias", ["lm_head.bias"], "copy")],
    "head": ("lm_head", ["lm_head.weight"], "transpose"),
    "layer": [
        *_LN("attn_norm", "input_layernorm"),
        ("qkv", [n.format("weight") for n in _QKV], "concat_t"),
        ("qkv_bias", [n.format("bias") for n in _QKV], "concat"),
        ("o", ["self_attn.dense.weight"], "transpose"),
        ("o_bias", ["self_attn.dense.bias"], "copy"),
        ("q_norm", ["self_attn.q_layernorm.weight"], "heads_q"),
        ("q_norm_bias", ["self_attn.q_layernorm.bias"], "heads_q"),
        ("k_norm", ["self_attn.k_layernorm.weight"], "heads_k"),
        ("k_norm_bias", ["self_attn.k_layernorm.bias"], "heads_k"),
        ("up", ["mlp.fc1.weight"], "transpose"),
        ("up_bias", ["mlp.fc1.bias"], "copy"),
        ("down", ["mlp.fc2.weight"], "transpose"),
        ("down_bias", ["mlp.fc2.bias"], "copy"),
    ],
    "layer_prefix": "layers.{i}.",
}
_GPT_NEOX = {
    "prefixes": ("gpt_neox.",),
    "model": [("embed", ["embed_in.weight"], "copy"), *_LN("norm", "final_layer_norm")],
    "head": ("lm_head", ["embed_out.weight"], "transpose"),
    "layer": [
        *_LN("attn_norm", "input_layernorm"),
        *_LN("mlp_norm", "post_attention_layernorm"),
        ("qkv", ["attention.query_key_value.weight"], "neox_qkv_t"),
        ("qkv_bias", ["attention.query_key_value.bias"], "neox_qkv"),
        ("o", ["attention.dense.weight"], "transpose"),
        ("o_bias", ["attention.dense.bias"], "copy"),
        ("up", ["mlp.dense_h_to_4h.weight"], "transpose"),
        ("up_bias", ["mlp.dense_h_to_4h.bias"], "copy"),
        ("down", ["mlp.dense_4h_to_h.weight"], "transpose"),
        ("down_bias", ["mlp.dense_4h_to_h.bias"], "copy"),
    ],
    "layer_prefix": "layers.{i}.",
}
_LAYER_NORMED = {  # llama's layout with LayerNorm biases and a plain c_fc/c_proj MLP (starcoder2)
    **_LLAMA,
    "model": [*_LLAMA["model"], ("norm_bias", ["norm.bias"], "copy")],
    "layer": [
        *_LLAMA["layer"][:6],
        *_LN("attn_norm", "input_layernorm")[1:],
        *_LN("mlp_norm", "post_attention_layernorm")[1:],
        ("up", ["mlp.c_fc.weight"], "transpose"),
        ("up_bias", ["mlp.c_fc.bias"], "copy"),
        ("down", ["mlp.c_proj.weight"], "transpose"),
        ("down_bias", ["mlp.c_proj.bias"], "copy"),
    ],
}
_STABLELM = {
    **_LLAMA,
    "model": _LAYER_NORMED["model"],
    "layer": [
        *_LLAMA["layer"], *_LN("attn_norm", "input_layernorm")[1:], *_LN("mlp_norm", "post_attention_layernorm")[1:],
        ("q_norm", ["self_attn.q_layernorm.norms.{h}.weight"], "copy"),
        ("k_norm", ["self_attn.k_layernorm.norms.{hk}.weight"], "copy"),
    ],
}
_MOE = [
    ("router", ["mlp.gate.weight"], "transpose"),
    ("experts_gate_up", ["mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"], "concat_t"),
    ("experts_down", ["mlp.experts.{e}.down_proj.weight"], "transpose"),
]
_QWEN3_MOE = {
    **_LLAMA,
    "layer": [*_LLAMA["layer"], *_MOE, ("q_norm", ["self_attn.q_norm.weight"], "copy"),
              ("k_norm", ["self_attn.k_norm.weight"], "copy")],
}
_MIXTRAL = {
    **_LLAMA,
    "layer": [*_LLAMA["layer"], *[(ours, [n.replace("mlp.", "block_sparse_moe.").replace("gate_proj", "w1")
                                           .replace("up_proj", "w3").replace("down_proj", "w2") for n in names], how)
                                  for ours, names, how in _MOE]],
}

WEIGHT_RULES = {**WEIGHT_RULES_A, "phi": _PHI, "gpt_neox": _GPT_NEOX, "stablelm": _STABLELM,
                "starcoder2": _LAYER_NORMED, "mixtral": _MIXTRAL, "qwen3_moe": _QWEN3_MOE}


@dataclass
class Checkpoint:
    path: Path
    config: dict
    spec: ModelSpec
    weight_files: list[Path]

    # A source other than safetensors/bin files (a GGUF): its tensors by HF name, read lazily.
    reader: Mapping[str, torch.Tensor] | None = None
    # A source that stores weights quantized (a GGUF) keeps them in its own blocks: given a
    # linear weight's [out, in] parts by name, those blocks, or None (see ``iter_weights``).
    stored_blocks: Callable[[list[str]], Any] | None = None

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The weights by their Hugging Face names, each read from disk only when asked for."""
        from llmx.export.tensors import CheckpointTensors

        return self.reader if self.reader is not None else CheckpointTensors(self.weight_files)


def stored_blocks_options(checkpoint: Checkpoint, graphs: str | None, precision: str | None, verify: bool, *,
                          source: str, label: str, quantized: str) -> tuple[str, str]:
    """(graphs, precision) for a source that keeps its weights in its own blocks (a GGUF, a GPTQ/AWQ/...
    checkpoint), ``quantized`` describing its quantization ("" when it has none). No ``precision``:
    its blocks in fused graphs (``label`` names that precision) where the family has fused kernels;
    portable graphs or ``verify``: dequantized to fp32; ``--precision fp32|fp16|bf16``: dequantized;
    w8/w4 of an already quantized source would round twice and are refused. Drops
    ``checkpoint.stored_blocks`` whenever the weights are to be dequantized."""
    from llmx.fused.decoder import check_supported
    from llmx.quant_blocks import BITS

    if precision in BITS and quantized:
        raise InputError(f"this {source} is already quantized ({quantized}); quantizing it again to {precision} "
                         "would round twice: export it as it is (no --precision)")
    if precision is None and graphs != "portable" and not verify and checkpoint.spec.kind == "decoder":
        try:
            check_supported(checkpoint.spec)
        except Exception:  # noqa: BLE001 -- no fused kernel for this family: the traced graphs, dequantized
            if graphs == "fused":
                raise
        else:
            return "fused", label if quantized else "fp32"
    checkpoint.stored_blocks = None  # dequantized: every weight read as float32
    precision = precision or "fp32"
    return graphs or ("fused" if precision in BITS else "portable"), precision


def open_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    spec = spec_from_hf_config(config)
    return Checkpoint(path, config, spec, _weight_files(path))


def _weight_files(path: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{index} is malformed: {exc}") from exc
            missing = [n for n in names if not (path / n).is_file()]
            if missing:
                raise CheckpointError(f"{path} is missing weight shards listed in {index_name}: {', '.join(missing)}")
            return [path / n for n in names]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    raise CheckpointError(f"{path} has no weights (model.safetensors, pytorch_model.bin or a sharded index)")


def read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                tensors.update(load_file(str(file)))
            else:
                tensors.update(torch.load(file, map_location="cpu", weights_only=True))
        except Exception as exc:  # corrupt files raise many exception types
            raise CheckpointError(f"cannot read weights from {file.name}: {str(exc).splitlines()[0]}") from exc
    return tensors


def map_weights(spec: ModelSpec, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensor names -> llmx module names (llmx.weight_names), as float32. Raises on missing tensors."""
    return {name: tensor for _, name, tensor in iter_weights(spec, hf)}


def iter_weights(spec: ModelSpec, hf: Mapping[str, torch.Tensor],
                 stored: Callable[[list[str]], Any] | None = None) -> Iterator[tuple[str, str, Any]]:
    """(role, llmx module name, float32 tensor) of every weight ``spec`` declares: the model's
    weights, then layer by layer, each with the spec's constant factors folded in.

    ``hf`` is read a tensor at a time, only for the weight being made: a lazy mapping (safetensors
    read by header, export/streaming.py) keeps no more than one combined weight in memory.
    The declaration decides which weights the model has: a rule whose weight the spec lacks is
    skipped, a declared weight no rule produces is an error (a half-added family).

    ``stored`` (a pre-quantized source, e.g. a GGUF's blocks): given the full names of a linear
    weight's [out, in] parts, the weight as the source stores it, or None; what it returns is
    yielded in place of the tensor, which is then never read.
    """
    rules = WEIGHT_RULES[spec.family]
    hf = _Stripped(hf, rules["prefixes"])
    declared = model_weights(spec)
    head = [rules["head"]] if rules["head"] and not spec.tie_word_embeddings else []
    tied = "lm_head" in declared and spec.tie_word_embeddings
    _check_rules_cover(spec, {r[0] for r in [*rules["model"], *head]} | ({"lm_head"} if tied else set()),
                       {r[0] for r in rules["layer"]})

    def take(names: list[str], how: str) -> torch.Tensor:
        if repeat := _repeat_key(names, spec):
            key, count = repeat
            return _stack([take([n.replace(key, str(j)) for n in names], how) for j in range(count)], key)
        absent = [n for n in names if n not in hf]
        if absent:
            raise CheckpointError(f"weights are missing tensor {absent[0]!r}")
        parts = [hf[n] for n in names]
        if how in ("transpose", "concat_t") and all(p.dim() == 2 for p in parts):
            return _transposed_fp32(parts)
        parts = [p.to(torch.float32) for p in parts]
        if how in _RESHAPES:
            return _RESHAPES[how](parts[0], spec).contiguous()
        return torch.cat(parts, dim=-1).contiguous() if len(parts) > 1 or parts[0].dim() == 1 else parts[0].contiguous()

    def made(role: str, names: list[str], how: str):
        linear = how in ("transpose", "concat_t") or (how == "copy" and role == "embed")  # rows = outputs
        if stored is not None and linear and not _repeat_key(names, spec) \
                and all(n in hf for n in names):
            if (found := stored([hf.names[n] for n in names])) is not None:
                return _folded_blocks(spec, role, found)
        return _folded(spec, role, take(names, how))

    for role, names, how in [*rules["model"], *head]:
        if role in declared:
            yield role, declared[role], made(role, names, how)
    if tied:  # the unscaled table, transposed
        embed = next(row for row in rules["model"] if row[0] == "embed")
        # Transposed in the checkpoint's dtype, as an untied head is: an fp32 table and its fp32
        # transpose side by side would be Qwen3-4B's 3.1 GB at the export's peak.
        # (made() folds the head's factor in, whether it returns blocks or a tensor)
        head = made("lm_head", embed[1], "transpose") if embed[2] == "copy" else \
            _folded(spec, "lm_head", take(*embed[1:]).t().contiguous())
        yield "lm_head", declared["lm_head"], head
    for i in range(spec.num_layers):
        layer, declared_here = rules["layer_prefix"].format(i=i), layer_weights(spec, i)
        for role, names, how in rules["layer"]:
            if role in declared_here:
                yield role, declared_here[role], made(role, [layer + n for n in names], how)


def _transposed_fp32(parts: list[torch.Tensor]) -> torch.Tensor:
    """[out, in] weights -> one fp32 [in, sum(out)]; empties ``parts``. Rows are stacked and
    transposed in the checkpoint's dtype, then converted once: a bf16 transpose moves half the
    bytes of an fp32 one (0.36 s against 0.48 s for a 14336x4096 weight, 2 cores), and each
    source is dropped as soon as its copy is made (an 8B model's 128256-row head: 3.2 GB held,
    not 4.2)."""
    rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    parts.clear()
    transposed = rows.t().contiguous()
    del rows
    return transposed.to(torch.float32)


def _check_rules_cover(spec: ModelSpec, model_roles: set[str], layer_roles: set[str]) -> None:
    unmapped = [name for role, name in model_weights(spec).items() if role not in model_roles]
    for i in range(spec.num_layers):
        unmapped += [name for role, name in layer_weights(spec, i).items() if role not in layer_roles]
    if unmapped:
        raise CheckpointError(f"internal error: no {spec.family} weight rule gives {unmapped[0]}")


def _folded(spec: ModelSpec, role: str, t: torch.Tensor) -> torch.Tensor:
    """Weight ``role`` with the spec's constant factors applied, so no graph needs a node for them.

    Each is the same single fp32 operation the reference does at run time (Gemma's ``1 + w``
    norms, scaled embeddings) or moves a scalar across a matmul (Granite's multipliers), which
    changes results only by float rounding. Out of place: ``t`` may be the checkpoint's own
    (memory-mapped) tensor.
    """
    with torch.no_grad():
        if spec.norm_offset and spec.norm == "rms" and role.endswith("norm"):
            t = t + spec.norm_offset
        if spec.residual_scale != 1.0 and role in ("o", "o_bias", "down", "down_bias"):
            t = t * spec.residual_scale
        if spec.embed_scale != 1.0 and role == "embed":
            t = t * torch.tensor(spec.embed_scale, dtype=torch.float32)
        if spec.logits_scale != 1.0 and role == "lm_head":
            t = t / spec.logits_scale
    return t


def _folded_blocks(spec: ModelSpec, role: str, blocks):
    """``_folded``'s factors for a weight kept in its source's quantized blocks: a scalar across a
    matmul scales the blocks' scales (the same one float32 operation per scale)."""
    from llmx.quant_blocks import StackedBlocks

    if isinstance(blocks, StackedBlocks):
        return StackedBlocks([_folded_blocks(spec, role, part) for part in blocks.parts])
    if spec.embed_scale != 1.0 and role == "embed":
        blocks = blocks.scaled(lambda a: a * np.float32(spec.embed_scale))
    if spec.residual_scale != 1.0 and role in ("o", "down"):
        blocks = blocks.scaled(lambda a: a * np.float32(spec.residual_scale))
    if spec.logits_scale != 1.0 and role == "lm_head":
        blocks = blocks.scaled(lambda a: a / np.float32(spec.logits_scale))
    return blocks


class _Stripped(Mapping):
    """A checkpoint's tensors under their names without the family's model prefix, read on access."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], prefixes: tuple[str, ...]):
        self.tensors, self.names = tensors, {_strip(name, prefixes): name for name in tensors}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names[name]]

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _repeat_key(names: list[str], spec: ModelSpec) -> tuple[str, int] | None:
    for key, count in (("{e}", spec.num_experts), ("{h}", spec.num_heads), ("{hk}", spec.num_kv_heads)):
        if key in names[0]:
            return key, count
    return None


def _stack(parts: list[torch.Tensor], key: str) -> torch.Tensor:
    # Per-head norm weights become [H,1,D] (llmx's HeadNorm broadcasts them over positions).
    stacked = torch.stack(parts)
    return stacked.unsqueeze(1) if key != "{e}" else stacked


def _neox_qkv(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    # [H*3*D, ...] rows in per-head [q_h k_h v_h] order -> [q | k | v].
    heads, dim = spec.num_heads, spec.head_dim
    return t.reshape(heads, 3, dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


_RESHAPES = {
    "neox_qkv": _neox_qkv,
    "neox_qkv_t": lambda t, spec: _neox_qkv(t, spec).t(),
    "heads_q": lambda t, spec: t.expand(spec.num_heads, 1, -1).clone(),
    "heads_k": lambda t, spec: t.expand(spec.num_kv_heads, 1, -1).clone(),
}


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_model(checkpoint: Checkpoint):
    """Build llmx's Decoder or Encoder for the checkpoint and load its weights (strictly)."""
    reader = checkpoint.reader
    tensors = read_state_dict(checkpoint.weight_files) if reader is None else {name: reader[name] for name in reader}
    return build_model(checkpoint.spec, map_weights(checkpoint.spec, tensors))


def build_model(spec: ModelSpec, weights: dict[str, torch.Tensor]):
    """llmx's Decoder or Encoder for ``spec`` holding ``weights`` (llmx names, checked strictly)."""
    if spec.kind == "encoder":
        from llmx.export.encoder import Encoder as model_class
    else:
        from llmx.export.modules import Decoder as model_class

    # Parameters are built on the meta device and replaced by the mapped tensors themselves
    # (assign=True): a materialized model would hold a second fp32 copy of every weight.
    with parameters_on_meta():
        model = model_class(spec)
    expected = model.state_dict()
    for name, tensor in weights.items():
        if name in expected and tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)}, but config.json implies {tuple(expected[name].shape)}"
            )
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [m for m in missing if m != "inv_freq"]
    if missing or unexpected:
        raise CheckpointError(f"weights do not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get meta parameters; buffers (rotary tables) stay real.

    Accelerate's ``init_empty_weights`` does the same; ``torch.device("meta")`` would also
    move the buffers, which no checkpoint holds.
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    # The modules' own initialisation (normal_, kaiming_uniform_, ...) is skipped on meta
    # parameters: their values are never read, and torch runs these ops on meta tensors through
    # Python reference kernels whose first call imports torch._dynamo (~2 s of a fused export that
    # never traces).
    initializers = {name: getattr(torch.nn.init, name) for name in _INITIALIZERS}

    def unless_meta(initialize):
        return lambda tensor, *args, **kwargs: tensor if tensor.is_meta else initialize(tensor, *args, **kwargs)

    torch.nn.Module.register_parameter = on_meta
    for name, initialize in initializers.items():
        setattr(torch.nn.init, name, unless_meta(initialize))
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
        for name, initialize in initializers.items():
            setattr(torch.nn.init, name, initialize)


_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                 "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")
