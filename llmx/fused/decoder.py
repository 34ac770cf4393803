"""The optimized prefill and decode graphs, written from a ModelSpec with ONNX Runtime's fused ops.

Same inputs and outputs as the exported (portable) graphs, so the runtime never asks which
kind it holds; per layer the work is a handful of kernels instead of ~60 small ops:

    [Skip]SimplifiedLayerNormalization   residual add + RMSNorm in one pass (LayerNorm: [Skip]LayerNormalization)
    MatMul qkv                           q, k and v in one weight read (already fused by export)
    GroupQueryAttention                  rotary, KV-cache write at slot == position, attention
    MatMul o -> SkipNorm -> MatMul up -> activation (gate * up) -> MatMul down

Decode binds past and present to one buffer; GroupQueryAttention writes the new keys/values
at slot ``seqlens_k`` (= position, because a row's cache is filled from slot 0) and reads the
first ``seqlens_k + 1`` slots, so a step costs the same at any capacity. The graph derives
``seqlens_k = sum(attention_mask) - 1`` and ``total_sequence_length = attention_mask.shape[1]``,
which assumes what the runtime always passes: each row's mask is a prefix of ones.

Prefill applies rotary with RotaryEmbedding (it reads every token's position_ids, so left
padding works) and masks padding with an additive bias; keys are stored after rotary, as in
the portable graphs, so both kinds of graph share one cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmx import logits_to_keep
from llmx.errors import ArtifactError
from llmx.rope import cos_sin_tables, inv_freq_and_scale, long_context_threshold, rope_table
from llmx.spec import ModelSpec
from llmx.artifact.manifest import GraphSpec
from llmx.weight_names import graph_name, layer_weights, model_weights
from llmx.fused.embedding import gather_blocks, gather_from_head, scaled_lookup
from llmx.fused.graph import MS_DOMAIN, GraphBuilder
from llmx.fused.moe import check_moe_supported, moe_layer
from llmx.fused.weights import WeightSource

INT32 = 6  # onnx.TensorProto.INT32
BOOL = 9
MASKED = float(np.finfo(np.float32).min)  # what the portable graphs fill masked scores with

# activation -> (op, domain, attributes); gated MLPs multiply act(gate) by up.
ACTIVATIONS = {
    "silu": ("QuickGelu", MS_DOMAIN, {"alpha": 1.0}),  # x * sigmoid(alpha * x)
    "gelu": ("Gelu", MS_DOMAIN, {}),
    "gelu_tanh": ("FastGelu", MS_DOMAIN, {}),  # 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
    "relu": ("Relu", "", {}),
}


@dataclass
class Context:
    """What every layer of one graph shares."""

    g: GraphBuilder
    spec: ModelSpec
    w: WeightSource
    kind: str  # "prefill" | "decode"
    seqlens_k: str
    total_len: str
    rotary: dict[str, tuple[str, str, str]]  # rope table -> (cos cache, sin cache, positions to read it at)
    attention_bias: str | None  # prefill only: padding mask as an additive bias


def check_supported(spec: ModelSpec) -> None:
    """Refuse what the fused kernels cannot do, before anything is written."""
    if spec.head_dim % 16:
        raise ArtifactError(
            f"head_dim {spec.head_dim} is not a multiple of 16, which ONNX Runtime's GroupQueryAttention needs; "
            "use the exported artifact as is"
        )
    if spec.activation not in ACTIVATIONS:
        raise ArtifactError(f"activation {spec.activation!r} has no fused kernel here")
    check_moe_supported(spec, ACTIVATIONS[spec.activation])
    if spec.norm != "rms" and (spec.qk_norm in ("head", "full") or spec.post_norms):
        # The fused blocks for q/k norm and post-norms are RMSNorm (SimplifiedLayerNormalization) only.
        feature = "q/k norm" if spec.qk_norm else "post-norms"
        raise ArtifactError(f"{feature} with LayerNorm has no fused block here; use the exported artifact as is")


def build_graph(spec: ModelSpec, w: WeightSource, kind: str, io: GraphSpec, all_logits: bool = False):
    """The optimized ``kind`` graph with exactly the inputs and outputs described by ``io``."""
    g = GraphBuilder(f"llmx_{kind}")
    for t in io.inputs:
        g.input(t.name, t.dtype, t.shape)
    for t in io.outputs:
        g.output(t.name, t.dtype, t.shape)
    ctx = _context(g, spec, w, kind)
    names = _names(model_weights(spec))
    from_head = getattr(w, "lookup_from_head", False)  # a tied table, stored once as the head (export/streaming.py)
    if (table := getattr(w, "gathered", {}).get(names["embed"])) is not None:  # in blocks: a GGUF's, or the head's
        x = gather_blocks(g, table, "input_ids")
    elif from_head:
        x = gather_from_head(g, g.weight(w.get(names["lm_head"])), "input_ids")
    else:
        x = g.op1("Gather", [g.weight(w.get(names["embed"])), "input_ids"])
    if from_head:
        x = scaled_lookup(g, x, spec.embed_scale)
    if spec.position == "learned":
        skip = g.op1("Gather", [g.weight(w.get(names["pos_embed"])), "position_ids"])
    else:
        skip = None
    residual, pending_bias = None, None
    for i in range(spec.num_layers):
        layer = _names(layer_weights(spec, i))
        residual, h = _pre_norm(ctx, x, skip if i == 0 else residual, layer, "attn_norm", layer["qkv"], pending_bias)
        x, pending_bias = _post_norm(ctx, *_attention(ctx, i, layer, h), layer, "post_attn_norm")
        if spec.parallel_residual:
            x, pending_bias = _parallel_mlp(ctx, layer, residual, h, x, pending_bias)
            continue
        residual, h = _pre_norm(ctx, x, residual, layer, "mlp_norm", _mlp_input(layer), pending_bias)
        x, pending_bias = _post_norm(ctx, *_mlp(ctx, layer, h), layer, "post_mlp_norm")
    _, h = _norm(ctx, x, residual, names, "norm", names["lm_head"], pending_bias)
    if kind == "prefill" and not all_logits:
        h = _last_position(g, h, spec.hidden_size)
    if io.input(logits_to_keep.NAME) is not None:
        h = _kept_positions(g, h)
    logits = g.fresh("raw_logits") if spec.final_softcap else "logits"
    head = g.fresh("head") if spec.lm_head_bias else logits
    g.op("MatMul", [h, g.weight(w.get(names["lm_head"]))], [head])
    if spec.lm_head_bias:
        g.op("Add", [head, g.weight(w.get(names["lm_head_bias"]))], [logits])
    if spec.final_softcap:
        _softcap(g, logits, spec.final_softcap, "logits")
    return g.model()


def _names(declared: dict[str, str]) -> dict[str, str]:
    """role -> the exported graphs' initializer name (llmx.weight_names)."""
    return {role: graph_name(name) for role, name in declared.items()}


