"""Writing GGUF files from the tiny test checkpoints with the ``gguf`` package, as llama.cpp's
``convert_hf_to_gguf.py`` would: llama.* metadata, q/k rows permuted, a gpt2-style vocabulary,
2-D weights quantized with ``gguf.quants.quantize`` (norms stay F32, as llama.cpp keeps them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf in NAMES:
        return NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.{i}.<rest>
    return f"blk.{layer}.{NAMES[rest]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(checkpoint: Path, out: Path, qtype: str = "F32", arch: str | None = None,
               overrides: dict[str, str] | None = None) -> Path:
    """``overrides``: GGUF tensor name -> its own type (a file mixing types, as llama.cpp's are)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = arch or cfg["model_type"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    _add_tokenizer(writer, checkpoint)
    for name, array in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        ours = gguf_name(name)
        quant = getattr(gguf.GGMLQuantizationType, (overrides or {}).get(ours, qtype))
        array = array.astype(np.float32)
        if cfg["model_type"] == "llama" and (".attn_q." in ours or ".attn_k." in ours):
            array = permute(array, heads if ".attn_q." in ours else kv)
        if array.ndim == 2 and quant == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(ours, array.astype(np.float16))
        elif array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(ours, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(ours, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer, checkpoint: Path) -> None:
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_pad_token_id(vocab["<pad>"])
    writer.add_add_bos_token(True)
    if template := config.get("chat_template"):
        writer.add_chat_template(template)


def dequantized(checkpoint: Path, qtype: str) -> dict[str, np.ndarray]:
    """The checkpoint's weights as a Q-type GGUF holds them (quantized, then dequantized), HF layout."""
    import gguf
    from safetensors.numpy import load_file

    quant = getattr(gguf.GGMLQuantizationType, qtype)
    out = {}
    for name, array in load_file(str(checkpoint / "model.safetensors")).items():
        array = array.astype(np.float32)
        out[name] = gguf.quants.dequantize(gguf.quants.quantize(array, quant), quant) if array.ndim == 2 else array
    return out


def write_tokenizer_gguf(out: Path, kind: str, checkpoint: Path | None = None) -> Path:
    """A GGUF holding only tokenizer metadata: "gpt2" (the checkpoint's byte-level BPE) or
    "llama" (a SentencePiece-style vocabulary: <unk>/<s>/</s>, <0xNN> byte pieces, scored pieces)."""
    import gguf

    writer = gguf.GGUFWriter(str(out), "llama")
    if kind == "gpt2":
        _add_tokenizer(writer, checkpoint)
    else:
        tokens, scores, types = _sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _sentencepiece_vocab(size: int = 400) -> tuple[list[str], list[float], list[int]]:
    import inspect
    import textwrap

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tok.train_from_iterator([inspect.getsource(textwrap)], trainers.BpeTrainer(vocab_size=size))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda item: item[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    return tokens, scores, types


# llama.cpp's Q4_K_M mix for a 256-multiple model: q, k, gate, up Q4_K; v, down, table Q6_K; o Q5_K.
KQUANT_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
              "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def write_kquant_gguf(out: Path, checkpoint: Path, layers: int = 2, hidden: int = 256, ffn: int = 512) -> Path:
    """A Llama GGUF whose matrices are K-quant blocks of random bytes (the gguf package cannot
    quantize K-quants; its dequantizer reads them), mixed per tensor as llama.cpp's Q4_K_M mixes
    them, with a tied Q6_K table; the vocabulary is ``checkpoint``'s."""
    import gguf
    from test_gguf_blocks import crafted

    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(a["id"] >= len(tok["model"]["vocab"]) for a in tok["added_tokens"])
    heads, kv = 4, 2
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    _add_tokenizer(writer, checkpoint)
    head_dim = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv * head_dim, hidden), "attn_v": (kv * head_dim, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}

    def add(name: str, qtype: str, rows: int, k: int, seed: int) -> None:
        kind = getattr(gguf.GGMLQuantizationType, qtype)
        writer.add_tensor(name, crafted(qtype, rows, k, seed), raw_dtype=kind)

    add("token_embd.weight", "Q6_K", vocab, hidden, 0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for seed, (part, qtype) in enumerate(KQUANT_MIX.items()):
            add(f"blk.{i}.{part}.weight", qtype, *shapes[part], 10 * i + seed + 1)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
