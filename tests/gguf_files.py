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


# -- every family as llama.cpp's converter writes it (tests/test_gguf_arch.py) -------------------

# HF model_type -> the GGUF architecture llama.cpp's convert_hf_to_gguf.py (conversion/*.py) writes.
CONVERTED_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen3_moe": "qwen3moe", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3",
                  "phi3": "phi3", "granite": "granite", "olmo2": "olmo2", "smollm3": "smollm3",
                  "starcoder2": "starcoder2", "stablelm": "stablelm", "phi": "phi2", "gpt2": "gpt2"}
LLAMA_MODELS = {"llama", "mistral", "mixtral", "granite", "smollm3"}  # LlamaModel and its subclasses: q/k permuted
GEMMAS = {"gemma", "gemma2", "gemma3_text"}  # norms written as 1 + w


def write_converted_gguf(checkpoint: Path, out: Path, qtype: str = "F32") -> Path:
    """A GGUF of ``checkpoint`` as llama.cpp's converter (``--outtype f32``) writes its family:
    tensor names from gguf-py's TensorNameMap (the converter's ``map_tensor_name``), each model
    class's ``modify_tensors`` (q/k rows and biases permuted for LlamaModel's subclasses, Gemma's
    norms + 1 and no lm_head for Gemma 1/2, GPT-2's Conv1D weights transposed, MoE experts and
    StableLM's per-head q/k norms stacked), its generated tensors (Llama 3's rope_freqs, Phi-3's
    rope factors) and its ``set_gguf_parameters`` metadata, read from the config as the converter
    reads it (``AutoConfig.to_dict()``). ``qtype``: matrices quantized to it where their rows fit
    its blocks (vectors and the others stay F32)."""
    import gguf
    import transformers
    from safetensors.numpy import load_file

    hp = transformers.AutoConfig.from_pretrained(checkpoint).to_dict()
    family = hp["model_type"]
    arch = CONVERTED_ARCH[family]
    writer = gguf.GGUFWriter(str(out), arch)
    _converted_metadata(writer, hp, family)
    _add_tokenizer(writer, checkpoint)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), _hparam(hp, "num_hidden_layers", "n_layer"))
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    hf = {name: array.astype(np.float32) for name, array in load_file(str(checkpoint / "model.safetensors")).items()}
    for name, array in _converted_tensors(hf, hp, family):
        ours = name if name.startswith(("rope_", "blk.")) else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert ours is not None, name
        if array.ndim >= 2 and quant != gguf.GGMLQuantizationType.F32 and array.shape[-1] % gguf.GGML_QUANT_SIZES[quant][0] == 0:
            writer.add_tensor(ours, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(ours, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _hparam(hp: dict, *keys: str, default=None):
    return next((hp[k] for k in keys if hp.get(k) is not None), default)


def _rope_parameters(hp: dict) -> dict:
    """TextModel.__init__'s rope_parameters: the config's, with rope_theta and friends mirrored in."""
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        for key, found in (("rope_theta", _hparam(hp, "rope_theta")),
                           ("partial_rotary_factor", _hparam(hp, "partial_rotary_factor")),
                           ("original_max_position_embeddings", _hparam(hp, "original_max_position_embeddings"))):
            if key not in rope and found is not None:
                rope[key] = found
    return rope


def _converted_metadata(w, hp: dict, family: str) -> None:
    import math

    import gguf

    heads, hidden = _hparam(hp, "num_attention_heads", "n_head"), _hparam(hp, "hidden_size", "n_embd")
    layers, rope = _hparam(hp, "num_hidden_layers", "n_layer"), _rope_parameters(hp)
    if family == "gpt2":  # GPT2Model
        for add, value in ((w.add_block_count, layers), (w.add_context_length, hp.get("n_ctx", hp["n_positions"])),
                           (w.add_embedding_length, hidden), (w.add_feed_forward_length, 4 * hidden),
                           (w.add_head_count, heads), (w.add_layer_norm_eps, hp["layer_norm_epsilon"])):
            add(value)
    elif family == "phi":  # Phi2Model
        w.add_context_length(_hparam(hp, "n_positions", "max_position_embeddings"))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(4 * hidden)
        w.add_block_count(layers)
        w.add_head_count(heads)
        w.add_head_count_kv(heads)
        w.add_layer_norm_eps(_hparam(hp, "layer_norm_epsilon", "layer_norm_eps"))
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * hidden) // heads)
        w.add_add_bos_token(False)
    elif family == "phi3":  # Phi3MiniModel
        dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
        w.add_context_length(hp["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_block_count(layers)
        w.add_head_count(heads)
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_rope_dimension_count(dims)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(hp.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = hp["max_position_embeddings"] / rope["original_max_position_embeddings"]
            orig = rope["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    elif family == "stablelm":  # StableLMModel
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_block_count(layers)
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * (hidden // heads)))
        w.add_head_count(heads)
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_parallel_residual(hp.get("use_parallel_residual", True))
        w.add_layer_norm_eps(_hparam(hp, "layer_norm_eps", "norm_eps"))
    elif family in ("gemma", "gemma2"):  # GemmaModel, Gemma2Model
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_block_count(layers)
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(hp.get("num_key_value_heads", heads))
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
        if family == "gemma2":
            w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
            w.add_sliding_window(hp["sliding_window"])
    else:
        if family == "granite":
            hp = {k: v for k, v in hp.items() if k != "head_dim"}  # GraniteModel pops it
        _text_model_metadata(w, hp, rope)
        if family in LLAMA_MODELS:  # LlamaModel
            w.add_vocab_size(hp["vocab_size"])
            w.add_rope_dimension_count(hp.get("head_dim") or hidden // heads)
        if family == "granite":
            for add, key in ((w.add_attention_scale, "attention_multiplier"), (w.add_embedding_scale, "embedding_multiplier"),
                             (w.add_residual_scale, "residual_multiplier"), (w.add_logit_scale, "logits_scaling")):
                if hp.get(key):
                    add(hp[key])
        if family == "qwen3_moe" and hp.get("moe_intermediate_size") is not None:
            w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if family == "gemma3_text":  # Gemma3Model's overrides
            w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
            if hp.get("final_logit_softcapping"):
                w.add_final_logit_softcapping(hp["final_logit_softcapping"])
            if hp.get("sliding_window_pattern") != 1:
                w.add_sliding_window(hp["sliding_window"])
        if family == "olmo2" and "sliding_window" in hp:
            w.add_sliding_window(hp["sliding_window"])
            w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))


def _text_model_metadata(w, hp: dict, rope: dict) -> None:
    """TextModel.set_gguf_parameters."""
    from gguf import RopeScalingType

    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    if hp.get("num_key_value_heads") is not None:
        w.add_head_count_kv(hp["num_key_value_heads"])
    params = rope.get("full_attention", rope)
    kind = params.get("rope_type")
    if kind == "linear" and params.get("factor") is not None:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(params["factor"])
    elif kind == "yarn" and params.get("factor") is not None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        for add, keys in ((w.add_rope_scaling_yarn_ext_factor, ("extrapolation_factor",)),
                          (w.add_rope_scaling_yarn_attn_factor, ("attention_factor", "attn_factor")),
                          (w.add_rope_scaling_yarn_beta_fast, ("beta_fast",)),
                          (w.add_rope_scaling_yarn_beta_slow, ("beta_slow",))):
            if (value := _hparam(params, *keys)) is not None:
                add(value)
    elif kind == "longrope":
        w.add_rope_scaling_type(RopeScalingType.LONGROPE)
    if params.get("rope_theta") is not None:
        w.add_rope_freq_base(params["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    if hp.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if (eps := _hparam(hp, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")) is not None:
        w.add_layer_norm_eps(eps)
    if (experts := _hparam(hp, "num_local_experts", "num_experts")) is not None:
        w.add_expert_count(experts)
    if hp.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])


def _converted_tensors(hf: dict[str, np.ndarray], hp: dict, family: str):
    """(name for the tensor map, array) as the family's modify_tensors / generate_extra_tensors make them."""
    import re

    heads, kv = hp.get("num_attention_heads"), hp.get("num_key_value_heads")
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, array in sorted(hf.items()):
        if family in ("gemma", "gemma2") and name == "lm_head.weight":
            continue
        if family in GEMMAS and name.endswith("norm.weight"):
            array = array + np.float32(1)
        if family in LLAMA_MODELS and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = permute(array, heads)
        if family in LLAMA_MODELS and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = permute(array, kv)
        if family == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            array = array.T
        if found := re.match(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w\d)\.weight$", name):  # Mixtral
            bid, expert, part = found.groups()
            stacked.setdefault(f"layers.{bid}.feed_forward.experts.{part}.weight", {})[int(expert)] = array
        elif found := re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name):  # Qwen3 MoE
            stacked.setdefault(f"{found[1]}.{found[3]}.weight", {})[int(found[2])] = array
        elif found := re.match(r"(model\.layers\.\d+\.self_attn\.[qk]_layernorm)\.norms\.(\d+)\.weight$", name):  # StableLM
            stacked.setdefault(f"{found[1]}.weight", {})[int(found[2])] = array
        else:
            yield name, array
    for name, parts in stacked.items():
        yield name, np.stack([parts[j] for j in range(len(parts))])
    rope = _rope_parameters(hp)
    if family in LLAMA_MODELS and rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_rope_freqs(hp, rope)
    if family == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32)


def _llama3_rope_freqs(hp: dict, rope: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors."""
    import math

    import torch

    base, dim = rope.get("rope_theta", 10000.0), hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()
