"""Sparse MoE blocks for the optimized graphs, in two formulations (benchmarks/moe_fused.py
measures them against each other; ``FORMULATION`` is the one the builder emits).

"contrib": ONNX Runtime's com.microsoft.MoE op: router logits in, softmax, top-k and the
    experts' SwiGLU MLPs in one kernel. Its weights are [E, out, in], so the builder writes
    transposed copies of the exported [E, in, out] expert weights.
"gather": TopK on the router softmax, then Gather of the k chosen experts' weights per token
    and batched MatMuls: a decode step reads k experts' weights instead of all E.

Both compute transformers' routing: softmax over all experts, top-k, renormalized to sum to 1
when ``renormalize`` (``norm_topk_prob``; mixtral always).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmx.errors import ArtifactError
from llmx.fused.graph import MS_DOMAIN, GraphBuilder
from llmx.spec import ModelSpec

FORMULATION = "contrib"  # measured faster and as exact: benchmarks/moe_fused.py


@dataclass
class MoEWeights:
    """Initializer names of one MoE block, in the exported layout."""

    router: str  # [H,E]
    gate_up: str  # [E,H,2I], gate | up along the last axis
    down: str  # [E,I,H]
    # The contrib op's layout: [E,2I,H] with gate and up rows interleaved (its CPU kernel takes
    # only that SwiGLU form) and [E,H,I]; only that formulation needs them (``contrib_layout``).
    gate_up_t: str | None = None
    down_t: str | None = None


def moe_block(g: GraphBuilder, x: str, w: MoEWeights, *, experts: int, top_k: int, inner: int, hidden: int,
              renormalize: bool, act: tuple[str, str, dict], formulation: str = FORMULATION) -> str:
    """x [B,T,H] -> the MoE MLP's output [B,T,H]."""
    if formulation == "contrib":
        return _contrib(g, x, w, experts, top_k, renormalize, act)
    return _gather(g, x, w, experts, top_k, inner, hidden, renormalize, act)


def _contrib(g, x, w, experts, top_k, renormalize, act) -> str:
    if act[0] != "QuickGelu":
        raise ValueError("the MoE contrib op's gated activation is SwiGLU (silu) only")
    logits = g.op1("Reshape", [g.op1("MatMul", [x, w.router]), g.const([-1, experts], dtype=np.int64)])
    # swiglu with alpha 1, beta 0 and no limit is silu(gate) * up; fusion 1: interleaved rows.
    # Always renormalized: with normalize_routing_weights=0 the CPU kernel's result changed with
    # the graph around it (measured: 0.1-0.3 off in a 2-layer model, exact alone), so the
    # un-renormalized sum is rebuilt as the renormalized one times each token's top-k mass.
    y = g.op1("MoE", [x, logits, w.gate_up_t, "", w.down_t], domain=MS_DOMAIN, k=top_k,
              activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
              normalize_routing_weights=1)
    if renormalize:
        return y
    top, _ = g.op("TopK", [g.op1("Softmax", [logits], axis=-1), g.const([top_k], dtype=np.int64)], 2, axis=-1)
    mass = g.op1("ReduceSum", [top, g.const([-1], dtype=np.int64)], keepdims=1)  # [N,1]
    flat = g.op1("Reshape", [y, g.op1("Concat", [g.op1("Shape", [logits], start=0, end=1), g.op1("Shape", [x], start=-1)], axis=0)])
    return g.op1("Reshape", [g.op1("Mul", [flat, mass]), g.op1("Shape", [x])])


def _gather(g, x, w, experts, top_k, inner, hidden, renormalize, act) -> str:
    op, domain, attrs = act
    shape = g.op1("Shape", [x])
    tokens = g.op1("Reshape", [x, g.const([-1, 1, 1, hidden], dtype=np.int64)])  # [N,1,1,H]
    logits = g.op1("Reshape", [g.op1("MatMul", [x, w.router]), g.const([-1, experts], dtype=np.int64)])
    probs = g.op1("Softmax", [logits], axis=-1)
    top, index = g.op("TopK", [probs, g.const([top_k], dtype=np.int64)], 2, axis=-1)  # [N,k]
    if renormalize:
        top = g.op1("Div", [top, g.op1("ReduceSum", [top, g.const([-1], dtype=np.int64)], keepdims=1)])
    h = g.op1("MatMul", [tokens, g.op1("Gather", [w.gate_up, index], axis=0)])  # [N,k,1,2I]
    gate, up = g.op("Split", [h, g.const([inner, inner], dtype=np.int64)], 2, axis=-1)
    h = g.op1("Mul", [g.op1(op, [gate], domain=domain, **attrs), up])
    out = g.op1("MatMul", [h, g.op1("Gather", [w.down, index], axis=0)])  # [N,k,1,H]
    out = g.op1("Mul", [out, g.op1("Unsqueeze", [top, g.const([2, 3], dtype=np.int64)])])
    out = g.op1("ReduceSum", [out, g.const([1, 2], dtype=np.int64)], keepdims=0)  # [N,H]
    return g.op1("Reshape", [out, shape])


def contrib_layout(gate_up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E,H,2I] (gate | up) and [E,I,H] -> the contrib op's [E,2I,H] (gate, up interleaved) and [E,H,I]."""
    experts, hidden, width = gate_up.shape
    inner = width // 2
    fc1 = gate_up.reshape(experts, hidden, 2, inner).transpose(0, 3, 2, 1).reshape(experts, width, hidden)
    return np.ascontiguousarray(fc1), np.ascontiguousarray(down.transpose(0, 2, 1))


def check_moe_supported(spec: ModelSpec, act: tuple[str, str, dict]) -> None:
    """The contrib op computes SwiGLU experts only; refuse other expert MLPs before anything is written."""
    if spec.num_experts and FORMULATION == "contrib" and (spec.mlp != "gated" or act[0] != "QuickGelu"):
        raise ArtifactError(f"MoE experts with a {spec.mlp} {spec.activation} MLP have no fused kernel "
                            "(ONNX Runtime's MoE op takes SwiGLU experts); use the exported artifact as is")


def moe_layer(g: GraphBuilder, w, spec: ModelSpec, layer: dict[str, str], x: str, act: tuple[str, str, dict]) -> str:
    """A layer's MoE block; ``layer`` maps weight roles to the exported graphs' names (llmx.weight_names),
    ``w`` (a WeightSource) holds them."""
    names = MoEWeights(g.weight(w.get(layer["router"])), g.weight(w.get(layer["experts_gate_up"])),
                       g.weight(w.get(layer["experts_down"])))
    if FORMULATION == "contrib":
        fc1, fc2 = contrib_layout(w.array(names.gate_up), w.array(names.down))
        # The contrib op reads only these copies; the exported layout is dropped from the graph.
        del g.initializers[names.gate_up], g.initializers[names.down]
        names.gate_up_t, names.down_t = g.const(fc1, f"{names.gate_up}_t"), g.const(fc2, f"{names.down}_t")
    return moe_block(g, x, names, experts=spec.num_experts, top_k=spec.experts_per_token,
                     inner=spec.moe_intermediate_size, hidden=spec.hidden_size, renormalize=spec.norm_topk_prob, act=act)