def _context(g: GraphBuilder, spec: ModelSpec, w: WeightSource, kind: str) -> Context:
    mask = "attention_mask"
    total64 = g.op1("Squeeze", [g.op1("Shape", [mask], start=1, end=2), g.const([0], dtype=np.int64)])
    total = g.op1("Cast", [total64], to=INT32)
    bias = None
    rotary = {}
    if spec.position == "rope":
        tables = {"main": spec.rope, **({"local": spec.rope_local} if spec.rope_local else {})}
        rotary = {name: _rotary(g, spec, rope, "rope" if name == "main" else f"rope_{name}") for name, rope in tables.items()}
    if kind == "decode":
        # Rows hold sum(mask) tokens after this step; the new ones go to the last slots.
        count = g.op1("ReduceSum", [mask, g.const([1], dtype=np.int64)], keepdims=0)
        seqlens = g.op1("Cast", [g.op1("Sub", [count, g.const(1, dtype=np.int64)])], to=INT32)
    else:
        # Every row spans the whole padded prompt; padding (left or right) is masked by the bias.
        batch = g.op1("Shape", [mask], start=0, end=1)
        last = g.op1("Sub", [total64, g.const(1, dtype=np.int64)])
        seqlens = g.op1("Cast", [g.op1("Expand", [last, batch])], to=INT32)
        bias = _padding_bias(g, mask, batch)
    return Context(g, spec, w, kind, seqlens, total, rotary, bias)


