"""JSON numbers that close: a bound on the digits of every number a JSON constraint writes.

llguidance's JSON compiler writes an unbounded number as ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?``
(parser/src/json/numeric.rs, ``rx_float_range(None, None)``) and has no option to limit it, so a
small model can write ``1112222333333...`` until ``max_tokens`` and the reply never parses. Bounds in
the schema cannot fix it: ``minimum``/``maximum`` over the int64 range fail to compile
("Failed to generate regex for integer range") and nothing bounds a fraction's digits.

So the JSON constraints narrow llguidance's mask: outside strings, a number's integer part has at
most ``INT_DIGITS`` digits (every such integer fits an int64), its fraction at most
``FRACTION_DIGITS`` and its exponent at most ``EXPONENT_DIGITS`` (so every number parses to a
finite float64). The narrowing only removes tokens; where it would leave none (a schema whose
``minimum`` needs more digits) llguidance's mask stands unchanged, so no schema dead-ends here.
"""

from __future__ import annotations

import functools

import numpy as np

INT_DIGITS, FRACTION_DIGITS, EXPONENT_DIGITS = 18, 18, 2
_LIMITS = {"int": INT_DIGITS, "frac": FRACTION_DIGITS, "exp": EXPONENT_DIGITS}
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")
_DIGITS = frozenset(b"0123456789")


def _step(part: str | None, count: int, byte: int) -> tuple[str | None, int]:
    """The number state after one byte outside a string: which part is being written and its digits."""
    if byte in _DIGITS:
        return ("int", 1) if part is None else (part, count + 1)
    if byte == ord("-") and part is None:
        return "int", 0
    if byte == ord(".") and part == "int":
        return "frac", 0
    if byte in b"eE" and part in ("int", "frac"):
        return "exp", 0
    if byte in b"+-" and part == "exp":
        return part, count
    return None, 0


class NumberBound:
    """Per tokenizer: each token's leading run of number characters, grouped, and the tokens each
    number state must ban (cached: a state is a part and a digit count, so there are few)."""

    def __init__(self, token_bytes: list[bytes]):
        groups: dict[bytes, list[int]] = {}
        for token, data in enumerate(token_bytes):
            run = 0
            while run < len(data) and data[run] in _NUMBER_BYTES:
                run += 1
            if run:
                groups.setdefault(data[:run], []).append(token)
        self._groups = [(prefix, np.array(ids, dtype=np.int64)) for prefix, ids in groups.items()]
        self._token_bytes = token_bytes

    @classmethod
    def for_llg(cls, llg_tokenizer, vocab_size: int) -> "NumberBound":
        return _bound_for(llg_tokenizer, vocab_size)

    @functools.lru_cache(maxsize=None)
    def banned(self, part: str | None, count: int) -> np.ndarray:
        """Token ids whose leading number characters would take a number past its bound."""
        out = []
        for prefix, ids in self._groups:
            p, c = part, count
            for byte in prefix:
                p, c = _step(p, c, byte)
                if p is not None and c > _LIMITS[p]:
                    out.append(ids)
                    break
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def state(self) -> "NumberState":
        return NumberState(self)


class NumberState:
    """One sequence's place in its JSON text: inside a string (and after a backslash) or in a number."""

    def __init__(self, bound: NumberBound):
        self._bound = bound
        self.in_string = self.escape = False
        self.part: str | None = None
        self.count = 0

    def advance(self, token: int) -> None:
        data = self._bound._token_bytes[token] if token < len(self._bound._token_bytes) else b""
        for byte in data:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif byte == ord("\\"):
                    self.escape = True
                elif byte == ord('"'):
                    self.in_string = False
            elif byte == ord('"'):
                self.in_string, self.part, self.count = True, None, 0
            else:
                self.part, self.count = _step(self.part, self.count, byte)

    def banned(self) -> np.ndarray | None:
        """Tokens to remove from the grammar's mask now (None inside a string)."""
        return None if self.in_string else self._bound.banned(self.part, self.count)


@functools.lru_cache(maxsize=8)
def _bound_for(llg_tokenizer, vocab_size: int) -> NumberBound:
    # Special tokens decode to a 0xFF marker then their name: no leading number bytes.
    n = min(vocab_size, llg_tokenizer.vocab_size)
    return NumberBound([llg_tokenizer.decode_bytes([t]) for t in range(n)])


def narrow(words: np.ndarray, banned: np.ndarray | None) -> None:
    """Clear ``banned`` in a packed mask row (int32 words, bit t of word t // 32), unless that
    would clear every bit."""
    if banned is None or banned.size == 0:
        return
    row = words.view(np.uint32)
    before = row.copy()
    np.bitwise_and.at(row, banned >> 5, ~(np.uint32(1) << (banned & 31).astype(np.uint32)))
    if not row.any():
        row[:] = before
