"""GGUF architectures (``general.architecture``) as llmx families: tensor names, metadata, layout.

Each row says how llama.cpp's ``convert_hf_to_gguf.py`` (and its ``conversion/`` model classes)
wrote a Hugging Face checkpoint, so the file reads back as that checkpoint (same tensor names
and values, the config keys llmx's ``ModelSpec`` reads) and goes through the same table as a
checkpoint directory:

- ``tensors``: GGUF tensor names -> HF names, over ``base`` (Llama's; "{i}": the layer; None:
  not in this family). "{e}" in an HF name: the GGUF tensor stacks those tensors along its first
  axis (MoE experts, StableLM's per-head q/k norms); each HF name reads its slice.
- ``permuted``: llama.cpp runs the family with interleaved ("normal") RoPE, so its converter
  permuted the q/k rows (``LlamaModel.permute``); HF's rotate_half wants halves, so the rows are
  put back (as transformers' GGUF loader does). Families llama.cpp runs with NeoX RoPE keep
  HF's order.
- ``norm_offset``: the converter stored ``w + offset`` for every ``*norm.weight`` (Gemma's
  ``1 + w`` RMSNorm); it is subtracted back. ``transposed``: tensors stored transposed (GPT-2's
  Conv1D weights, written [out, in]). Neither touches a linear weight kept in its quantized
  blocks (``GGUFTensors.stored_blocks`` dequantizes anything transformed).
- ``config``: HF config keys read from ``{arch}.<key>`` metadata beyond the shared ones;
  ``extra``: the keys that need a computation (below, one function per family).

What each architecture is, and what its file does not say (llama.cpp assumes it too):

====================  =============  ==========================================================
GGUF architecture     HF model_type  how it reads
====================  =============  ==========================================================
llama                 llama          q/k (and biases) unpermuted. Mistral, SmolLM/SmolLM2 are
                      mixtral        written as llama too; with ``expert_count``: Mixtral
                                     (ffn_*_exps [experts, ff, hidden] sliced per expert).
                                     ``rope_freqs.weight`` (Llama 3.1/3.2): the llama3 rope
                                     parameters recovered from the factors (``llama3_rope``).
qwen2, qwen3          qwen2, qwen3   as written (NeoX RoPE); qwen3's q/k norms.
qwen3moe              qwen3_moe      experts sliced; llama.cpp always renormalizes the top-k
                                     weights (norm_topk_prob true); layers without a router are
                                     dense (mlp_only_layers).
gemma, gemma2,        gemma,         norms stored as 1 + w; gemma2/3 post norms, soft-caps,
gemma3                gemma2,        sliding window. Not in the file, as llama.cpp assumes:
                      gemma3_text    query_pre_attn_scalar = head_dim (hidden / heads for the
                                     27B layer counts, 46 and 62 layers), sliding layers every
                                     2nd (gemma2) / all but every 6th (gemma3) unless
                                     ``attention.sliding_window_pattern`` says; gemma3's local
                                     layers use ``rope.freq_base_swa`` without scaling.
phi3                  phi3           fused qkv_proj and gate_up_proj; LongRoPE from the
                                     rope_factors_long/short tensors.
granite               granite        q/k unpermuted; the four multipliers from attention.scale,
                                     embedding_scale, residual_scale, logit_scale.
olmo2                 olmo2          post norms, q/k norms over the whole projection.
smollm3               smollm3        q/k unpermuted; RoPE skipped on every 4th layer (llama.cpp's
                                     fixed interval: the HF interval is not in the file).
starcoder2            starcoder2     LayerNorm, biases, c_fc/c_proj; no sliding window (not
                                     written, not applied by llama.cpp).
stablelm              stablelm       LayerNorm, partial rotary, parallel residual flag; per-head
                                     q/k norms stacked [heads, head_dim].
phi2                  phi            LayerNorm, biases, partial rotary, head bias (no q/k norms:
                                     llama.cpp's converter cannot write them).
gpt2                  gpt2           learned positions; Conv1D weights transposed back.
====================  =============  ==========================================================

Layer norm families read ``attention.layer_norm_epsilon``, the others
``attention.layer_norm_rms_epsilon``. Intermediate sizes come from the metadata except for
phi2 and gpt2, whose converters write 4 * hidden whatever the checkpoint had: there the
ffn_up tensor's shape says.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmx.errors import CheckpointError

# GGUF -> HF names every Llama-style family shares.
LLAMA_TENSORS = {
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
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate.bias": "model.layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.down_proj.bias",
}
QK_NORMS = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
POST_NORMS = {
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Gemma 2/3: ffn_norm is the pre-MLP norm, HF's post_attention_layernorm a post norm.
GEMMA2_TENSORS = {"blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight", **POST_NORMS}
MIXTRAL_TENSORS = {
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
}
QWEN3_MOE_TENSORS = {
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    **QK_NORMS,
}
PHI3_TENSORS = {
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
}
_LAYER_NORM_BIASES = {
    "output_norm.bias": "model.norm.bias",
    "blk.{i}.attn_norm.bias": "model.layers.{i}.input_layernorm.bias",
    "blk.{i}.ffn_norm.bias": "model.layers.{i}.post_attention_layernorm.bias",
}
STARCODER2_TENSORS = {
    **_LAYER_NORM_BIASES,
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.c_fc.weight",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.c_fc.bias",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.c_proj.weight",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.c_proj.bias",
}
STABLELM_TENSORS = {
    **_LAYER_NORM_BIASES,
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_layernorm.norms.{e}.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_layernorm.norms.{e}.weight",
}
PHI2_TENSORS = {
    "output_norm.weight": "model.final_layernorm.weight",
    "output_norm.bias": "model.final_layernorm.bias",
    "output.bias": "lm_head.bias",
    "blk.{i}.attn_norm.bias": "model.layers.{i}.input_layernorm.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.dense.weight",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.dense.bias",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.fc1.weight",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.fc1.bias",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.fc2.weight",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.fc2.bias",
}
GPT2_TENSORS = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
    **{f"blk.{{i}}.{ours}.{kind}": f"transformer.h.{{i}}.{theirs}.{kind}"
       for ours, theirs in [("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"),
                            ("ffn_norm", "ln_2"), ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj")]
       for kind in ("weight", "bias")},
}

Config = dict[str, Any]


@dataclass(frozen=True)
class Arch:
    family: str  # the HF model_type llmx's ModelSpec table reads
    permuted: bool = False
    tensors: dict[str, str | None] = field(default_factory=dict)
    config: dict[str, str] = field(default_factory=dict)  # HF key -> GGUF key after "{arch}."
    hidden_act: str = "silu"
    norm: str = "rms"  # "rms" | "layer": which epsilon the file holds
    norm_offset: float = 0.0  # stored norm weights are HF's + this
    transposed: frozenset[str] = frozenset()  # GGUF names ("blk.{i}.x.weight") stored as HF's transpose
    extra: Callable[[Any, Config], None] | None = None  # (GGUFSource, config) -> the computed keys
    base: dict[str, str] = field(default_factory=lambda: LLAMA_TENSORS)
    config_tensors: tuple[str, ...] = ()  # tensors that are config (rope factors), not weights
    moe_family: str | None = None  # the model_type when the file has experts (llama -> mixtral)

    def tensor_names(self) -> dict[str, str]:
        return {k: v for k, v in {**self.base, **self.tensors}.items() if v is not None}

    def undo(self, pattern: str, hf: str, array: np.ndarray) -> np.ndarray:
        """The converter's per-tensor change to ``hf`` (GGUF name ``pattern``) undone."""
        if self.norm_offset and hf.endswith("norm.weight"):
            array = array - np.float32(self.norm_offset)
        if pattern in self.transposed:
            array = array.T
        return array

    def changes(self, pattern: str, hf: str) -> bool:
        return bool(self.norm_offset and hf.endswith("norm.weight")) or pattern in self.transposed


