"""Reasoning ("thinking") text in model output, returned apart from the answer.

Models trained to think write their reasoning between two markers before the answer; clients of
vLLM, SGLang, llama.cpp's server and TensorRT-LLM read it from ``message.reasoning_content``
(vLLM also ``reasoning``), streamed as ``delta.reasoning_content``. The markers, as a table:

    think     <think> ... </think>                              Qwen3, SmolLM3, DeepSeek-R1 and its distills, QwQ
    brackets  [THINK] ... [/THINK]                             Mistral Magistral
    command   <|START_THINKING|> ... <|END_THINKING|>          Cohere Command A Reasoning
    seed      <seed:think> ... </seed:think>                   ByteDance Seed-OSS

A format is recognised by its closing marker in the chat template. Where the rendered prompt
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
    open: str
    close: str


FORMATS = {f.name: f for f in (
    ReasoningFormat("think", "<think>", "</think>"),
    ReasoningFormat("brackets", "[THINK]", "[/THINK]"),
    ReasoningFormat("command", "<|START_THINKING|>", "<|END_THINKING|>"),
    ReasoningFormat("seed", "<seed:think>", "</seed:think>"),
)}
CHOICES = ("auto", "none")  # --reasoning-format: auto reads the template; none leaves the text whole


def detect_format(chat_template: str | None) -> ReasoningFormat | None:
    """The format whose closing marker the chat template writes, if any."""
    if not chat_template:
        return None
    return next((f for f in FORMATS.values() if f.close in chat_template), None)


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


def _held(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that could begin ``marker``."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)


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

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            body = self.buffer.lstrip()
            if body.startswith(self.fmt.open):
                self.buffer, self.state = body[len(self.fmt.open):], "reasoning"
            elif self.fmt.open.startswith(body) and not final:
                return "", ""  # may still become the opening marker
            else:
                self.state = "content"
        if self.state == "reasoning":
            reasoning = self._reasoning(final)
        if self.state == "content":
            if self.trim:
                self.buffer = self.buffer.lstrip()
                self.trim = not self.buffer and not final
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def _reasoning(self, final: bool) -> str:
        end = self.buffer.find(self.fmt.close)
        if end >= 0:
            piece, self.buffer = self.buffer[:end].rstrip("\n"), self.buffer[end + len(self.fmt.close):]
            self.state, self.trim = "content", True
        else:
            keep = 0 if final else _held(self.buffer, self.fmt.close)
            piece, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            if not final:
                sent = piece.rstrip("\n")
                piece, self.buffer = sent, piece[len(sent):] + self.buffer
        if self.lead:
            piece = piece.lstrip("\n")
            self.lead = not piece
        return piece

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split_reasoning(reasoning: Reasoning, text: str) -> tuple[str, str]:
    """A whole reply's (reasoning, content)."""
    parser = ReasoningParser(reasoning)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
