"""Reasoning ("thinking") text in model output, returned apart from the answer.

Models trained to think write their reasoning between two markers before the answer; clients of
vLLM, SGLang, llama.cpp's server and TensorRT-LLM read it from ``message.reasoning_content``
(vLLM also ``reasoning``), streamed as ``delta.reasoning_content``. The markers, as a table:

    think          <think> ... </think>                      Qwen3, SmolLM3, DeepSeek-R1 and its distills, QwQ, Phi-4-reasoning
    granite        <think> ... </think> <response> ... </response>   IBM Granite 3.3 (template variable ``thinking``)
    granite_text   Here is my thought process: ... Here is my response: ...   IBM Granite 3.2 (vLLM's parser also takes "Here's")
    brackets       [THINK] ... [/THINK]                      Mistral Magistral
    command        <|START_THINKING|> ... <|END_THINKING|>   Cohere Command A Reasoning
    seed           <seed:think> ... </seed:think>            ByteDance Seed-OSS

gpt-oss's harmony channels are not here: no family llmx exports (or imports from GGUF) writes them.

A format is recognised by its closing marker in the chat template (and Granite 3.3's by its answer
wrapper too, which is dropped from the content). Where the rendered prompt
already ends with the opening marker (DeepSeek-R1's templates open the block themselves), the
reply starts inside the reasoning; where it ends with the closing marker (Qwen3's template with
``enable_thinking`` false writes an empty block), there is none to find. Otherwise a reply
reasons only if it opens with the marker. A block that never closes (``max_tokens`` cut it) is
all reasoning. One parser serves streams and whole answers, so the two always agree; it holds
back text that may still become a marker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    open: tuple[str, ...]  # the markers a reasoning block may open with (the first is the template's)
    close: tuple[str, ...]
    answer: tuple[str, str] | None = None  # markers the answer is wrapped in, dropped from the content
    layout: str = "\n"  # what around the reasoning is the template's layout, not reasoning

    def recognises(self, chat_template: str) -> bool:
        return self.close[0] in chat_template and (self.answer is None or self.answer[1] in chat_template)


FORMATS = {f.name: f for f in (
    ReasoningFormat("granite", ("<think>",), ("</think>",), ("<response>", "</response>")),  # before think: same markers
    ReasoningFormat("think", ("<think>",), ("</think>",)),
    ReasoningFormat("granite_text", ("Here is my thought process:", "Here's my thought process:"),
                    ("Here is my response:", "Here's my response:"), layout=" \n"),
    ReasoningFormat("brackets", ("[THINK]",), ("[/THINK]",)),
    ReasoningFormat("command", ("<|START_THINKING|>",), ("<|END_THINKING|>",)),
    ReasoningFormat("seed", ("<seed:think>",), ("</seed:think>",)),
)}
CHOICES = ("auto", "none")  # --reasoning-format: auto reads the template; none leaves the text whole


def detect_format(chat_template: str | None) -> ReasoningFormat | None:
    """The first format the chat template writes the markers of, if any."""
    if not chat_template:
        return None
    return next((f for f in FORMATS.values() if f.recognises(chat_template)), None)


@dataclass(frozen=True)
class Reasoning:
    """What a request's replies are parsed with: the format, and whether the prompt opened the block."""

    fmt: ReasoningFormat
    starts_inside: bool

    @classmethod
    def for_prompt(cls, fmt: ReasoningFormat | None, rendered: str) -> "Reasoning | None":
        tail = rendered.rstrip()
        if fmt is None or tail.endswith(fmt.close):
            return None
        return cls(fmt, tail.endswith(fmt.open))


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could begin one of ``markers``."""
    return max(next((k for k in range(min(len(text), len(m) - 1), 0, -1) if m.startswith(text[-k:])), 0) for m in markers)


def _find(text: str, markers: tuple[str, ...]) -> tuple[int, int]:
    """The first place one of ``markers`` occurs in ``text`` and its length; (-1, 0) if none does."""
    found = [(i, len(m)) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, 0)


def _opening(body: str, markers: tuple[str, ...], final: bool) -> str | None:
    """The marker ``body`` opens with; "" while it may still become one; None when it cannot."""
    for m in markers:
        if body.startswith(m):
            return m
    return "" if not final and any(m.startswith(body) for m in markers) else None


class ReasoningParser:
    """Feed reply text as it comes; each call returns the (reasoning, content) now certain.
    Newlines around the reasoning are the template's layout (``<think>\n...\n</think>\n\n``):
    leading ones are dropped, trailing ones held until it is known whether the block closes."""

    def __init__(self, reasoning: Reasoning):
        self.fmt = reasoning.fmt
        self.state = "reasoning" if reasoning.starts_inside else "start"
        self.buffer = ""
        self.lead = True  # no reasoning text sent yet
        self.trim = False  # just after the closing marker
        self.wrap = "start" if self.fmt.answer else "none"  # where the answer wrapper stands
        self.answer = ""  # content held while it may be part of the wrapper

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            body = self.buffer.lstrip()
            marker = _opening(body, self.fmt.open, final)
            if marker == "":
                return "", ""  # may still become the opening marker
            if marker:
                self.buffer, self.state = body[len(marker):], "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            reasoning = self._reasoning(final)
        if self.state == "content":
            if self.trim:
                self.buffer = self.buffer.lstrip()
                self.trim = not self.buffer and not final
            content, self.buffer = self.buffer, ""
            if self.wrap != "none":
                content = self._unwrap(content, final)
        return reasoning, content

    def _reasoning(self, final: bool) -> str:
        end, size = _find(self.buffer, self.fmt.close)
        if end >= 0:
            piece, self.buffer = self.buffer[:end].rstrip(self.fmt.layout), self.buffer[end + size:]
            self.state, self.trim = "content", True
        else:
            keep = 0 if final else _held(self.buffer, self.fmt.close)
            piece, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            if not final:
                sent = piece.rstrip(self.fmt.layout)
                piece, self.buffer = sent, piece[len(sent):] + self.buffer
        if self.lead:
            piece = piece.lstrip(self.fmt.layout)
            self.lead = not piece
        return piece

    def _unwrap(self, text: str, final: bool) -> str:
        """The content without the answer's wrapper markers (Granite 3.3's <response>...</response>);
        newlines just inside the wrapper, and whitespace after it, are layout."""
        opening, closing = self.fmt.answer
        self.answer += text
        if self.wrap == "start":
            marker = _opening(self.answer.lstrip(), (opening,), final)
            if marker == "":
                return ""
            self.wrap = "lead" if marker else "none"
            if marker:
                self.answer = self.answer.lstrip()[len(marker):]
        if self.wrap == "lead":
            self.answer = self.answer.lstrip("\n")
            self.wrap = "inside" if self.answer else "lead"
        if self.wrap == "inside":
            end, size = _find(self.answer, (closing,))
            if end >= 0:
                out, self.answer, self.wrap = self.answer[:end].rstrip("\n"), self.answer[end + size:], "after"
            else:
                keep = 0 if final else _held(self.answer, (closing,))
                out, self.answer = self.answer[: len(self.answer) - keep], self.answer[len(self.answer) - keep:]
                if not final:
                    sent = out.rstrip("\n")
                    out, self.answer = sent, out[len(sent):] + self.answer
                return out
        else:
            out = ""
        if self.wrap == "after":
            self.answer = self.answer.lstrip()
            self.wrap = "none" if self.answer else "after"
        if self.wrap == "none":
            out, self.answer = out + self.answer, ""
        return out

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split_reasoning(reasoning: Reasoning, text: str) -> tuple[str, str]:
    """A whole reply's (reasoning, content)."""
    parser = ReasoningParser(reasoning)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
