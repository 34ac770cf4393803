"""Tiny local Hugging Face checkpoints for tests: random weights, a small trained BPE tokenizer.

Nothing is downloaded: the tokenizer is trained on a CPython stdlib module's source and the
model is a transformers config with random weights, saved with ``save_pretrained``.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Small but complete shapes: GQA (heads 4, kv 2), 2 layers, all family quirks switched on.
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def train_tokenizer(directory: Path, vocab_size: int = 320, added_tokens: tuple[str, ...] = ()) -> int:
    """``added_tokens``: extra tokens of their own after training (not special, as Qwen's <tool_call>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([inspect.getsource(textwrap), inspect.getsource(json)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.add_tokens(list(added_tokens))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return tok.get_vocab_size()


# -- parallel blocks, partial rotary, q/k LayerNorm, MoE (issue 14) ------------------------
def _fam_b_configs() -> dict:
    import transformers as T

    return {"phi": T.PhiConfig, "gpt_neox": T.GPTNeoXConfig, "stablelm": T.StableLmConfig,
            "starcoder2": T.Starcoder2Config, "mixtral": T.MixtralConfig, "qwen3_moe": T.Qwen3MoeConfig}


FAM_B_EXTRA = {
    "phi": dict(num_key_value_heads=4, partial_rotary_factor=0.5),
    "gpt_neox": dict(num_key_value_heads=None, rotary_pct=0.25),  # MHA only; rotary on 4 of 16 dims
    "stablelm": dict(num_key_value_heads=2, partial_rotary_factor=0.5),
    "starcoder2": dict(sliding_window=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16),
}


def make_config(family: str, vocab_size: int, **overrides):
    import transformers as T

    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gpt2":
        cfg = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
        return T.GPT2Config(**{**cfg, **overrides})
    cls = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, **_issue14_configs(T),
           **_fam_b_configs()}[family]
    extra = {"mistral": dict(sliding_window=16, num_key_value_heads=1), "llama": dict(tie_word_embeddings=False),
             **FAM_B_EXTRA}.get(family, {})
    return cls(**{**TINY, **common, **extra, **overrides})


def _issue14_configs(T) -> dict:
    return {"qwen3": T.Qwen3Config, "gemma": T.GemmaConfig, "gemma2": T.Gemma2Config, "gemma3_text": T.Gemma3TextConfig,
            "granite": T.GraniteConfig, "olmo2": T.Olmo2Config, "smollm3": T.SmolLM3Config, "phi3": T.Phi3Config}


def make_checkpoint(directory: Path, family: str = "llama", seed: int = 0, random_vectors: bool = False,
                    added_tokens: tuple[str, ...] = (), **overrides) -> Path:
    """``random_vectors``: norm weights and biases get noise too, so no two are equal (the exporter
    would merge equal initializers) and a norm applied to the wrong tensor shows in the logits."""
    import torch
    import transformers as T

    vocab = train_tokenizer(directory, added_tokens=added_tokens)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(make_config(family, vocab, **overrides))
    # Random init is near-uniform over the vocab; scale up so greedy choices are decisive
    # and parity tests compare real argmaxes, not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(2.5)
            elif random_vectors:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(directory)
    return directory
