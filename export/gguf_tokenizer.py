"""A GGUF's tokenizer (``tokenizer.ggml.*`` metadata) as a ``tokenizers`` tokenizer.json.

GGUF stores the vocabulary as token strings, types and (for BPE) merges; this rebuilds the
byte-level BPE tokenizer they came from (``tokenizer.ggml.model = "gpt2"``: GPT-2, Llama 3,
Qwen2, SmolLM and most BPE models). The pre-tokenizer's split regex is not in the file, only
its name (``tokenizer.ggml.pre``): names llmx knows map to their regex, others are refused
rather than guessed. A file that embeds the original ``tokenizer.huggingface.json`` is used
as is. SentencePiece vocabularies (``"llama"``) are refused with a message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmx.errors import CheckpointError

# tokenizer.ggml.pre -> the split regex before byte-level encoding (None: GPT-2's own).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str | None] = {"gpt-2": None, "default": None, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                                         "smaug-bpe": _LLAMA3, "qwen2": _QWEN2}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens


def _pre_tokenizer(name: str | None):
    from tokenizers import Regex, pre_tokenizers

    if name not in PRE_TOKENIZERS and name is not None:
        raise CheckpointError(f"GGUF pre-tokenizer {name!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    regex = PRE_TOKENIZERS.get(name)
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_bpe(field) -> "tokenizers.Tokenizer":
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens: list[str] = field("tokenizer.ggml.tokens") or []
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]
    types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(field("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == CONTROL]
    added = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    tok.add_special_tokens(specials)
    tok.add_tokens(added)
    bos = field("tokenizer.ggml.bos_token_id")
    if field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                                                           special_tokens=[(tokens[bos], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _tokenizer(field) -> "tokenizers.Tokenizer":
    from tokenizers import Tokenizer

    if embedded := field("tokenizer.huggingface.json"):
        return Tokenizer.from_str(embedded)
    model = field("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model {model!r} is not supported (supported: byte-level BPE, 'gpt2')")
    return _byte_level_bpe(field)


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
