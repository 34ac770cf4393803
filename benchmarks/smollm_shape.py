"""A SmolLM-135M-shaped Llama checkpoint with random weights, built locally (nothing downloads).

Shape of HuggingFaceTB/SmolLM-135M: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate
1536, vocab 49152, tied embeddings, 2048 positions. Speed depends on shapes, not on weight
values, so random weights measure what the real checkpoint would. The tokenizer is a
byte-level BPE with exactly 49152 entries (256 bytes, 6 specials, then two-character merges),
written as tokenizer.json directly, so every engine sees a complete vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

SMOLLM_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# TinyLlama-1.1B's shape (TinyLlama/TinyLlama-1.1B-Chat-v1.0): the 1.1B point of issue 17's comparison.
TINYLLAMA_1_1B = dict(
    SMOLLM_135M,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
)
SHAPES = {"smollm-135m": SMOLLM_135M, "tinyllama-1.1b": TINYLLAMA_1_1B}
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= vocab_size:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
    }))


def build_checkpoint(directory: Path, seed: int = 0, shape: str = "smollm-135m") -> Path:
    """Write the checkpoint of ``shape`` (a SHAPES key) into ``directory`` once; later calls reuse it."""
    directory = Path(directory)
    if (directory / "config.json").is_file() and (directory / "model.safetensors").is_file():
        return directory
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, SHAPES[shape]["vocab_size"])
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPES[shape])
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    import sys

    print(build_checkpoint(Path(sys.argv[1])))
