"""Calibration and evaluation text: reading it, hashing it, cutting it into token windows.

``--data`` is a UTF-8 text file, a JSONL file whose lines carry a ``text`` field, or a folder
of text files (read recursively in sorted order; hidden entries and ``__pycache__`` skipped).
Documents are tokenized, joined with the end-of-sequence token and cut into windows of
``seq_len`` tokens, each starting with the beginning-of-sequence token when the model has one:
the shape of text the model saw in training.

The held-out split is the *tail* of the windows: the end of a single file, or the last files
of a folder. Evaluating on text that did not drive the ranges keeps the quality report honest,
and the split is the same on every run over the same data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmx.errors import InputError

MIN_SEQ_LEN = 8
HELD_OUT_FRACTION = 0.2
_SKIP_DIRS = {"__pycache__"}


@dataclass
class Document:
    name: str  # path relative to --data (or "file:line" for JSONL)
    text: str


@dataclass
class TextData:
    """What ``--data`` held: documents plus a hash of the exact bytes read."""

    source: str
    documents: list[Document]
    sha256: str


@dataclass
class Split:
    calibration: list[list[int]]  # token windows that drive the quantization ranges
    evaluation: list[list[int]]  # held-out windows for the quality report
    seq_len: int
    total_windows: int


def read_text_data(path: str | Path) -> TextData:
    """Read ``--data`` into documents; any unreadable or non-UTF-8 input is an InputError."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"data {path} does not exist")
    digest = hashlib.sha256()
    if path.is_dir():
        files = _text_files(path)
        if not files:
            raise InputError(f"data folder {path} holds no files")
        documents = []
        for f in files:
            raw = f.read_bytes()
            digest.update(f.relative_to(path).as_posix().encode() + b"\0" + raw + b"\0")
            documents.append(Document(f.relative_to(path).as_posix(), _decode(raw, f)))
    else:
        raw = path.read_bytes()
        digest.update(raw)
        text = _decode(raw, path)
        documents = _jsonl_documents(text, path) if path.suffix.lower() == ".jsonl" else [Document(path.name, text)]
    documents = [d for d in documents if d.text.strip()]
    if not documents:
        raise InputError(f"data {path} is empty (no text to calibrate or evaluate on)")
    return TextData(str(path), documents, digest.hexdigest())


def _text_files(folder: Path) -> list[Path]:
    def visible(p: Path) -> bool:
        rel = p.relative_to(folder).parts
        return not any(part.startswith(".") or part in _SKIP_DIRS for part in rel)

    return sorted(p for p in folder.rglob("*") if p.is_file() and visible(p))


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "convert it to UTF-8 or leave it out"
        ) from None


def _jsonl_documents(text: str, path: Path) -> list[Document]:
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number} is not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f'{path}:{number} has no string "text" field')
        documents.append(Document(f"{path.name}:{number}", record["text"]))
    return documents


def token_windows(tokenizer, data: TextData, seq_len: int) -> list[list[int]]:
    """Cut the tokenized documents (joined by EOS) into full windows of ``seq_len`` tokens, each
    starting with what the tokenizer puts before a prompt (``start_tokens``)."""
    if seq_len < MIN_SEQ_LEN:
        raise InputError(f"--seq-len must be at least {MIN_SEQ_LEN}, got {seq_len}")
    eos = tokenizer.eos_token_ids[:1]
    stream: list[int] = []
    for doc in data.documents:
        stream.extend(tokenizer.encode(doc.text, add_special_tokens=False))
        stream.extend(eos)
    start = start_tokens(tokenizer)
    body = seq_len - len(start)
    return [start + stream[i : i + body] for i in range(0, len(stream) - body + 1, body)]


def start_tokens(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before any text: BOS for Llama-style tokenizers,
    none for GPT-2-style ones or a GGUF whose ``add_bos_token`` is false. Windows start as the
    model's prompts do, which is also what llama-perplexity scores (a BOS the model never sees
    in use shifts every window by a token: +0.9 % perplexity on a Q4_0 SmolLM2 file)."""
    probe = "a"
    plain, full = tokenizer.encode(probe, add_special_tokens=False), tokenizer.encode(probe, add_special_tokens=True)
    at = next((k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain), 0)
    return full[:at]


def split_windows(windows: list[list[int]], seq_len: int, samples: int, eval_samples: int,
                  eval_windows: list[list[int]] | None = None, source: str = "data") -> Split:
    """Calibration windows (at most ``samples``, evenly spread) and held-out evaluation windows.

    With ``eval_windows`` (from ``--eval-data``) every window of ``--data`` may calibrate;
    otherwise the last ``HELD_OUT_FRACTION`` of the windows (at least one) is held out.
    """
    if samples < 1 or eval_samples < 1:
        raise InputError("--samples and --eval-samples must be at least 1")
    needed = 1 if eval_windows is not None else 2
    if len(windows) < needed:
        raise InputError(
            f"{source} gives {len(windows)} window(s) of {seq_len} tokens; need at least {needed} "
            f"({'one to calibrate' if needed == 1 else 'one to calibrate and one to evaluate'}): "
            "give more text or a smaller --seq-len"
        )
    if eval_windows is None:
        held = max(1, round(len(windows) * HELD_OUT_FRACTION))
        windows, eval_windows = windows[:-held], windows[-held:]
    return Split(spread(windows, samples), pick_windows(eval_windows, eval_samples, seq_len, "--eval-data"),
                 seq_len, len(windows))


def pick_windows(windows: list[list[int]], n: int, seq_len: int, source: str) -> list[list[int]]:
    """At most ``n`` windows to score, evenly spread; an error if there are none."""
    if n < 1:
        raise InputError("the number of windows to score must be at least 1")
    if not windows:
        raise InputError(f"{source} gives no window of {seq_len} tokens: give more text or a smaller --seq-len")
    return spread(windows, n)


def spread(windows: list[list[int]], n: int) -> list[list[int]]:
    """At most ``n`` windows, evenly spaced through the list (deterministic)."""
    if len(windows) <= n:
        return windows
    picks = np.linspace(0, len(windows) - 1, n).round().astype(int)
    return [windows[i] for i in picks]
