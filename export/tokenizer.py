"""Packaging a checkpoint's tokenizer into an artifact's ``tokenizer/`` folder.

The runtime uses the ``tokenizers`` library on ``tokenizer.json`` only, so export resolves
everything else once: GPT-2-style ``vocab.json`` + ``merges.txt`` become a tokenizer.json,
special tokens become ids in the manifest, and the chat template (from tokenizer_config.json,
chat_template.jinja or chat_template.json) becomes ``tokenizer/chat_template.jinja``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from llmx.errors import CheckpointError

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _load_tokenizer(src: Path) -> Tokenizer:
    if (src / "tokenizer.json").is_file():
        try:
            return Tokenizer.from_file(str(src / "tokenizer.json"))
        except Exception as exc:
            raise CheckpointError(f"cannot read {src / 'tokenizer.json'}: {exc}") from exc
    if (src / "vocab.json").is_file() and (src / "merges.txt").is_file():
        from tokenizers import decoders, models, pre_tokenizers, processors

        tok = Tokenizer(models.BPE.from_file(str(src / "vocab.json"), str(src / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return tok
    raise CheckpointError(
        f"{src} has no tokenizer.json (nor vocab.json + merges.txt); save the checkpoint with a fast tokenizer"
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized as {"content": ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _chat_template(src: Path, tok_config: dict) -> str | None:
    if (src / "chat_template.jinja").is_file():
        return (src / "chat_template.jinja").read_text()
    template = _read_json(src / "chat_template.json").get("chat_template") or tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def package_tokenizer(src: Path, dst: Path, model_config: dict) -> dict[str, Any]:
    """Copy/convert the tokenizer into ``dst/tokenizer`` and return the manifest section."""
    tok = _load_tokenizer(src)
    # Some checkpoints ship tokenizer.json with fixed padding/truncation switched on (MiniLM pads
    # every input to 128); the runtime pads and truncates itself, with masks.
    tok.no_padding()
    tok.no_truncation()
    out = dst / "tokenizer"
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    for name in COPIED[1:]:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    tok_config = _read_json(src / "tokenizer_config.json")
    gen_config = _read_json(src / "generation_config.json")

    def token_id(key: str) -> int | None:
        text = _token_text(tok_config.get(key))
        return tok.token_to_id(text) if text else None

    eos = _ids(gen_config.get("eos_token_id")) or _ids(model_config.get("eos_token_id"))
    if (tok_eos := token_id("eos_token")) is not None and tok_eos not in eos:
        eos.append(tok_eos)
    bos = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
    bos = bos if bos is not None else token_id("bos_token")
    pad = gen_config.get("pad_token_id", model_config.get("pad_token_id"))
    pad = pad if pad is not None else token_id("pad_token")
    template = _chat_template(src, tok_config)
    if template:
        (out / "chat_template.jinja").write_text(template)
    return {
        "file": "tokenizer/tokenizer.json",
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "bos_token_id": bos,
        "eos_token_ids": eos,
        "pad_token_id": pad if not isinstance(pad, list) else pad[0],
        "bos_token": _token_text(tok_config.get("bos_token")),
        "eos_token": _token_text(tok_config.get("eos_token")),
        "chat_template": "tokenizer/chat_template.jinja" if template else None,
    }
