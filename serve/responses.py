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
                choice["message"] = {"role": "assistant", "content": r.text}
            else:
                choice["text"] = r.text
            choices.append(choice)
        kind = "chat.completion" if self.job.chat else "text_completion"
        usage = self.usage(sum(r.tokens for r in results), self.prompt_cached([r.cached_tokens for r in results]))
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage}

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

    def finish_chunk(self, index: int, reason: str) -> dict:
        choice = {"index": index, "logprobs": None, "finish_reason": reason}
        choice.update({"delta": {}} if self.job.chat else {"text": ""})
        return self.chunk([choice])

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {**self.chunk([]), "usage": self.usage(completion_tokens, cached_tokens)}