# -- the keys that need a computation ------------------------------------------------------------

def _key(source, key: str, default: Any = None) -> Any:
    return source.field(f"{source.architecture}.{key}", default)


def _layers(cfg: Config) -> range:
    return range(cfg["num_hidden_layers"])


def _head_dim(cfg: Config) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _partial_rotary(source, cfg: Config) -> None:
    """rope.dimension_count over the head as HF's partial_rotary_factor (in the rope dict, where
    transformers 5 configs keep it)."""
    dims = _key(source, "rope.dimension_count", _head_dim(cfg))
    cfg.setdefault("rope_scaling", {})["partial_rotary_factor"] = int(dims) / _head_dim(cfg)


def _ffn_from_tensor(source, cfg: Config) -> None:
    """The converter wrote 4 * hidden as feed_forward_length (phi2, gpt2): ffn_up's rows say."""
    cfg["intermediate_size"] = int(source.tensors["blk.0.ffn_up.weight"].shape[-1])


def _sliding_layers(source, cfg: Config, pattern: int) -> list[str]:
    """HF layer_types as llama.cpp's ``load_swa_pattern`` decides them: the file's
    attention.sliding_window_pattern (per-layer flags or a period), else the family's period."""
    found = _key(source, "attention.sliding_window_pattern")
    if isinstance(found, list):
        sliding = [bool(v) for v in found]
    else:
        n = int(found) if found is not None else pattern
        sliding = [n == 0 or i % n < n - 1 for i in _layers(cfg)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma_scalar(cfg: Config, big_layers: int) -> float:
    """llama.cpp's attention scale for Gemma 2/3 (not in the file): 1/sqrt(head_dim), but
    1/sqrt(hidden / heads) for the 27B models, which it tells by their layer count."""
    if cfg["num_hidden_layers"] == big_layers:
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return _head_dim(cfg)


def _gemma2(source, cfg: Config) -> None:
    cfg["query_pre_attn_scalar"] = _gemma_scalar(cfg, 46)
    cfg.setdefault("sliding_window", 4096)  # llama.cpp's default for Gemma 2
    cfg["layer_types"] = _sliding_layers(source, cfg, 2)
    if (local := _key(source, "rope.freq_base_swa")) is not None and float32_decimal(local) != cfg["rope_theta"]:
        raise CheckpointError("GGUF gemma2 has a local rope base of its own, which HF Gemma 2 cannot express")


def _gemma3(source, cfg: Config) -> None:
    cfg["query_pre_attn_scalar"] = _gemma_scalar(cfg, 62)
    if cfg.get("sliding_window"):
        cfg["layer_types"] = _sliding_layers(source, cfg, 6)
    else:
        cfg.pop("sliding_window", None)
    full = {"rope_type": "default", **cfg.pop("rope_scaling", {}), "rope_theta": cfg["rope_theta"]}
    local = {"rope_type": "default", "rope_theta": float32_decimal(_key(source, "rope.freq_base_swa", 10000.0))}
    cfg["rope_parameters"] = {"full_attention": full, "sliding_attention": local}


def _phi3(source, cfg: Config) -> None:
    _partial_rotary(source, cfg)
    rope = cfg["rope_scaling"]
    if (original := _key(source, "rope.scaling.original_context_length")) is not None:
        rope["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in source.tensors:
        rope["rope_type"] = "longrope"
        for kind in ("long", "short"):
            rope[f"{kind}_factor"] = [float32_decimal(v) for v in source.float32(f"rope_factors_{kind}.weight")]
        factor = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
        default = math.sqrt(1 + math.log(factor) / math.log(rope["original_max_position_embeddings"])) if factor > 1 else 1.0
        written = _key(source, "rope.scaling.attn_factor")
        if written is not None and abs(written - default) > 1e-6 * default:
            rope["attention_factor"] = float32_decimal(written)
    window = cfg.pop("sliding_window", None)
    cfg["sliding_window"] = int(window) if window else None  # 0: none (Phi-4)


def _smollm3(source, cfg: Config) -> None:
    # llama.cpp's smollm3 skips RoPE on every 4th layer (n_no_rope_layer_step); the file does not say.
    cfg["no_rope_layer_interval"] = 4
    cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in _layers(cfg)]


def _olmo2(source, cfg: Config) -> None:
    if cfg.get("sliding_window"):  # OLMo 3 files
        cfg["layer_types"] = _sliding_layers(source, cfg, 4)
    else:
        cfg.pop("sliding_window", None)


def _starcoder2(source, cfg: Config) -> None:
    cfg["use_bias"] = "blk.0.attn_output.bias" in source.tensors


def _stablelm(source, cfg: Config) -> None:
    _partial_rotary(source, cfg)
    cfg["use_qkv_bias"] = "blk.0.attn_q.bias" in source.tensors
    cfg["qk_layernorm"] = "blk.0.attn_q_norm.weight" in source.tensors
    cfg["use_parallel_residual"] = bool(_key(source, "use_parallel_residual", True))


def _phi2(source, cfg: Config) -> None:
    _partial_rotary(source, cfg)
    _ffn_from_tensor(source, cfg)


def _qwen3_moe(source, cfg: Config) -> None:
    cfg["norm_topk_prob"] = True  # llama.cpp's qwen3moe always renormalizes the top-k weights
    cfg["mlp_only_layers"] = [i for i in _layers(cfg) if f"blk.{i}.ffn_gate_inp.weight" not in source.tensors]


# Mistral and SmolLM/SmolLM2 GGUFs are written as "llama" (their HF configs read as llama too).
ARCHITECTURES = {
    "llama": Arch("llama", permuted=True, tensors=MIXTRAL_TENSORS, moe_family="mixtral"),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3", tensors=QK_NORMS),
    "qwen3moe": Arch("qwen3_moe", tensors=QWEN3_MOE_TENSORS, extra=_qwen3_moe),
    "gemma": Arch("gemma", hidden_act="gelu_pytorch_tanh", norm_offset=1.0),
    "gemma2": Arch("gemma2", tensors=GEMMA2_TENSORS, hidden_act="gelu_pytorch_tanh", norm_offset=1.0, extra=_gemma2,
                   config={"attn_logit_softcapping": "attn_logit_softcapping",
                           "final_logit_softcapping": "final_logit_softcapping",
                           "sliding_window": "attention.sliding_window"}),
    "gemma3": Arch("gemma3_text", tensors={**GEMMA2_TENSORS, **QK_NORMS}, hidden_act="gelu_pytorch_tanh",
                   norm_offset=1.0, extra=_gemma3,
                   config={"final_logit_softcapping": "final_logit_softcapping",
                           "sliding_window": "attention.sliding_window"}),
    "phi3": Arch("phi3", tensors={**PHI3_TENSORS, **{k: None for k in ("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight",
                                                                      "blk.{i}.attn_v.weight", "blk.{i}.ffn_gate.weight")}},
                 config={"sliding_window": "attention.sliding_window"}, extra=_phi3,
                 config_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
    "granite": Arch("granite", permuted=True,
                    config={"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
                            "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}),
    "olmo2": Arch("olmo2", tensors={**POST_NORMS, **QK_NORMS, "blk.{i}.attn_norm.weight": None, "blk.{i}.ffn_norm.weight": None},
                  config={"sliding_window": "attention.sliding_window"}, extra=_olmo2),
    "smollm3": Arch("smollm3", permuted=True, extra=_smollm3),
    "starcoder2": Arch("starcoder2", tensors=STARCODER2_TENSORS, norm="layer", hidden_act="gelu_pytorch_tanh",
                       extra=_starcoder2),
    "stablelm": Arch("stablelm", tensors=STABLELM_TENSORS, norm="layer", extra=_stablelm),
    "phi2": Arch("phi", tensors=PHI2_TENSORS, norm="layer", hidden_act="gelu_new", extra=_phi2),
    "gpt2": Arch("gpt2", base=GPT2_TENSORS, norm="layer", hidden_act="gelu_new", extra=_ffn_from_tensor,
                 transposed=frozenset(f"blk.{{i}}.{n}.weight" for n in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"))),
}


# -- Llama 3's rope_freqs.weight -------------------------------------------------------------

def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter writes as rope_freqs.weight for HF's llama3
    rope parameters (``LlamaModel.generate_extra_tensors``, the same float32 operations)."""
    import torch

    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen, high_wavelen = original / low, original / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def llama3_rope(factors: np.ndarray, theta: float, dim: int) -> Config | None:
    """HF's llama3 rope_scaling from the factors llama.cpp stored, or None when every factor is 1.

    Low frequencies get ``factor``, high ones 1, those between 1 / ((1 - s) / factor + s) with
    s = (original / wavelength - low) / (high - low): linear in 1 / wavelength, so two of them
    give the line and with it ``high`` and ``original`` once ``low`` is fixed. The factors cannot
    tell (original, low, high) from (k original, k low, k high) (transformers computes the same
    frequencies from both), so ``low_freq_factor`` is taken as 1, as every Llama 3.x has it; with
    a single frequency between the bands ``high_freq_factor`` is taken as 4 (Llama 3.x's) too.
    Whatever is recovered must give back the stored factors to float32 precision, else refused.
    """
    stored = np.asarray(factors, dtype=np.float64)
    if np.all(stored == 1.0):
        return None
    factor = float(stored.max())
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64))
    inverse_wavelen = freqs / (2 * math.pi)
    between = (stored > 1 + 1e-6) & (stored < factor * (1 - 1e-6))
    keep = 1 - 1 / factor  # 1 / f = 1 / factor + keep * s
    if between.sum() >= 2:
        slope, intercept = np.polyfit(inverse_wavelen[between], 1 / stored[between], 1)
        high = 1 + keep / (1 / factor - intercept)
        original = slope * (high - 1) / keep
        high = round(high, 3)
    elif between.sum() == 1:
        high, j = 4.0, int(np.flatnonzero(between)[0])
        smooth = (1 / stored[j] - 1 / factor) / keep
        original = (smooth * (high - 1) + 1) / inverse_wavelen[j]
    else:
        original = high = math.nan
    if math.isfinite(original) and math.isfinite(high) and high > 1:
        rope = {"rope_type": "llama3", "factor": float32_decimal(factor), "low_freq_factor": 1.0,
                "high_freq_factor": float(high), "original_max_position_embeddings": int(round(original))}
        again = llama3_factors(theta, dim, rope["factor"], 1.0, rope["high_freq_factor"],
                               rope["original_max_position_embeddings"])
        if again.shape == stored.shape and np.allclose(again, stored, rtol=1e-6, atol=0):
            return rope
    raise CheckpointError("GGUF rope_freqs.weight holds rope factors that no llama3 rope scaling (factor, "
                          "low/high_freq_factor, original_max_position_embeddings) reproduces; not supported")


def float32_decimal(value: float) -> float:
    # GGUF stores float32: 1e-6 reads back as 9.99999997e-07. The shortest decimal that is the
    # same float32 is the value the checkpoint had.
    return float(str(np.float32(value)))
