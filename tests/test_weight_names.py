"""The weight-name declaration (llmx.weight_names) against what the stages really produce.

For every checkpoint variant: the torch modules have exactly the declared parameters, and the
exported graphs' initializers carry exactly the declared names (a name the exporter merged into
an identical initializer must still be found the way the optimizer finds it).
"""

from __future__ import annotations

import onnx
import pytest

from conftest import VARIANTS
from llmx.errors import ArtifactError
from llmx.artifact.manifest import load_manifest
from llmx.optimize.weights import SourceWeights
from llmx.spec import ModelSpec, spec_from_hf_config
from llmx.weight_names import all_weights, graph_name, layer_weights, model_weights


def _spec(artifact) -> ModelSpec:
    return load_manifest(artifact).model


# Where the optimizer finds a weight the exporter merged into an identical one: the matmul the
# norm feeds (weight 0, bias 1) or the matmul the bias is added to (None).
MERGED = {"attn_norm": ("qkv", 0), "attn_norm_bias": ("qkv", 1), "mlp_norm": ("up", 0), "mlp_norm_bias": ("up", 1),
          "norm": ("lm_head", 0), "norm_bias": ("lm_head", 1),
          "qkv_bias": ("qkv", None), "o_bias": ("o", None), "up_bias": ("up", None), "down_bias": ("down", None)}


def _scopes(spec: ModelSpec) -> list[dict[str, str]]:
    """role -> graph name, for the model and each layer."""
    scopes = [model_weights(spec)] + [layer_weights(spec, i) for i in range(spec.num_layers)]
    return [{role: graph_name(name) for role, name in scope.items()} for scope in scopes]


def _resolves(weights: SourceWeights, scope: dict[str, str], role: str) -> bool:
    if weights.has(scope[role]):
        return True
    if role not in MERGED:
        return False
    anchor, index = MERGED[role]
    try:
        if index is None:
            return weights.bias_after(scope[anchor], scope[role]) is not None
        return weights.norm_before(scope[anchor], scope[role], index) is not None
    except ArtifactError:
        return False


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_modules_have_exactly_the_declared_weights(variant, store):
    from llmx.export.modules import Decoder

    spec = _spec(store.artifact(variant))
    assert set(Decoder(spec).state_dict()) == set(all_weights(spec))


def test_encoder_modules_have_exactly_the_declared_weights():
    import transformers

    from llmx.export.encoder import Encoder

    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48).to_dict()
    spec = spec_from_hf_config(cfg)
    assert set(Encoder(spec).state_dict()) == set(all_weights(spec))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exported_initializers_are_the_declared_weights(variant, store):
    from llmx.export.modules import Decoder

    artifact = store.artifact(variant)
    spec = _spec(artifact)
    declared = {graph_name(n) for n in all_weights(spec)}
    buffers = {graph_name(n) for n, _ in Decoder(spec).named_buffers()}
    for graph in ("prefill.onnx", "decode.onnx"):
        names = {i.name for i in onnx.load(str(artifact / graph), load_external_data=False).graph.initializer}
        ours = {n for n in names if n.startswith("model.")}
        assert ours - buffers <= declared, f"undeclared weights in {graph}: {sorted(ours - buffers - declared)[:3]}"
        weights = SourceWeights(artifact, graph)
        lost = [scope[role] for scope in _scopes(spec) for role in scope if not _resolves(weights, scope, role)]
        assert not lost, f"{graph} lacks declared weights {lost[:3]}"
