"""A GGUF's tokenizer (``tokenizer.ggml.*`` metadata) as a ``tokenizers`` tokenizer.json.

GGUF stores the vocabulary as token strings, types, scores and (for byte-level BPE) merges;
this rebuilds the tokenizer they came from, as transformers' GGUF loader does:

- ``tokenizer.ggml.model = "gpt2"``: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM). The
  pre-tokenizer's split regexes are not in the file, only its name (``tokenizer.ggml.pre``):
  each name llama.cpp knows maps to llama.cpp's regexes (gguf_pretokenizers), others are
  refused rather than guessed.
- ``"llama"``: SentencePiece BPE (Llama 2, TinyLlama, Mistral): merges recovered from the
  scores, byte fallback through the ``<0xNN>`` pieces, U+2581 standing for spaces.

Control tokens become special tokens, user-defined ones added tokens. A file that embeds the
original ``tokenizer.huggingface.json`` is used as is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmx.errors import CheckpointError
from llmx.export.gguf_pretokenizers import IGNORE_MERGES, pre_tokenizer

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens
SPACE = "\u2581"  # SentencePiece's stand-in for a space


def _byte_level_bpe(field) -> "tokenizers.Tokenizer":
    from tokenizers import Tokenizer, decoders, models

    tokens: list[str] = field("tokenizer.ggml.tokens") or []
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]
    pre = field("tokenizer.ggml.pre")
    # llama.cpp takes a piece that is itself a token whole, before any merge, for these names (as Llama 3's
    # tokenizer.json says with "ignore_merges": true)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(field) -> "tokenizers.Tokenizer":
    """Llama/Mistral's SentencePiece BPE: merges recovered from the scores, bytes as <0xNN> pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens: list[str] = field("tokenizer.ggml.tokens") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = field("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    unk = field("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(vocab, dict(zip(tokens, scores))),
                               unk_token=tokens[unk] if unk is not None else None, fuse_unk=True, byte_fallback=True))
    prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    # SentencePiece's own normalization, as llama.cpp applies it: a space before the text (each
    # run of text between special tokens) and every space as U+2581, so " Hello" is "▁▁Hello"
    # (two pieces); a Metaspace pre-tokenizer would not prefix text that already starts with one.
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tok


def _merges_by_score(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best-scoring piece first (transformers' generate_merges)."""
    merges = []
    for piece, score in scores.items():
        pairs = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend((left, right, score) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tok, field) -> None:
    from tokenizers import AddedToken, processors

    tokens: list[str] = field("tokenizer.ggml.tokens") or []
    types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    bos = field("tokenizer.ggml.bos_token_id")
    if field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        first = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(single=f"{first} $A", pair=f"{first} $A {first} $B",
                                                           special_tokens=[(first, bos)])
    elif field("tokenizer.ggml.model") == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)


BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _tokenizer(field) -> "tokenizers.Tokenizer":
    from tokenizers import Tokenizer

    if embedded := field("tokenizer.huggingface.json"):
        return Tokenizer.from_str(embedded)
    model = field("tokenizer.ggml.model")
    if model not in BUILDERS:
        raise CheckpointError(f"GGUF tokenizer model {model!r} is not supported (supported: {', '.join(BUILDERS)})")
    tok = BUILDERS[model](field)
    _add_special_tokens(tok, field)
    return tok


def _chat_template(field) -> str | None:
    template = field("tokenizer.chat_template")
    return template if isinstance(template, str) and template else None


def package_gguf_tokenizer(field, dst: Path) -> dict[str, Any]:
    """Write ``dst/tokenizer`` from GGUF metadata (``field(key)`` reads one); the manifest section."""
    tok = _tokenizer(field)
    out = dst / "tokenizer"
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    vocab = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    bos, eos, pad = (field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding"))
    eos_ids = [int(eos)] if eos is not None else []
    if (eot := field("tokenizer.ggml.eot_token_id")) is not None and eot not in eos_ids:
        eos_ids.append(int(eot))
    template = _chat_template(field)
    if template:
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": vocab.get(bos), "eos_token": vocab.get(eos), "pad_token": vocab.get(pad),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2))
    return {
        "file": "tokenizer/tokenizer.json",
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "bos_token_id": bos,
        "eos_token_ids": eos_ids,
        "pad_token_id": pad,
        "bos_token": vocab.get(bos),
        "eos_token": vocab.get(eos),
        "chat_template": "tokenizer/chat_template.jinja" if template else None,
    }
