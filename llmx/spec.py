"""ModelSpec: the architecture facts llmx needs, read from a Hugging Face ``config.json``.

One table (``FAMILIES``) says how each supported family differs; everything downstream
(torch modules, the ONNX Runtime graph builder, the runtime) reads a ModelSpec and never asks
which family it holds. Torch-free: later stages import it without torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from llmx.errors import CheckpointError

# How each family differs. Keys of the HF config that carry the same fact under other names
# are resolved by ``_get`` below; architecture choices live here.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias"),
    "mistral": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key=None),
    "qwen2": dict(norm="rms", mlp="gated", position="rope", qkv_bias=True, window_switch="use_sliding_window"),
    "qwen3": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias", qk_norm="head",
                  window_switch="use_sliding_window"),
    "gemma": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias", gemma=True),
    "gemma2": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias", gemma=True, post_norms=True),
    "gemma3_text": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias", gemma=True,
                        post_norms=True, qk_norm="head"),
    "granite": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias", granite=True),
    "olmo2": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias", qk_norm="full",
                  pre_norms=False, post_norms=True),
    "smollm3": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias",
                    window_switch="use_sliding_window"),
    "phi3": dict(norm="rms", mlp="gated", position="rope"),
    "gpt2": dict(norm="layer", mlp="plain", position="learned", qkv_bias=True, o_bias=True, mlp_bias=True),
    # Encoders: post-norm blocks, token types, bidirectional attention, pooled output.
    "bert": dict(kind="encoder", norm="layer", mlp="plain", position="learned", qkv_bias=True, o_bias=True, mlp_bias=True),
    # -- parallel blocks, partial rotary, per-head q/k LayerNorm, sparse MoE (issue 14) --------
    "phi": dict(norm="layer", mlp="plain", position="rope", qkv_bias=True, o_bias=True, mlp_bias=True,
                lm_head_bias=True, parallel="shared_norm", qk_norm_key="qk_layernorm", qk_norm_bias=True),
    "gpt_neox": dict(norm="layer", mlp="plain", position="rope", qkv_bias_key="attention_bias", mlp_bias=True,
                     parallel_key="use_parallel_residual", parallel="two_norms"),
    "stablelm": dict(norm="layer", mlp="gated", position="rope", qkv_bias_key="use_qkv_bias", o_bias_key=None,
                     parallel_key="use_parallel_residual", parallel="shared_norm", parallel_default=False,
                     qk_norm_key="qk_layernorm"),
    "starcoder2": dict(norm="layer", mlp="plain", position="rope", qkv_bias_key="use_bias", mlp_bias_key="use_bias"),
    "mixtral": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key=None, moe="renormalized"),
    "qwen3_moe": dict(norm="rms", mlp="gated", position="rope", qkv_bias_key="attention_bias", qk_norm="head", moe="norm_topk_prob"),
}

# HF activation names -> the ones llmx implements.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm: str  # "rms" | "layer"
    norm_eps: float
    activation: str  # "silu" | "gelu" | "gelu_tanh" | "relu"
    mlp: str  # "gated" (SwiGLU-style) | "plain"
    position: str  # "rope" | "learned"
    rope: dict[str, Any] = field(default_factory=dict)  # rope_type, rope_theta, scaling params
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    attention_scales: list[float] = field(default_factory=list)  # per layer, multiplies q·k
    sliding_window: int | None = None
    sliding_layers: list[bool] = field(default_factory=list)  # which layers use the window
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    kind: str = "decoder"  # "decoder" | "encoder"
    type_vocab_size: int = 0  # encoders: token type (segment) embeddings
    pooling: str | None = None  # encoders: "mean" | "cls" | "max" | "mean_sqrt_len"
    normalize: bool = False  # encoders: L2-normalize the pooled embedding
    max_input_tokens: int | None = None  # encoders: inputs are truncated to this (sentence-transformers)
    # -- parallel blocks, partial rotary, per-head q/k norm, sparse MoE (issue 14) ------------
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) instead of two residual steps
    shared_block_norm: bool = False  # parallel blocks whose MLP reads the attention's norm (no mlp_norm)
    rotary_dim: int | None = None  # rotary on the first rotary_dim of each head; None: the whole head
    # qk_norm (below) "layer_head": LayerNorm over each head's q and k, one weight per head (phi, stablelm)
    qk_norm_bias: bool = False  # the "layer_head" q/k norm has a bias (phi)
    lm_head_bias: bool = False
    num_experts: int = 0  # > 0: sparse MoE MLPs (router softmax, top-k experts)
    experts_per_token: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    moe_intermediate_size: int = 0
    sparse_layers: list[bool] = field(default_factory=list)  # which layers' MLPs are MoE

    # -- Qwen3, Gemma 1/2/3, Granite, OLMo 2, SmolLM3, Phi-3 (issue 14) ------------------------
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (over head_dim) | "full" (over q/kv width)
    pre_norms: bool = True  # a norm before attention and before the MLP (OLMo 2 has none)
    post_norms: bool = False  # a norm on attention's and the MLP's output before the residual add
    attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_local: dict[str, Any] = field(default_factory=dict)  # RoPE of sliding-window layers, when it differs
    rope_layers: list[bool] = field(default_factory=list)  # which layers apply RoPE; empty: all of them
    # Applied to the weights by the loader (export/checkpoint.py), so no graph needs a node for them:
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w) (Gemma: 1)
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(hidden), Granite: embedding_multiplier)
    residual_scale: float = 1.0  # attention and MLP outputs multiplied by it (Granite)
    logits_scale: float = 1.0  # logits divided by it (Granite's logits_scaling)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _get(cfg: dict, *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _rope_params(cfg: dict) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "longrope":
        params.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return params


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    """Translate a HF config dict into a ModelSpec, or raise CheckpointError naming what is supported."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        arch = ", ".join(cfg.get("architectures") or []) or model_type
        raise CheckpointError(
            f"model type {model_type!r} ({arch}) is not supported; supported families: {', '.join(FAMILIES)}"
        )
    fam = FAMILIES[model_type]
    try:
        hidden = int(_get(cfg, "hidden_size", "n_embd"))
        heads = int(_get(cfg, "num_attention_heads", "n_head"))
        layers = int(_get(cfg, "num_hidden_layers", "n_layer"))
        head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
        act_name = _get(cfg, "hidden_act", "hidden_activation", "activation_function", default="silu")
        if act_name not in ACTIVATIONS:
            raise CheckpointError(f"activation {act_name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        spec = ModelSpec(
            family=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
            head_dim=head_dim,
            intermediate_size=int(_get(cfg, "intermediate_size", "n_inner", default=4 * hidden)),
            max_position_embeddings=int(_get(cfg, "max_position_embeddings", "n_positions")),
            norm=fam["norm"],
            norm_eps=float(_get(cfg, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon", default=1e-5)),
            activation=ACTIVATIONS[act_name],
            mlp=fam["mlp"],
            position=fam["position"],
            qkv_bias=bool(fam.get("qkv_bias") or (fam.get("qkv_bias_key") and cfg.get(fam["qkv_bias_key"]))),
            o_bias=bool(fam.get("o_bias") or _flag(cfg, fam.get("o_bias_key", fam.get("qkv_bias_key")))),
            mlp_bias=bool(fam.get("mlp_bias") or cfg.get(fam.get("mlp_bias_key", "mlp_bias"), False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gpt2")) and fam.get("kind") != "encoder",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"),
            kind=fam.get("kind", "decoder"),
            type_vocab_size=int(cfg.get("type_vocab_size", 0)),
        )
    except KeyError as exc:
        raise CheckpointError(f"config.json lacks {exc}, which {model_type} models need") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json has a malformed value: {exc}") from exc

    if spec.position == "rope":
        spec.rope = _rope_params(cfg)
    _family_features(spec, cfg, fam)
    _parallel_rotary_qk_norm(spec, fam, cfg)
    _sparse_moe(spec, fam, cfg)
    if spec.num_heads % spec.num_kv_heads:
        raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")

    scale = 1.0 / math.sqrt(float(cfg.get("query_pre_attn_scalar") or spec.head_dim))
    if fam.get("granite"):
        scale = float(cfg.get("attention_multiplier", scale))
    if model_type == "gpt2":
        if not cfg.get("scale_attn_weights", True):
            scale = 1.0
        by_layer = cfg.get("scale_attn_by_inverse_layer_idx", False)
        spec.attention_scales = [scale / (i + 1) if by_layer else scale for i in range(layers)]
    else:
        spec.attention_scales = [scale] * layers

    window = cfg.get("sliding_window")
    if fam.get("window_switch") and not cfg.get(fam["window_switch"], False):
        window = None
    if window:
        spec.sliding_window = int(window)
        types = cfg.get("layer_types")
        spec.sliding_layers = [t == "sliding_attention" for t in types] if types else [True] * layers
    return spec



def _flag(cfg: dict, key: str | None) -> bool:
    return bool(key and cfg.get(key))


def _parallel_rotary_qk_norm(spec: ModelSpec, fam: dict, cfg: dict) -> None:
    """Parallel attention + MLP, partial rotary, q/k norm and an LM head bias (phi, gpt_neox, stablelm)."""
    if fam.get("parallel") and (fam.get("parallel_key") is None or cfg.get(fam["parallel_key"], fam.get("parallel_default", True))):
        spec.parallel_residual = True
        spec.shared_block_norm = fam["parallel"] == "shared_norm"
    if spec.position == "rope":
        factor = _get(spec.rope, "partial_rotary_factor", default=_get(cfg, "partial_rotary_factor", "rotary_pct", default=1.0))
        spec.rotary_dim = int(spec.head_dim * float(factor)) if float(factor) != 1.0 else None
        if spec.rotary_dim is not None and (spec.rotary_dim % 2 or spec.rotary_dim <= 0):
            raise CheckpointError(f"partial rotary over {spec.rotary_dim} of {spec.head_dim} dims: needs an even, positive count")
    if _flag(cfg, fam.get("qk_norm_key")):
        spec.qk_norm = "layer_head"
        spec.qk_norm_bias = bool(fam.get("qk_norm_bias"))
    spec.lm_head_bias = bool(fam.get("lm_head_bias"))


def _sparse_moe(spec: ModelSpec, fam: dict, cfg: dict) -> None:
    """Sparse MoE MLPs: which layers are sparse (``mlp_only_layers``, ``decoder_sparse_step``), top-k, renormalizing."""
    if not fam.get("moe"):
        return
    spec.num_experts = int(_get(cfg, "num_local_experts", "num_experts"))
    spec.experts_per_token = int(cfg["num_experts_per_tok"])
    # Mixtral always renormalizes; qwen3_moe follows its config (transformers' default: no).
    spec.norm_topk_prob = fam["moe"] == "renormalized" or bool(cfg.get("norm_topk_prob", False))
    spec.moe_intermediate_size = int(_get(cfg, "moe_intermediate_size", default=spec.intermediate_size))
    dense, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step", 1) or 1)
    spec.sparse_layers = [i not in dense and (i + 1) % step == 0 for i in range(spec.num_layers)]
    if not 0 < spec.experts_per_token <= spec.num_experts:
        raise CheckpointError(f"num_experts_per_tok {spec.experts_per_token} must be between 1 and {spec.num_experts}")


def _family_features(spec: ModelSpec, cfg: dict, fam: dict[str, Any]) -> None:
    """The issue-14 features: q/k norm, norm placement, soft-capping, per-layer RoPE, multipliers."""
    spec.qk_norm = fam.get("qk_norm")
    spec.pre_norms = fam.get("pre_norms", True)
    spec.post_norms = fam.get("post_norms", False)
    spec.attn_softcap = cfg.get("attn_logit_softcapping")
    spec.final_softcap = cfg.get("final_logit_softcapping")
    if spec.position == "rope" and "full_attention" in spec.rope:  # per layer type (Gemma 3)
        by_type = {**cfg.get("rope_parameters", {})}
        spec.rope = _rope_params({**cfg, "rope_parameters": by_type["full_attention"]})
        spec.rope_local = _rope_params({**cfg, "rope_parameters": by_type.get("sliding_attention") or by_type["full_attention"]})
    elif spec.position == "rope" and cfg.get("rope_local_base_freq"):  # older Gemma 3 configs
        spec.rope_local = {**spec.rope, "rope_type": "default", "rope_theta": float(cfg["rope_local_base_freq"])}
    if cfg.get("no_rope_layers") is not None:  # 1 = the layer applies RoPE (SmolLM3)
        spec.rope_layers = [bool(v) for v in cfg["no_rope_layers"]]
    if fam.get("gemma"):
        spec.norm_offset = 1.0
        spec.embed_scale = math.sqrt(spec.hidden_size)
    if fam.get("granite"):
        spec.embed_scale = float(cfg.get("embedding_multiplier", 1.0))
        spec.residual_scale = float(cfg.get("residual_multiplier", 1.0))
        spec.logits_scale = float(cfg.get("logits_scaling", 1.0))
