"""phi, gpt_neox, stablelm, starcoder2, mixtral, qwen3_moe: more settings per family than the
exported variants (tests/conftest.py FAMILY_VARIANTS) cover, checked in torch (no ONNX export).

llmx's torch Decoder (what the exporter traces) against transformers on tiny random checkpoints:
every prefill position and 4 decode steps through the fixed-capacity cache, within 1e-4 of the
logit scale. The exported graphs of one variant per family are held to transformers in
test_parity.py / test_optimize.py; these switch the remaining settings the other way.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_checkpoint
from llmx.export.checkpoint import load_model, open_checkpoint

SETTINGS = {
    "phi-rotary-3/8-tied": ("phi", dict(partial_rotary_factor=0.375, tie_word_embeddings=True)),
    "gpt_neox-sequential-no-bias": ("gpt_neox", dict(use_parallel_residual=False, rotary_pct=0.5, attention_bias=False)),
    "stablelm-sequential-qk-norm": ("stablelm", dict(qk_layernorm=True, partial_rotary_factor=0.25)),
    "starcoder2-no-bias-window-4": ("starcoder2", dict(use_bias=False, sliding_window=4, tie_word_embeddings=False)),
    "mixtral-top-1": ("mixtral", dict(num_experts_per_tok=1)),
    "mixtral-top-3": ("mixtral", dict(num_experts_per_tok=3, tie_word_embeddings=True)),
    "qwen3_moe-renormalized-sparse-step-2": ("qwen3_moe", dict(norm_topk_prob=True, decoder_sparse_step=2)),
    "qwen3_moe-dense-first": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[0], num_experts_per_tok=3)),
    # Phi-4-mini's partial rotary (0.75 there) with LongRoPE factors for the rotated dims only.
    "phi3-partial-rotary-longrope": ("phi3", dict(partial_rotary_factor=0.5, original_max_position_embeddings=4, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5, original_max_position_embeddings=4,
        short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[2.0, 2.5, 3.0, 3.5]))),
}

# What each setting must turn into (the spec really read the config, not a default).
EXPECTED = {
    "phi-rotary-3/8-tied": dict(rotary_dim=6, parallel_residual=True, shared_block_norm=True, tie_word_embeddings=True, lm_head_bias=True),
    "gpt_neox-sequential-no-bias": dict(rotary_dim=8, parallel_residual=False, qkv_bias=False, o_bias=False),
    "stablelm-sequential-qk-norm": dict(rotary_dim=4, qk_norm="layer_head", parallel_residual=False, qkv_bias=False),
    "starcoder2-no-bias-window-4": dict(sliding_window=4, qkv_bias=False, mlp_bias=False, tie_word_embeddings=False),
    "mixtral-top-1": dict(experts_per_token=1, norm_topk_prob=True, sparse_layers=[True, True]),
    "mixtral-top-3": dict(experts_per_token=3, tie_word_embeddings=True),
    "qwen3_moe-renormalized-sparse-step-2": dict(norm_topk_prob=True, sparse_layers=[False, True], qk_norm="head"),
    "qwen3_moe-dense-first": dict(norm_topk_prob=False, sparse_layers=[False, True], experts_per_token=3),
    "phi3-partial-rotary-longrope": dict(rotary_dim=8),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_torch_decoder_matches_transformers(name, tmp_path):
    import transformers

    family, overrides = SETTINGS[name]
    path = make_checkpoint(tmp_path, family, random_vectors=True, **overrides)
    checkpoint = open_checkpoint(path)
    for field, value in EXPECTED[name].items():
        assert getattr(checkpoint.spec, field) == value, field
    ours, ref = load_model(checkpoint), transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(3, checkpoint.spec.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
    prompt, steps = ids[:, :10], ids[:, 10:]
    with torch.no_grad():
        expected = ref(ids).logits[0]
        logits, *cache = ours.prefill(prompt, torch.ones_like(prompt), torch.arange(10)[None], all_logits=True)
        got = [logits[0]]
        past = [torch.cat([c, torch.zeros(*c.shape[:2], 4, c.shape[-1])], dim=2) for c in cache]
        for t in range(4):
            mask, pos = torch.ones(1, 11 + t, dtype=torch.int64), torch.tensor([[10 + t]])
            logits, *past = ours.decode(steps[:, t : t + 1], mask, pos, *past)
            got.append(logits[0])
    diff = (torch.cat(got) - expected).abs().max().item()
    assert diff <= 1e-4 * max(1.0, expected.abs().max().item()), f"{name}: max |diff| {diff:.2e}"
