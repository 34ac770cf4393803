"""The names of a model's weights, declared once for every stage (torch-free).

llmx's torch modules (export/modules.py, export/encoder.py) name their parameters this way,
export/checkpoint.py maps a Hugging Face checkpoint's tensors onto these roles, the exported
graphs' initializers carry the names (under ``GRAPH_PREFIX``, the attribute the graph wrappers
hold the model in), and llmx/fused/decoder.py finds its weights by them. A weight is declared
with the spec feature it belongs to, so a family that has the feature has the weight in every
stage, and the loader refuses a checkpoint that lacks it. tests/test_weight_names.py holds the
modules and the exported graphs to this declaration for every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llmx.spec import ModelSpec

GRAPH_PREFIX = "model."
LAYER_PREFIX = "layers.{i}."


@dataclass(frozen=True)
class Weight:
    role: str  # what the weight is, as the checkpoint rules and the graph builders say it
    name: str  # module-relative name (layer weights: below LAYER_PREFIX)
    present: Callable[[ModelSpec], bool]
    # Layer weights: whether layer i has it, for weights only some layers have (MoE layers).
    in_layer: Callable[[ModelSpec, int], bool] = lambda spec, i: True


def _always(spec: ModelSpec) -> bool:
    return True


def _decoder(spec: ModelSpec) -> bool:
    return spec.kind == "decoder"


def _encoder(spec: ModelSpec) -> bool:
    return spec.kind == "encoder"


def _layer_norm(spec: ModelSpec) -> bool:
    return spec.norm == "layer"


MODEL_WEIGHTS: tuple[Weight, ...] = (
    Weight("embed", "embed.weight", _always),
    Weight("pos_embed", "pos_embed.weight", lambda s: s.position == "learned"),
    Weight("norm", "norm.weight", _decoder),
    Weight("norm_bias", "norm.bias", lambda s: _decoder(s) and _layer_norm(s)),
    Weight("lm_head", "lm_head.weight", _decoder),
    Weight("lm_head_bias", "lm_head.bias", lambda s: s.lm_head_bias),
    # Encoders: token types and a norm right after the embeddings.
    Weight("type_embed", "type_embed.weight", _encoder),
    Weight("embed_norm", "embed_norm.weight", _encoder),
    Weight("embed_norm_bias", "embed_norm.bias", lambda s: _encoder(s) and _layer_norm(s)),
)

def _pre_norms(spec: ModelSpec) -> bool:
    return spec.pre_norms


def _pre_layer_norm(spec: ModelSpec) -> bool:
    return spec.pre_norms and spec.norm == "layer"


# -- parallel blocks, per-head q/k LayerNorm, sparse MoE (issue 14) --------------------------
def _mlp_norm(spec: ModelSpec) -> bool:
    return spec.pre_norms and not spec.shared_block_norm  # parallel blocks with one norm have none


def _sparse(spec: ModelSpec, layer: int) -> bool:
    return bool(spec.sparse_layers and spec.sparse_layers[layer])


def _dense(spec: ModelSpec, layer: int) -> bool:
    return not _sparse(spec, layer)


# In encoders (post-norm) attn_norm and mlp_norm are the norms after each residual add.
LAYER_WEIGHTS: tuple[Weight, ...] = (
    Weight("attn_norm", "attn_norm.weight", _pre_norms),
    Weight("attn_norm_bias", "attn_norm.bias", _pre_layer_norm),
    Weight("qkv", "attn.qkv.weight", _always),
    Weight("qkv_bias", "attn.qkv.bias", lambda s: s.qkv_bias),
    Weight("q_norm", "attn.q_norm.weight", lambda s: bool(s.qk_norm)),
    Weight("k_norm", "attn.k_norm.weight", lambda s: bool(s.qk_norm)),
    Weight("q_norm_bias", "attn.q_norm.bias", lambda s: s.qk_norm_bias),
    Weight("k_norm_bias", "attn.k_norm.bias", lambda s: s.qk_norm_bias),
    Weight("o", "attn.o.weight", _always),
    Weight("o_bias", "attn.o.bias", lambda s: s.o_bias),
    Weight("post_attn_norm", "post_attn_norm.weight", lambda s: s.post_norms),
    Weight("mlp_norm", "mlp_norm.weight", _mlp_norm),
    Weight("mlp_norm_bias", "mlp_norm.bias", lambda s: _mlp_norm(s) and s.norm == "layer"),
    Weight("up", "mlp.up.weight", _always, _dense),  # gated MLPs: [gate | up] along the output axis
    Weight("up_bias", "mlp.up.bias", lambda s: s.mlp_bias, _dense),
    Weight("down", "mlp.down.weight", _always, _dense),
    Weight("down_bias", "mlp.down.bias", lambda s: s.mlp_bias, _dense),
    # Sparse MoE layers (export/moe.py): router [H,E], experts [E,H,2I] (gate | up) and [E,I,H].
    Weight("router", "mlp.router", lambda s: s.num_experts > 0, _sparse),
    Weight("experts_gate_up", "mlp.gate_up", lambda s: s.num_experts > 0, _sparse),
    Weight("experts_down", "mlp.down", lambda s: s.num_experts > 0, _sparse),
    Weight("post_mlp_norm", "post_mlp_norm.weight", lambda s: s.post_norms),
)


def model_weights(spec: ModelSpec) -> dict[str, str]:
    """role -> module-relative name of the weights outside the layers that ``spec`` has."""
    return {w.role: w.name for w in MODEL_WEIGHTS if w.present(spec)}


def layer_weights(spec: ModelSpec, layer: int) -> dict[str, str]:
    """role -> module-relative name of layer ``layer``'s weights that ``spec`` has."""
    prefix = LAYER_PREFIX.format(i=layer)
    return {w.role: prefix + w.name for w in LAYER_WEIGHTS if w.present(spec) and w.in_layer(spec, layer)}


def all_weights(spec: ModelSpec) -> list[str]:
    """Every module-relative weight name of the model, in declaration order."""
    names = list(model_weights(spec).values())
    for i in range(spec.num_layers):
        names.extend(layer_weights(spec, i).values())
    return names


def graph_name(name: str) -> str:
    """The initializer name an exported graph gives the module-relative weight ``name``."""
    return GRAPH_PREFIX + name
