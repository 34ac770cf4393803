"""Constrained decoding: a JSON schema, regex or Lark grammar limits which tokens may come next.

    spec = ConstraintSpec.json_schema({"type": "object", ...})
    compiled = compile_constraint(spec, tokenizer, vocab_size)   # checked here: ConstraintError
    matcher = compiled.matcher()                                  # one per sequence
    logits = matcher.mask_logits(logits); token = sample(logits); matcher.advance(token)

Built on llguidance (torch-free; what onnxruntime-genai, TensorRT-LLM and vLLM use), chosen over
xgrammar by measurement (benchmarks/constraint_cost.py, docs/decoding.md). The grammar is
compiled and tried once when the request arrives, so a bad schema, an unsupported feature or a
grammar no text can match is a ``ConstraintError`` (the CLI's ``error:`` line, the server's
400) before any work is queued. A sequence's matcher knows the tokens allowed next (EOS only
where the grammar accepts) and when the grammar is finished. ``prefetch_masks`` computes the
next masks of a batch's constrained rows in llguidance's own threads (which release the GIL)
while the model step runs; rows without a constraint never reach this module.
"""

from __future__ import annotations

import functools
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from llmx.errors import InputError, require
from llmx.runtime.json_numbers import NumberBound, NumberState, narrow

KINDS = ("json_object", "json_schema", "regex", "lark", "llguidance")
JSON_KINDS = ("json_object", "json_schema")
# JSON on one line with Python's json.dumps separators (", " and ": "), no other whitespace: a
# small model given free whitespace pads objects with newlines until max_tokens runs out, and
# compact separators ("," and ":") are the spelling models see least, which also left prompt
# lookup nothing to copy when the prompt quotes JSON the usual way (SmolLM2-135M rewriting a
# json.dumps record: 13 % of drafts kept with "," and ":", 98 % with these). A schema's own
# "x-guidance" overrides them.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 256 * 1024
PURPOSE = "constrained decoding (response_format, --json-schema, --regex, --grammar)"


class ConstraintError(InputError):
    """A schema, regex or grammar that cannot be used: malformed, unsupported, or unsatisfiable."""


