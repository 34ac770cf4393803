"""Export-friendly decoder modules: one generic transformer driven by a ModelSpec.

The HF modeling code changes its cache classes and mask helpers every release, which breaks
tracing; these modules have flat tensor inputs and outputs and the KV layout llmx wants:

    prefill: input_ids [B,S], attention_mask [B,S], position_ids [B,S]
             -> logits [B,1,V] (last valid position; or [B,S,V]), present k/v [B,Hkv,S,D]
    decode:  input_ids [B,T], attention_mask [B,L], position_ids [B,T], past k/v [B,Hkv,C,D]
             -> logits [B,T,V], present k/v [B,Hkv,C,D]
             (the exported graph also takes logits_to_keep, added after tracing: llmx/logits_to_keep.py)

In decode the cache is a fixed-capacity buffer C; the T new keys/values are scattered into
slots ``position_ids`` (a sequence's token at position p lives in slot p) and attention reads
the first L slots, L = attention_mask.shape[1]. The runtime binds past and present to the
same memory, so the update is in place and no step copies the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmx.export.moe import SparseMoE
from llmx.rope import inv_freq_and_scale, long_context_threshold, rope_table
from llmx.spec import ModelSpec


class Linear(nn.Module):
    """y = x @ weight + bias with weight stored [in, out], the layout ONNX MatMul takes.

    nn.Linear keeps [out, in]; the exporter then folds a transpose into a new, anonymous
    initializer. Storing [in, out] keeps the parameter's name on the graph's weight, which is
    how later stages (weight sharing between graphs, quantization) find it.
    """

    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight)
        return y + self.bias if self.bias is not None else y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def make_norm(spec: ModelSpec, dim: int | None = None) -> nn.Module:
    if spec.norm == "rms":
        return RMSNorm(dim or spec.hidden_size, spec.norm_eps)
    return nn.LayerNorm(dim or spec.hidden_size, eps=spec.norm_eps)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's bound on attention scores and logits."""
    return torch.tanh(x / cap) * cap if cap else x


