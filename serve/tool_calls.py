"""Tool calls in model output: the formats the supported families were trained on, as a table.

Each ``ToolFormat`` row names how its chat template is recognised, the marker that opens the
call region of a reply, how one call (or one batch of calls) is read from the front of that
region (``take``), and the literals calls are written with (``open``, ``before_call``,
``after_call``, ``separator``, ``close``: serve/tool_request.py builds the constraint from them):

    hermes       Hermes / Qwen 2.5+ / Qwen 3    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3_json  Llama 3.1 / 3.2 / 3.3         {"name": ..., "parameters": {...}}  (optionally after <|python_tag|>)
    mistral      Mistral v3 (7B v0.3, Nemo)   [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
    generic      any other chat template       {"name": ..., "arguments": {...}}  (tools described in the
                                               system message by llmx: serve/tool_request.py generic_messages)

One parser serves whole answers and streams (``ToolCallParser``): text before the marker is
content; from the marker on, calls are read in order; the first block that does not read as a
call, and everything after it, comes back as content (so a malformed call is never lost, and
never half-reported). A whole answer is the same parser fed once, so streamed and whole answers
always agree.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Callable

_DECODER = json.JSONDecoder()


class Incomplete(Exception):
    """The region's front may still become a call: wait for more text."""


class Malformed(Exception):
    """The region's front is not a call."""


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object, as OpenAI's function.arguments


def _call(obj, args_key: str) -> Call:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise Malformed
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some fine-tunes double-encode; accept it when it is an object
        try:
            args = json.loads(args)
        except ValueError:
            raise Malformed from None
    if not isinstance(args, dict):
        raise Malformed
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _decode_front(text: str, final: bool):
    """One JSON value at the front of ``text`` (after whitespace): (value, characters used)."""
    body = text.lstrip()
    if not body:
        raise Malformed if final else Incomplete
    try:
        value, end = _DECODER.raw_decode(body)
    except ValueError:
        raise Malformed if final else Incomplete from None
    return value, len(text) - len(body) + end


def _expect(text: str, literal: str, final: bool) -> int:
    """Length of ``text``'s leading whitespace + ``literal``; Incomplete while it may still come."""
    body = text.lstrip()
    if body.startswith(literal):
        return len(text) - len(body) + len(literal)
    if not final and literal.startswith(body):
        raise Incomplete
    raise Malformed


# -- the formats: how each reads its calls from the front of the call region ----------------

def _take_hermes(text: str, final: bool) -> tuple[list[Call], int]:
    start = _expect(text, "<tool_call>", final)
    close = text.find("</tool_call>", start)
    if close < 0:
        if not final:
            raise Incomplete
        obj, used = _decode_front(text[start:], final=True)  # a last call whose closing tag never came
        if text[start + used:].strip():
            raise Malformed
        return [_call(obj, "arguments")], len(text)
    try:
        obj = json.loads(text[start:close])
    except ValueError:
        raise Malformed from None
    return [_call(obj, "arguments")], close + len("</tool_call>")


def _take_llama3(text: str, final: bool) -> tuple[list[Call], int]:
    body = text.lstrip()
    skip = len(text) - len(body)
    if body.startswith(";"):  # Llama 3.2 separates several calls with ';'
        skip += 1
    if text[skip:].lstrip().startswith("<|python_tag|>"):
        skip += _expect(text[skip:], "<|python_tag|>", final)
    obj, used = _decode_front(text[skip:], final)
    return [_call(obj, "parameters")], skip + used


def _take_mistral(text: str, final: bool) -> tuple[list[Call], int]:
    start = _expect(text, "[TOOL_CALLS]", final)
    calls, used = _decode_front(text[start:], final)
    if not isinstance(calls, list) or not calls:
        raise Malformed
    return [_call(c, "arguments") for c in calls], start + used


def _take_json(text: str, final: bool) -> tuple[list[Call], int]:
    obj, used = _decode_front(text, final)
    return [_call(obj, "arguments")], used


def _hermes_ids() -> str:
    return "call_" + secrets.token_hex(12)


