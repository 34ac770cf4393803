"""Tokenization for the runtime: the ``tokenizers`` library on the artifact's tokenizer.json.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas that are always
valid UTF-8: a token that ends inside a multi-byte character (byte-level BPE splits emoji and
CJK across tokens) produces no text until the character is complete.
"""

from __future__ import annotations

import functools
from tokenizers import Tokenizer as _HFTokenizer

from llmx.artifact.handle import Artifact
from llmx.errors import ArtifactError, InputError

_REPLACEMENT = "\ufffd"


class Tokenizer:
    def __init__(self, artifact: Artifact):
        section = artifact.manifest.tokenizer
        path = artifact.file(section.file, "tokenizer.file")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ArtifactError(f"cannot load tokenizer {path}: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
        self._tok.no_padding()  # padding is the runtime's job, with attention masks
        self.bos_token_id: int | None = section.bos_token_id
        self.eos_token_ids: list[int] = list(section.eos_token_ids)
        self.pad_token_id: int = section.pad_token_id or 0
        self.chat_template: str | None = _read_template(artifact, section.chat_template)
        self.bos_token, self.eos_token = section.bos_token, section.eos_token

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def added_tokens(self, special_only: bool = False) -> dict[str, int]:
        """Tokens added to the vocabulary (control and marker tokens): their text and id."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special or not special_only}

    def to_json(self) -> str:
        """The tokenizer as tokenizers' JSON (constrained decoding builds its own index from it)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            # encode_batch releases the GIL while it works (encode does not): a 1 MiB prompt held
            # every other thread, the server's scheduler included, for 1.8 s.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:  # lone surrogates (JSON "\ud800", undecodable argv bytes) are not text
            text.encode("utf-8")  # the UnicodeEncodeError says where
            raise
        except UnicodeEncodeError as exc:
            raise InputError(f"text is not valid Unicode (a lone surrogate at character {exc.start})") from None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """No token stands for more characters than this: vocabulary strings spell each byte
        (byte-level BPE) or character (SentencePiece, WordPiece) of a token, or more."""
        return max(map(len, self.vocab()), default=1)

    def truncate_to(self, max_tokens: int) -> None:
        """Truncate every encoding to ``max_tokens``, keeping special tokens ([CLS] ... [SEP])."""
        self._tok.enable_truncation(max_length=max_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as OpenAI's logprobs report it."""
        return self._tok.decode([token_id], skip_special_tokens=False)


def _read_template(artifact: Artifact, rel: str | None) -> str | None:
    if rel is None:
        return None
    path = artifact.file(rel, "tokenizer.chat_template")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"cannot read the chat template {rel}: {exc}") from exc


class IncrementalDetokenizer:
    """Text deltas from a growing token list (the prefix/read-offset scheme used by vLLM and TGI).

    Decoding a window that starts a few tokens back keeps tokenizers that drop a leading
    space on the first token (SentencePiece) from gluing words together.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], window: int = 5, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - window, 0)
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix, full = self._window()
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix, full = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _window(self) -> tuple[str, str]:
        """The text of the window up to the read offset, and of the whole window."""
        start, skip = self.prefix_offset, self.skip_special_tokens
        return (self.tokenizer.decode(self.ids[start : self.read_offset], skip_special_tokens=skip),
                self.tokenizer.decode(self.ids[start:], skip_special_tokens=skip))