def _rotary(g: GraphBuilder, spec: ModelSpec, rope: dict, name: str) -> tuple[str, str, str]:
    """cos/sin caches of one RoPE config and the positions to read them at.

    LongRoPE: the long set is stored after the short one, and a call whose largest position
    reaches past the threshold reads it by offsetting every position by the table length;
    transformers switches the same way (per call, every position), and no table is copied.
    """
    length = spec.max_position_embeddings
    inv_freq, scale = inv_freq_and_scale(rope, spec.rotary_dim or spec.head_dim, length)
    cos_t, sin_t = cos_sin_tables(inv_freq, scale, length)
    positions = "position_ids"
    threshold = long_context_threshold(rope)
    if threshold is not None:
        long_cos, long_sin = cos_sin_tables(inv_freq_and_scale(rope, spec.rotary_dim or spec.head_dim, length, long=True)[0], scale, length)
        cos_t, sin_t = np.concatenate([cos_t, long_cos]), np.concatenate([sin_t, long_sin])
        longest = g.op1("ReduceMax", [positions], keepdims=0)
        is_long = g.op1("Cast", [g.op1("Greater", [longest, g.const(threshold - 1, dtype=np.int64)])], to=7)  # INT64
        positions = g.op1("Add", [positions, g.op1("Mul", [is_long, g.const(length, dtype=np.int64)])])
    return g.const(cos_t, f"{name}.cos_cache"), g.const(sin_t, f"{name}.sin_cache"), positions


def _padding_bias(g: GraphBuilder, mask: str, batch: str) -> str:
    """[B,1,S,S] additive bias: 0 where the key is a real token, the float minimum at padding."""
    valid = g.op1("Cast", [g.op1("Unsqueeze", [mask, g.const([1, 2], dtype=np.int64)])], to=BOOL)  # [B,1,1,S]
    per_key = g.op1("Where", [valid, g.const(np.float32(0)), g.const(np.float32(MASKED))])
    seq = g.op1("Shape", [mask], start=1, end=2)
    shape = g.op1("Concat", [batch, g.const([1], dtype=np.int64), seq, seq], axis=0)
    return g.op1("Expand", [per_key, shape])


def _norm(ctx: Context, x: str, skip: str | None, names: dict[str, str], role: str, next_matmul: str,
          bias: str | None) -> tuple[str, str]:
    """(residual stream x + skip + bias, its norm ``role``). The first norm of the model has no skip."""
    g, spec, w = ctx.g, ctx.spec, ctx.w
    gamma = g.weight(w.norm_before(next_matmul, names[role], 0))
    beta = [g.weight(w.norm_before(next_matmul, names[f"{role}_bias"], 1))] if spec.norm == "layer" else []
    eps = float(spec.norm_eps)
    if skip is None:
        op = "SimplifiedLayerNormalization" if spec.norm == "rms" else "LayerNormalization"
        return x, g.op1(op, [x, gamma, *beta], axis=-1, epsilon=eps)
    op = "SkipSimplifiedLayerNormalization" if spec.norm == "rms" else "SkipLayerNormalization"
    if spec.norm == "layer" and bias is None:
        inputs = [x, skip, gamma, *beta]
    elif spec.norm == "layer":
        inputs = [x, skip, gamma, *beta, bias]
    else:
        inputs = [x, skip, gamma] + ([bias] if bias else [])
    normed, total = g.fresh("normed"), g.fresh("residual")
    g.op(op, inputs, [normed, "", "", total], domain=MS_DOMAIN, epsilon=eps)
    return total, normed


def _pre_norm(ctx: Context, x: str, skip: str | None, names: dict[str, str], role: str, next_matmul: str,
              bias: str | None) -> tuple[str, str]:
    """(residual stream, the input of the next block): normed, or the stream itself where the spec has no pre-norms."""
    if role in names:
        return _norm(ctx, x, skip, names, role, next_matmul, bias)
    total = x if skip is None else ctx.g.op1("Add", [x, skip])
    total = ctx.g.op1("Add", [total, bias]) if bias else total
    return total, total


def _post_norm(ctx: Context, x: str, bias: str | None, names: dict[str, str], role: str) -> tuple[str, str | None]:
    """The norm of a block's output before the residual add (post_norms); the pending bias is added first."""
    if role not in names:
        return x, bias
    g, spec = ctx.g, ctx.spec
    x = g.op1("Add", [x, bias]) if bias else x
    op = "SimplifiedLayerNormalization" if spec.norm == "rms" else "LayerNormalization"
    return g.op1(op, [x, g.weight(ctx.w.get(names[role]))], axis=-1, epsilon=float(spec.norm_eps)), None


def _softcap(g: GraphBuilder, x: str, cap: float, out: str) -> None:
    """out = cap * tanh(x / cap)."""
    capped = g.op1("Tanh", [g.op1("Div", [x, g.const(np.float32(cap))])])
    g.op("Mul", [capped, g.const(np.float32(cap))], [out])


