"""OpenAI response objects: completions and chat completions, whole or as streamed chunks.

One ``Responder`` per request keeps ``id`` and ``created`` the same in every chunk. Logprobs
take each endpoint's own shape: completions' parallel lists (tokens, token_logprobs,
top_logprobs, text_offset), chat's ``content`` list of {token, logprob, bytes, top_logprobs}.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from llmx.runtime.sequence import TokenLogprob
from llmx.serve.protocol import Job
from llmx.serve.scheduler import Update
from llmx.runtime.reasoning import ReasoningParser, split_reasoning
from llmx.serve.tool_calls import Call, Event, ToolCallParser, parse_tool_calls


@dataclass
class ChoiceResult:
    """One choice accumulated from its updates (non-streaming answers)."""

    text: str = ""
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0

    def add(self, u: Update) -> None:
        self.text += u.text
        self.tokens, self.cached_tokens = u.tokens, u.cached_tokens
        self.logprobs += u.logprobs
        self.finish_reason = u.finish_reason or self.finish_reason


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def chat_logprobs(lps: list[TokenLogprob]) -> dict:
    def entry(text, logprob):
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [{**entry(lp.text, lp.logprob), "top_logprobs": [entry(t, v) for _, t, v in lp.top]} for lp in lps]
    return {"content": content, "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict:
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.text)
    return {
        "tokens": [lp.text for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t: v for _, t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


class Responder:
    def __init__(self, job: Job, model: str):
        self.job, self.model = job, model
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p) for p in job.prompts)
        self.offsets = [0] * len(job.params)  # text offsets for streamed completion logprobs
        # Streams with tools: one parser per choice, and how many calls each has sent.
        self.parsers = [ToolCallParser(job.tools.fmt, job.tools.calls_only) for _ in job.params] if job.tools else []
        self.sent = [0] * len(job.params)
        # Thinking templates: reasoning is split off first; the rest is content (or tool calls).
        self.thinkers = [ReasoningParser(job.reasoning) for _ in job.params] if job.reasoning else []

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def prompt_cached(self, per_choice: list[int]) -> int:
        """Cached prompt tokens, counted once per prompt (as prompt_tokens is): its first choice's."""
        return sum(per_choice[:: self.job.n])

    def _logprobs(self, index: int, lps: list[TokenLogprob]) -> dict | None:
        if self.job.logprobs is None:
            return None
        if self.job.chat:
            return chat_logprobs(lps)
        shaped = completion_logprobs(lps, self.offsets[index])
        self.offsets[index] += sum(len(lp.text) for lp in lps)
        return shaped

    # -- whole answers -----------------------------------------------------------------------

    def response(self, results: list[ChoiceResult]) -> dict:
        choices = []
        for i, r in enumerate(results):
            choice = {"index": i, "logprobs": self._logprobs(i, r.logprobs), "finish_reason": r.finish_reason}
            if self.job.chat:
                choice["message"] = self.message(r)
                if choice["message"].get("tool_calls") and r.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = r.text
            choices.append(choice)
        kind = "chat.completion" if self.job.chat else "text_completion"
        usage = self.usage(sum(r.tokens for r in results), self.prompt_cached([r.cached_tokens for r in results]))
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage}

    def message(self, r: ChoiceResult) -> dict:
        reasoning, text = split_reasoning(self.job.reasoning, r.text) if self.job.reasoning else ("", r.text)
        message = {"role": "assistant", "content": text}
        if reasoning:  # both names: vLLM's newer field and the one llama.cpp, SGLang and older vLLM use
            message.update(reasoning_content=reasoning, reasoning=reasoning)
        if self.job.tools:
            message["content"], calls = parse_tool_calls(self.job.tools.fmt, text, self.job.tools.calls_only)
            if calls:
                message["tool_calls"] = [self.tool_call(c) for c in calls]
        return message

    def tool_call(self, call: Call) -> dict:
        return {"id": self.job.tools.fmt.new_id(), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    # -- streamed chunks -----------------------------------------------------------------------

    def chunk(self, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if self.job.chat else "text_completion"
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if self.job.include_usage:
            out["usage"] = None
        return out

    def role_chunk(self) -> dict:
        """Chat streams open with every choice's role, as OpenAI's do."""
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(len(self.job.params))])

    def delta_chunk(self, u: Update) -> dict:
        choice = {"index": u.index, "logprobs": self._logprobs(u.index, u.logprobs), "finish_reason": None}
        choice.update({"delta": {"content": u.text}} if self.job.chat else {"text": u.text})
        return self.chunk([choice])

    def delta_chunks(self, u: Update) -> list[dict]:
        """The chunks one update makes: its text, or what the reasoning and tool parsers made of it."""
        if not self.parsers and not self.thinkers:
            return [self.delta_chunk(u)] if u.text or u.logprobs else []
        chunks = self.parsed_chunks(u.index, *self.thinkers[u.index].feed(u.text)) if self.thinkers else \
            self.parsed_chunks(u.index, "", u.text)
        lps = self._logprobs(u.index, u.logprobs) if u.logprobs else None
        if lps is not None:  # logprobs ride on the update's first chunk (or one of their own)
            chunks = chunks or [self.chunk([{"index": u.index, "delta": {}, "logprobs": None, "finish_reason": None}])]
            chunks[0]["choices"][0]["logprobs"] = lps
        return chunks

    def parsed_chunks(self, index: int, reasoning: str, content: str) -> list[dict]:
        deltas = [{"reasoning_content": reasoning, "reasoning": reasoning}] if reasoning else []
        chunks = [self.chunk([{"index": index, "delta": d, "logprobs": None, "finish_reason": None}]) for d in deltas]
        if self.parsers:
            return chunks + self.tool_chunks(index, self.parsers[index].feed(content))
        if content:
            chunks.append(self.chunk([{"index": index, "delta": {"content": content}, "logprobs": None, "finish_reason": None}]))
        return chunks

    def tool_chunks(self, index: int, events: list[Event]) -> list[dict]:
        """Content deltas, and per call two deltas: its id, type and name, then its arguments
        (the official client's stream helpers join them by ``index``)."""
        deltas = []
        for e in events:
            if e.call is None:
                deltas.append({"content": e.content})
                continue
            k, self.sent[index] = self.sent[index], self.sent[index] + 1
            head = {"index": k, "id": self.job.tools.fmt.new_id(), "type": "function",
                    "function": {"name": e.call.name, "arguments": ""}}
            deltas += [{"tool_calls": [head]}, {"tool_calls": [{"index": k, "function": {"arguments": e.call.arguments}}]}]
        return [self.chunk([{"index": index, "delta": d, "logprobs": None, "finish_reason": None}]) for d in deltas]

    def finish_chunks(self, index: int, reason: str) -> list[dict]:
        chunks = self.parsed_chunks(index, *self.thinkers[index].finish()) if self.thinkers else []
        if self.parsers:
            chunks += self.tool_chunks(index, self.parsers[index].finish())
            if self.parsers[index].calls and reason == "stop":
                reason = "tool_calls"
        return chunks + [self.finish_chunk(index, reason)]

    def finish_chunk(self, index: int, reason: str) -> dict:
        choice = {"index": index, "logprobs": None, "finish_reason": reason}
        choice.update({"delta": {}} if self.job.chat else {"text": ""})
        return self.chunk([choice])

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {**self.chunk([]), "usage": self.usage(completion_tokens, cached_tokens)}
