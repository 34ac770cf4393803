"""GGUF architectures (``general.architecture``) as llmx families: tensor names, metadata, layout.

Each row says how llama.cpp's ``convert_hf_to_gguf.py`` wrote a Hugging Face checkpoint, so the
file reads back as that checkpoint (same names, same config keys) and goes through the same
``ModelSpec`` table as a checkpoint directory:

- ``tensors``: GGUF tensor names -> HF names beyond the shared Llama-style ones ("{i}": layer).
- ``permuted``: llama.cpp runs the family with interleaved ("normal") RoPE, so its converter
  permuted the q/k rows (``LlamaModel.permute``); HF's rotate_half wants halves, so the rows are
  put back (as transformers' GGUF loader does). Families llama.cpp runs with NeoX RoPE keep
  HF's order.
- ``config``: HF config keys read from ``{arch}.<key>`` metadata beyond the shared ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
QK_NORMS = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}


@dataclass(frozen=True)
class Arch:
    family: str  # the HF model_type llmx's ModelSpec table reads
    permuted: bool = False
    tensors: dict[str, str] = field(default_factory=dict)
    config: dict[str, str] = field(default_factory=dict)  # HF key -> GGUF key after "{arch}."
    hidden_act: str = "silu"

    def tensor_names(self) -> dict[str, str]:
        return {**LLAMA_TENSORS, **self.tensors}


# Mistral and SmolLM/SmolLM2 GGUFs are written as "llama" (their HF configs read as llama too).
ARCHITECTURES = {
    "llama": Arch("llama", permuted=True),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3", tensors=QK_NORMS),
}