def _linear(ctx: Context, x: str, names: dict[str, str], role: str, fold_bias: bool = False) -> tuple[str, str | None]:
    """x @ W (+ b) for the weight ``role``. With ``fold_bias`` the bias is returned for the next fused op to add."""
    g, w = ctx.g, ctx.w
    y = g.op1("MatMul", [x, g.weight(w.get(names[role]))])
    if f"{role}_bias" not in names:
        return y, None
    bias = w.bias_after(names[role], names[f"{role}_bias"])
    if bias is None:
        raise ArtifactError(f"cannot find {names[f'{role}_bias']} in the exported graph")
    if fold_bias:
        return y, g.weight(bias)
    return g.op1("Add", [y, g.weight(bias)]), None


def _attention(ctx: Context, i: int, names: dict[str, str], h: str) -> tuple[str, str | None]:
    g, spec = ctx.g, ctx.spec
    qkv, _ = _linear(ctx, h, names, "qkv")
    window = spec.sliding_window if spec.sliding_layers and spec.sliding_layers[i] else None
    attrs = dict(num_heads=spec.num_heads, kv_num_heads=spec.num_kv_heads, scale=float(spec.attention_scales[i]),
                 local_window_size=int(window) if window else -1)
    if spec.attn_softcap:
        attrs["softcap"] = float(spec.attn_softcap)
    rotary = ctx.rotary.get(rope_table(spec, i) or "")
    q, k, v = qkv, "", ""
    # Prefill rotates with RotaryEmbedding; decode inside GroupQueryAttention, except partial rotary
    # (GQA's rotary covers whole heads, or a cos table width that is a multiple of 8).
    outside = bool(rotary) and (ctx.kind == "prefill" or spec.rotary_dim is not None)
    if spec.qk_norm or outside:
        q, k, v = g.op("Split", [qkv, g.const([spec.q_size, spec.kv_size, spec.kv_size], dtype=np.int64)], 3, axis=-1)
        q, k = _qk_norm(ctx, names, q, k)
    if outside:
        q, k = _rotate(ctx, rotary, q, k)
    if ctx.kind == "decode":
        inputs = [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", ctx.seqlens_k, ctx.total_len]
        inputs += list(rotary) if rotary and not outside else []
        attrs["do_rotary"] = int(bool(rotary) and not outside)
    else:
        inputs = [q, k, v, "", "", ctx.seqlens_k, ctx.total_len, "", "", "", ctx.attention_bias]
    out = g.fresh("attn")
    g.op("GroupQueryAttention", inputs, [out, f"present.{i}.key", f"present.{i}.value"], domain=MS_DOMAIN, **attrs)
    return _linear(ctx, out, names, "o", fold_bias=True)


def _qk_norm(ctx: Context, names: dict[str, str], q: str, k: str) -> tuple[str, str]:
    """RMSNorm of q and k before RoPE: over each head ("head") or the whole projection ("full")."""
    g, spec = ctx.g, ctx.spec
    if not spec.qk_norm:
        return q, k
    if spec.qk_norm == "layer_head":
        return _layer_head_norm(ctx, names, q, spec.num_heads), _layer_head_norm(ctx, names, k, spec.num_kv_heads, "k")
    out = []
    for x, role, heads in ((q, "q_norm", spec.num_heads), (k, "k_norm", spec.num_kv_heads)):
        gamma, eps = g.weight(ctx.w.get(names[role])), float(spec.norm_eps)
        if spec.qk_norm == "full":
            out.append(g.op1("SimplifiedLayerNormalization", [x, gamma], axis=-1, epsilon=eps))
            continue
        per_head = g.op1("Reshape", [x, g.const([0, 0, heads, spec.head_dim], dtype=np.int64)])
        normed = g.op1("SimplifiedLayerNormalization", [per_head, gamma], axis=-1, epsilon=eps)
        out.append(g.op1("Reshape", [normed, g.const([0, 0, heads * spec.head_dim], dtype=np.int64)]))
    return out[0], out[1]


def _mlp(ctx: Context, names: dict[str, str], h: str) -> tuple[str, str | None]:
    g, spec = ctx.g, ctx.spec
    if "router" in names:
        return moe_layer(g, ctx.w, spec, names, h, ACTIVATIONS[spec.activation]), None
    op, domain, attrs = ACTIVATIONS[spec.activation]
    if spec.mlp == "gated":
        up, _ = _linear(ctx, h, names, "up")
        gate, up = g.op("Split", [up, g.const([spec.intermediate_size] * 2, dtype=np.int64)], 2, axis=-1)
        act = g.op1("Mul", [g.op1(op, [gate], domain=domain, **attrs), up])
    elif op == "FastGelu" and spec.mlp_bias:  # FastGelu adds the up projection's bias itself
        up, bias = _linear(ctx, h, names, "up", fold_bias=True)
        act = g.op1(op, [up, bias], domain=domain, **attrs)
    else:
        up, _ = _linear(ctx, h, names, "up")
        act = g.op1(op, [up], domain=domain, **attrs)
    return _linear(ctx, act, names, "down", fold_bias=True)


# -- partial rotary, per-head q/k LayerNorm, parallel blocks (issue 14) ----------------------

def _rotate(ctx: Context, rotary: tuple[str, str, str], q: str, k: str) -> tuple[str, str]:
    """RotaryEmbedding on q and k ([B,T,heads*D]); with partial rotary only the first rotary_dim of each head."""
    g, spec = ctx.g, ctx.spec
    cos, sin, positions = rotary
    partial = dict(rotary_embedding_dim=spec.rotary_dim) if spec.rotary_dim else {}
    q = g.op1("RotaryEmbedding", [q, positions, cos, sin], domain=MS_DOMAIN, num_heads=spec.num_heads, **partial)
    k = g.op1("RotaryEmbedding", [k, positions, cos, sin], domain=MS_DOMAIN, num_heads=spec.num_kv_heads, **partial)
    return q, k


def _layer_head_norm(ctx: Context, names: dict[str, str], x: str, heads: int, which: str = "q") -> str:
    """[B,T,heads*D] LayerNorm over each head's D features, with per-head weights [heads,1,D] (and bias)."""
    g, spec, w, d = ctx.g, ctx.spec, ctx.w, ctx.spec.head_dim
    per_head = g.const([heads, d], dtype=np.int64)
    y = g.op1("Reshape", [x, g.const([0, 0, heads, d], dtype=np.int64)])
    y = g.op1("LayerNormalization", [y, g.const(np.ones(d, np.float32))], axis=-1, epsilon=float(spec.norm_eps))
    y = g.op1("Mul", [y, g.op1("Reshape", [g.weight(w.get(names[f"{which}_norm"])), per_head])])
    if spec.qk_norm_bias:
        y = g.op1("Add", [y, g.op1("Reshape", [g.weight(w.get(names[f"{which}_norm_bias"])), per_head])])
    return g.op1("Reshape", [y, g.const([0, 0, heads * d], dtype=np.int64)])


def _parallel_mlp(ctx: Context, names: dict[str, str], residual: str, h: str, attn_out: str, attn_bias: str | None):
    """Parallel blocks: the MLP reads the block's input (through the attention's norm, or its own),
    and both outputs join the residual stream at the next skip-norm."""
    g, spec, w = ctx.g, ctx.spec, ctx.w
    if "mlp_norm" in names:
        up = _mlp_input(names)
        beta = [g.weight(w.norm_before(up, names["mlp_norm_bias"], 1))] if spec.norm == "layer" else []
        op = "LayerNormalization" if spec.norm == "layer" else "SimplifiedLayerNormalization"
        h = g.op1(op, [residual, g.weight(w.norm_before(up, names["mlp_norm"], 0)), *beta], axis=-1, epsilon=float(spec.norm_eps))
    mlp_out, mlp_bias = _mlp(ctx, names, h)
    biases = [b for b in (attn_bias, mlp_bias) if b]
    bias = g.op1("Add", biases) if len(biases) == 2 else (biases[0] if biases else None)
    return g.op1("Add", [attn_out, mlp_out]), bias


def _mlp_input(names: dict[str, str]) -> str:
    """The weight of the MatMul the MLP's norm feeds (anchors a norm weight the exporter renamed)."""
    return names["up"] if "up" in names else names["router"]


def _kept_positions(g: GraphBuilder, h: str) -> str:
    """The last ``logits_to_keep`` positions of h (0: all), with the input's default as in the exported graph."""
    kept = g.fresh("kept")
    nodes, constants = logits_to_keep.slice_nodes(h, kept)
    for tensor in (logits_to_keep.default_value(), *constants):
        g.weight(tensor)
    g.nodes.extend(nodes)
    return kept


def _last_position(g: GraphBuilder, h: str, hidden: int) -> str:
    """[B,S,H] -> [B,1,H] at each row's last real token (the last 1 in attention_mask)."""
    last = g.op1("ArgMax", ["attention_mask"], axis=1, keepdims=1, select_last_index=1)  # [B,1]
    index = g.op1("Unsqueeze", [last, g.const([2], dtype=np.int64)])  # [B,1,1]
    batch = g.op1("Shape", [h], start=0, end=1)
    index = g.op1("Expand", [index, g.op1("Concat", [batch, g.const([1, hidden], dtype=np.int64)], axis=0)])
    return g.op1("GatherElements", [h, index], axis=1)