ACTIVATION_FNS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gated = spec.mlp == "gated"
        width = spec.intermediate_size * (2 if self.gated else 1)
        # gate and up share one matmul: one weight read and one kernel launch per step.
        self.up = Linear(spec.hidden_size, width, bias=spec.mlp_bias)
        self.down = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = ACTIVATION_FNS[spec.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.down(h)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # x: [B,H,T,D]; cos/sin: [B,1,T,R/2]. Non-interleaved halves, as in HF Llama; with partial
    # rotary (R = dim < D) the last D - R features pass through unrotated.
    if dim is not None:
        return torch.cat((rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class HeadNorm(nn.Module):
    """q/k LayerNorm over each head (qk_norm "layer_head": phi, stablelm), on [B,H,T,D].

    Weights are [H,1,D]: stablelm has one norm per head; phi's single norm is repeated per head
    by the loader.
    """

    def __init__(self, heads: int, dim: int, eps: float, bias: bool):
        super().__init__()
        self.eps, self.dim = eps, dim
        self.weight = nn.Parameter(torch.ones(heads, 1, dim))
        self.bias = nn.Parameter(torch.zeros(heads, 1, dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, (self.dim,), eps=self.eps) * self.weight
        return y + self.bias if self.bias is not None else y


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = spec.attention_scales[layer]
        self.window = spec.sliding_window if spec.sliding_layers and spec.sliding_layers[layer] else None
        self.softcap = spec.attn_softcap
        self.rope_table = rope_table(spec, layer)
        # q, k and v share one matmul for the same reason as the MLP's gate and up.
        self.qkv = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm in ("head", "full"):
            full = spec.qk_norm == "full"
            self.q_norm = make_norm(spec, spec.q_size if full else spec.head_dim)
            self.k_norm = make_norm(spec, spec.kv_size if full else spec.head_dim)
        self.o = Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        self.rotary_dim = spec.rotary_dim
        if spec.qk_norm == "layer_head":
            self.q_norm = HeadNorm(spec.num_heads, spec.head_dim, spec.norm_eps, spec.qk_norm_bias)
            self.k_norm = HeadNorm(spec.num_kv_heads, spec.head_dim, spec.norm_eps, spec.qk_norm_bias)

    def project(self, x, ropes):
        # x: [B,T,Hd] -> q [B,H,T,D], k/v [B,Hkv,T,D], q/k norm and rotary applied to q and k.
        b, t, _ = x.shape
        sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        q, k, v = self.qkv(x).split(sizes, dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm == "layer_head":
            q, k = self.q_norm(q), self.k_norm(k)
        rope = ropes.get(self.rope_table) if ropes and self.rope_table else None
        if rope is not None:
            q, k = rotate(q, *rope, self.rotary_dim), rotate(k, *rope, self.rotary_dim)
        return q, k, v

    def attend(self, q, k, v, allowed):
        # q [B,H,T,D]; k/v [B,Hkv,L,D]; allowed [B,1,T,L] bool.
        # Grouped heads attend without materializing repeated k/v: fold the group into T.
        b, _, t, d = q.shape
        group = self.heads // self.kv_heads
        q = q.reshape(b, self.kv_heads, group * t, d)
        scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * self.scale, self.softcap)  # [B,Hkv,G*T,L]
        scores = scores.view(b, self.kv_heads, group, t, -1)
        scores = scores.masked_fill(~allowed.unsqueeze(1), torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).view(b, self.kv_heads, group * t, -1)
        out = torch.matmul(probs, v).view(b, self.heads, t, d)
        return self.o(out.transpose(1, 2).reshape(b, t, self.heads * d))

    def window_mask(self, q_pos, k_pos, allowed):
        if self.window is None:
            return allowed
        return allowed & ((q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)) < self.window).unsqueeze(1)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        # Norms before (pre_norms) and after (post_norms) attention and the MLP; absent ones are identities.
        def norm(present: bool) -> nn.Module:
            return make_norm(spec) if present else nn.Identity()

        self.attn_norm = norm(spec.pre_norms)
        self.attn = Attention(spec, layer)
        self.post_attn_norm = norm(spec.post_norms)
        self.mlp_norm = None if spec.shared_block_norm else norm(spec.pre_norms)
        sparse = spec.sparse_layers and spec.sparse_layers[layer]
        self.mlp = SparseMoE(spec, ACTIVATION_FNS[spec.activation]) if sparse else MLP(spec)
        self.post_mlp_norm = norm(spec.post_norms)
        self.parallel = spec.parallel_residual

    def forward(self, x, attn_fn):
        if self.parallel:
            return self.parallel_forward(x, attn_fn)
        x = x + self.post_attn_norm(attn_fn(self.attn, self.attn_norm(x)))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))

    def parallel_forward(self, x, attn_fn):
        # Parallel residual (phi, gpt_neox, stablelm): attention and MLP both read the block's input.
        h = self.attn_norm(x)
        return x + attn_fn(self.attn, h) + self.mlp(h if self.mlp_norm is None else self.mlp_norm(x))


class Rotary(nn.Module):
    """cos/sin of positions for one RoPE config; LongRoPE takes its long set when the call's
    largest position reaches past the threshold, as transformers does (for every position of the call)."""

    def __init__(self, rope: dict, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, self.scale = inv_freq_and_scale(rope, head_dim, max_positions)
        self.register_buffer("inv_freq", torch.from_numpy(inv_freq), persistent=False)
        self.threshold = long_context_threshold(rope)
        if self.threshold is not None:
            long, _ = inv_freq_and_scale(rope, head_dim, max_positions, long=True)
            self.register_buffer("inv_freq_long", torch.from_numpy(long), persistent=False)

    def forward(self, position_ids):
        inv_freq = self.inv_freq
        if self.threshold is not None:
            inv_freq = torch.where(position_ids.max() + 1 > self.threshold, self.inv_freq_long, self.inv_freq)
        freqs = position_ids.unsqueeze(-1).to(torch.float32) * inv_freq  # [B,T,D/2]
        return (torch.cos(freqs) * self.scale).unsqueeze(1), (torch.sin(freqs) * self.scale).unsqueeze(1)


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        if spec.position == "learned":
            self.pos_embed = nn.Embedding(spec.max_position_embeddings, spec.hidden_size)
        else:
            tables = {"main": spec.rope, **({"local": spec.rope_local} if spec.rope_local else {})}
            self.rotary = nn.ModuleDict({k: Rotary(r, spec.rotary_dim or spec.head_dim, spec.max_position_embeddings) for k, r in tables.items()})
        self.layers = nn.ModuleList(Block(spec, i) for i in range(spec.num_layers))
        self.norm = make_norm(spec)
        # Tied checkpoints get a copy of the embedding here (loader's job): the lookup wants
        # [V,H] and the matmul [H,V], so one tensor cannot serve both without a transpose.
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=spec.lm_head_bias)

    # -- pieces shared by prefill and decode ------------------------------------------------

    def embed_tokens(self, input_ids, position_ids):
        x = self.embed(input_ids)
        if self.spec.position == "learned":
            x = x + self.pos_embed(position_ids)
        return x

    def rope(self, position_ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self.spec.position != "rope":
            return {}
        return {name: table(position_ids) for name, table in self.rotary.items()}

    def logits(self, h):
        return softcap(self.lm_head(self.norm(h)), self.spec.final_softcap)

    # -- the two graphs --------------------------------------------------------------------

    def prefill(self, input_ids, attention_mask, position_ids, all_logits: bool = False):
        x = self.embed_tokens(input_ids, position_ids)
        rope = self.rope(position_ids)
        valid = attention_mask.bool()
        # Causal by position, and only to real (unmasked) tokens: works for left and right padding.
        allowed = (position_ids.unsqueeze(-1) >= position_ids.unsqueeze(-2)) & valid.unsqueeze(1)
        allowed = allowed.unsqueeze(1)  # [B,1,S,S]
        presents = []

        def attn_fn(attn: Attention, h):
            q, k, v = attn.project(h, rope)
            presents.extend((k, v))
            return attn.attend(q, k, v, attn.window_mask(position_ids, position_ids, allowed))

        for block in self.layers:
            x = block(x, attn_fn)
        if not all_logits:
            # The last real token of each row: the largest index whose mask is 1.
            seq = torch.arange(1, x.shape[1] + 1, device=x.device).unsqueeze(0)
            last = torch.argmax(attention_mask * seq, dim=1)  # [B]
            x = torch.gather(x, 1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))
        return (self.logits(x), *presents)

    def decode(self, input_ids, attention_mask, position_ids, *past):
        x = self.embed_tokens(input_ids, position_ids)
        rope = self.rope(position_ids)
        total = attention_mask.shape[1]
        slots = torch.arange(total, device=x.device).unsqueeze(0)  # key position == slot
        allowed = (slots.unsqueeze(1) <= position_ids.unsqueeze(-1)) & attention_mask.bool().unsqueeze(1)
        allowed = allowed.unsqueeze(1)  # [B,1,T,L]
        presents = []
        layer = iter(range(len(self.layers)))

        def attn_fn(attn: Attention, h):
            i = next(layer)
            q, k, v = attn.project(h, rope)
            index = position_ids[:, None, :, None].expand(-1, attn.kv_heads, -1, attn.head_dim)
            k_all = past[2 * i].scatter(2, index, k)
            v_all = past[2 * i + 1].scatter(2, index, v)
            presents.extend((k_all, v_all))
            mask = attn.window_mask(position_ids, slots, allowed)
            return attn.attend(q, k_all[:, :, :total], v_all[:, :, :total], mask)

        for block in self.layers:
            x = block(x, attn_fn)
        return (self.logits(x), *presents)


class PrefillGraph(nn.Module):
    def __init__(self, model: Decoder, all_logits: bool = False):
        super().__init__()
        self.model, self.all_logits = model, all_logits

    def forward(self, input_ids, attention_mask, position_ids):
        return self.model.prefill(input_ids, attention_mask, position_ids, self.all_logits)


class DecodeGraph(nn.Module):
    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        return self.model.decode(input_ids, attention_mask, position_ids, *past)