def _llg():
    return require("llguidance", PURPOSE, "serve", hint="pip install llguidance")


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match. ``text`` is the JSON schema (a JSON string), the regex, the
    Lark grammar (llguidance's dialect: ``%json{...}`` embeds a schema), or a whole llguidance
    grammar (JSON ``{"grammars": [...]}``); empty for json_object. ``bound_numbers``: JSON numbers
    in the output close (runtime/json_numbers.py); always on for the JSON kinds, asked for by
    grammars whose output is mostly JSON (tool calls)."""

    kind: str
    text: str = ""
    bound_numbers: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ConstraintError(f"a {self.kind} constraint needs text, got {type(self.text).__name__}")
        try:
            self.text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConstraintError(f"the {self.kind} is not valid Unicode text (a lone surrogate at character {exc.start})") from None
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ConstraintError(f"the {self.kind} is {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
        if self.kind in JSON_KINDS:
            object.__setattr__(self, "bound_numbers", True)

    @classmethod
    def json_object(cls) -> "ConstraintSpec":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "ConstraintSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order kept: it is the order properties are written in

    @classmethod
    def regex(cls, pattern: str) -> "ConstraintSpec":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str, bound_numbers: bool = False) -> "ConstraintSpec":
        return cls("lark", grammar, bound_numbers)

    @classmethod
    def llguidance(cls, grammar: str | dict) -> "ConstraintSpec":
        """A full llguidance grammar (``{"grammars": [{"lark_grammar": ...}, {"json_schema": ...}]}``)."""
        return cls("llguidance", grammar if isinstance(grammar, str) else json.dumps(grammar))

    def grammar(self) -> str:
        """The llguidance grammar text for this spec."""
        m = _llg().LLMatcher
        try:
            if self.kind in ("json_object", "json_schema"):
                schema = self.text if self.kind == "json_schema" else '{"type": "object"}'
                return m.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
            if self.kind == "regex":
                return m.grammar_from_regex(self.text)
            if self.kind == "lark":
                return m.grammar_from_lark(self.text)
        except ValueError as exc:
            raise ConstraintError(f"invalid {self.kind}: {_first_line(exc)}") from None
        return self.text


def _first_line(message: Any) -> str:
    """llguidance's messages span lines (source excerpts, carets, parser state): keep the
    first and the one that says what is wrong."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    return (lines[0] + (f" ({reason.removeprefix('error:').strip()})" if reason else ""))[:400]


class _Tokenizers:
    """llguidance's tokenizer per runtime tokenizer and vocabulary width, built once (~20 ms)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._built: dict[tuple[int, int], tuple[Any, Any]] = {}

    def get(self, tokenizer, vocab_size: int):
        key = (id(tokenizer), vocab_size)
        with self._lock:
            hit = self._built.get(key)
            if hit is None or hit[0] is not tokenizer:
                llg = _llg()
                built = llg.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids))
                hit = self._built[key] = (tokenizer, built)
            return hit[1]


_TOKENIZERS = _Tokenizers()


class CompiledConstraint:
    """A checked grammar for one tokenizer: makes a fresh Matcher per sequence (a copy of a
    prototype, so the grammar is compiled once however many sequences use it)."""

    def __init__(self, spec: ConstraintSpec, llg_tokenizer, vocab_size: int):
        self.spec, self.vocab_size = spec, vocab_size
        llg = _llg()
        grammar = spec.grammar()
        error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, llg_tokenizer)
        if error:
            raise ConstraintError(f"invalid {_name(spec.kind)}: {_first_line(messages[0])}")
        self._prototype = llg.LLMatcher(llg_tokenizer, grammar, log_level=0)
        self._numbers = NumberBound.for_llg(llg_tokenizer, vocab_size) if spec.bound_numbers else None
        first = self.matcher()
        if first.mask().sum() == 0 or first.error:  # computing the first mask finds dead grammars
            raise ConstraintError(f"the {_name(spec.kind)} cannot match any text" + (f": {first.error}" if first.error and
                                  not first.error.startswith("NoExtensionBias") else ""))

    def matcher(self) -> "Matcher":
        return Matcher(self._prototype.deep_copy(), self.vocab_size, self._numbers.state() if self._numbers else None)


def _name(kind: str) -> str:
    return {"json_object": "JSON object constraint", "json_schema": "JSON schema", "lark": "grammar",
            "llguidance": "grammar"}.get(kind, kind)


def compile_constraint(spec: ConstraintSpec, tokenizer, vocab_size: int | None = None) -> CompiledConstraint:
    """Check ``spec`` against ``tokenizer`` (the runtime Tokenizer); ``vocab_size`` is the width of
    the model's logits (at least the tokenizer's). Raises ConstraintError on anything unusable.
    Compiled constraints are cached per spec, so a schema sent with every request compiles once."""
    width = max(vocab_size or 0, tokenizer.vocab_size)
    return _compile_cached(spec, _TOKENIZERS.get(tokenizer, width), width)


@functools.lru_cache(maxsize=64)
def _compile_cached(spec: ConstraintSpec, llg_tokenizer, width: int) -> CompiledConstraint:
    return CompiledConstraint(spec, llg_tokenizer, width)


class Matcher:
    """One sequence's position in its grammar: the allowed next tokens, ``advance``, ``finished``."""

    def __init__(self, matcher, vocab_size: int, numbers: NumberState | None = None):
        self._m, self.vocab_size, self._numbers = matcher, vocab_size, numbers
        self._words = np.empty((1, (vocab_size + 31) // 32), dtype=np.int32)
        self._fresh = False  # _words holds the mask for the current state

    @property
    def error(self) -> str:
        return _first_line(self._m.get_error()) if self._m.is_error() else ""

    @property
    def accepting(self) -> bool:
        """The output so far is complete (EOS is allowed)."""
        return self._m.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing may follow (the grammar is complete, or the matcher failed)."""
        return self._m.is_stopped()

    def mask(self) -> np.ndarray:
        """Allowed next tokens, a bool array [vocab_size]."""
        self._compute()
        return np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size].view(bool)

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` [V] with every disallowed token at -inf (in place; V may exceed vocab_size)."""
        self._compute()
        banned = np.unpackbits((~self._words).view(np.uint8), bitorder="little")[: self.vocab_size].view(bool)
        np.putmask(logits[: self.vocab_size], banned, -np.inf)
        if logits.shape[0] > self.vocab_size:
            logits[self.vocab_size:] = -np.inf
        return logits

    def _compute(self) -> None:
        if not self._fresh:
            self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            self._narrow()
            self._fresh = True

    def _narrow(self) -> None:
        if self._numbers is not None:
            narrow(self._words[0], self._numbers.banned())

    def advance(self, token: int) -> bool:
        """Consume the chosen token; False when the grammar refused it (the matcher is then finished)."""
        self._fresh = False
        if self._numbers is not None:
            self._numbers.advance(int(token))
        return self._m.consume_token(int(token))

    def _set_words(self, words: np.ndarray) -> None:
        self._words[0] = words
        self._narrow()
        self._fresh = True


_prefetcher: ThreadPoolExecutor | None = None
_executor = None
_setup = threading.Lock()


def prefetch_masks(matchers: Iterable[Matcher]) -> Future | None:
    """Start computing the next masks of ``matchers`` in the background (while the model step
    runs); ``Future.result()`` stores them. None when there is nothing to compute."""
    todo = [m for m in matchers if not m._fresh and not m.finished]
    if not todo:
        return None
    global _prefetcher, _executor
    with _setup:
        if _prefetcher is None:
            _prefetcher = ThreadPoolExecutor(1, thread_name_prefix="llmx-masks")
            _executor = _llg().LLExecutor()
    return _prefetcher.submit(_fill, todo, _executor)


def _fill(todo: list[Matcher], executor) -> None:
    words = np.empty((len(todo), todo[0]._words.shape[1]), dtype=np.int32)
    executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(todo)], words.ctypes.data, words.shape[1] * 4,
                                     len(todo))
    for m, row in zip(todo, words):
        m._set_words(row)