def _mistral_ids() -> str:
    """Mistral's template refuses tool_call ids other than 9 letters or digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ToolFormat:
    name: str
    signatures: tuple[str, ...]  # any of these in a chat template identifies the format
    markers: tuple[str, ...]  # text that opens the call region of a reply
    anywhere: bool  # the region may open after content (else only at the start of the reply)
    take: Callable[[str, bool], tuple[list[Call], int]]
    args_key: str  # "arguments" or "parameters", in the call's JSON
    open: str  # written before the first call (constrained generation)
    before_call: str  # written before each call
    after_call: str  # written after each call
    separator: str  # between two calls
    close: str  # after the last call
    max_calls: int | None  # None: as many as the request allows
    new_id: Callable[[], str] = _hermes_ids


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", ("<tool_call>",), ("<tool_call>",), True, _take_hermes, "arguments",
               open="", before_call="<tool_call>\n", after_call="\n</tool_call>", separator="\n", close="",
               max_calls=None),
    # Llama 3.1's template refuses more than one call per assistant message.
    ToolFormat("llama3_json", ("<|python_tag|>", '"parameters": dictionary of argument name'), ("<|python_tag|>", "{"),
               False, _take_llama3, "parameters", open="", before_call="", after_call="", separator="; ", close="",
               max_calls=1),
    ToolFormat("mistral", ("[TOOL_CALLS]",), ("[TOOL_CALLS]",), True, _take_mistral, "arguments",
               open="[TOOL_CALLS] [", before_call="", after_call="", separator=", ", close="]", max_calls=None,
               new_id=_mistral_ids),
    # No template writes it (no signatures): the fallback for templates with no tool format, one
    # call a reply, as llama.cpp's server's generic format.
    ToolFormat("generic", (), ("{",), False, _take_json, "arguments", open="", before_call="", after_call="",
               separator="", close="", max_calls=1),
)}
GENERIC = FORMATS["generic"]


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes its assistant tool calls in (None: none known)."""
    if not chat_template:
        return None
    return next((f for f in FORMATS.values() if any(s in chat_template for s in f.signatures)), None)


# -- the parser ------------------------------------------------------------------------------

@dataclass
class Event:
    """What a slice of output turned out to be: content text, or one complete call."""

    content: str = ""
    call: Call | None = None


class ToolCallParser:
    """Splits one choice's output, fed as it streams, into content and calls (see the module doc)."""

    def __init__(self, fmt: ToolFormat, calls_only: bool = False):
        self.fmt = fmt
        # A reply constrained to calls ("required", a named function): what does not read as a
        # call can only be one that max_tokens cut short, and is dropped, not returned as content.
        self.calls_only = calls_only
        self.pending = ""  # content held back while it could be the start of a marker
        self.region: str | None = None  # text from the marker on, once one was seen
        self.done = 0  # characters of the region already turned into calls
        self.calls: list[Call] = []
        self.plain = False  # the reply is content to the end (a failed call, or no call at its start)

    def feed(self, delta: str) -> list[Event]:
        if self.plain:
            return [Event(delta)] if delta else []
        if self.region is not None:
            self.region += delta
            return self._read(final=False)
        self.pending += delta
        return self._scan()

    def finish(self) -> list[Event]:
        if self.region is not None and not self.plain:
            return self._read(final=True)
        out, self.pending = self.pending, ""
        return [Event(out)] if out else []

    def _scan(self) -> list[Event]:
        text = self.pending
        if not self.fmt.anywhere:
            return self._scan_start(text)
        hits = [i for i in (text.find(m) for m in self.fmt.markers) if i >= 0]
        if hits:
            at = min(hits)
            self.pending, self.region = "", text[at:]
            return ([Event(text[:at])] if at else []) + self._read(final=False)
        keep = max((k for m in self.fmt.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        self.pending = text[len(text) - keep:]
        return [Event(text[: len(text) - keep])] if keep < len(text) else []

    def _scan_start(self, text: str) -> list[Event]:
        body = text.lstrip()
        if not body:
            return []
        if any(body.startswith(m) for m in self.fmt.markers):
            self.pending, self.region = "", text
            return self._read(final=False)
        if any(m.startswith(body) for m in self.fmt.markers):
            return []
        self.plain, self.pending = True, ""
        return [Event(text)]

    def _read(self, final: bool) -> list[Event]:
        events = []
        while True:
            rest = self.region[self.done:]
            if not rest.strip():
                return events
            try:
                calls, used = self.fmt.take(rest, final)
            except Incomplete:
                return events
            except Malformed:
                self.plain = True
                return events if self.calls_only else events + [Event(rest)]
            self.done += used
            self.calls += calls
            events += [Event(call=c) for c in calls]


def parse_tool_calls(fmt: ToolFormat, text: str, calls_only: bool = False) -> tuple[str | None, list[Call]]:
    """A whole reply: (content or None, calls)."""
    parser = ToolCallParser(fmt, calls_only)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.content for e in events)
    return (content or None) if parser.calls else content, parser.calls
