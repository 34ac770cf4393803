"""``POST /v1/responses``: OpenAI's Responses API, stateless, over the chat-completions machinery.

A request is translated into a chat-completions request (so every check, limit and 400 is the
one chat has), run as one, and its answer translated back:

    input (a string, or message / function_call / function_call_output items)   -> messages
    instructions                      -> a system message before them
    max_output_tokens, temperature, top_p, stream, tool_choice, parallel_tool_calls  -> as named in chat
    tools [{"type": "function", "name", "parameters", ...}]               -> chat's nested function tools
    text.format (text, json_object, json_schema)                          -> response_format

The answer's ``output`` holds a ``reasoning`` item (thinking templates, runtime/reasoning.py), a
``message`` with one ``output_text`` part, and one ``function_call`` item per tool call; a reply
cut by ``max_output_tokens`` has status ``incomplete``. Streams carry the Responses event types
(``response.created`` ... ``response.completed``), each with its ``sequence_number``.

Nothing is stored: ``store`` is accepted and answered false, and ``previous_response_id`` is a
400 (send the conversation as ``input``). One reply per request (no ``n``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from llmx.serve.errors import ApiError, bad_request
from llmx.serve.protocol import parse_body

# Fields taken, and what each becomes (None: answered, but nothing for chat to do).
FIELDS = {"model": "model", "input": None, "instructions": None, "max_output_tokens": "max_completion_tokens",
          "temperature": "temperature", "top_p": "top_p", "stream": "stream", "tools": None, "tool_choice": None,
          "parallel_tool_calls": "parallel_tool_calls", "text": None, "store": None, "metadata": None, "user": None,
          "previous_response_id": None, "truncation": None, "include": None, "seed": "seed"}
# A chat field named in an error, as the Responses request names it.
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_request(raw: bytes) -> tuple[bytes, dict]:
    """The chat-completions body for a Responses request, and the request fields a response echoes."""
    body = parse_body(raw)
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                          code="unrecognized_argument")
    if body.get("previous_response_id") is not None:
        raise bad_request("this server stores no responses: send the whole conversation as 'input'",
                          param="previous_response_id", code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("only truncation 'disabled' is supported: a prompt too long is a 400",
                          param="truncation", code="unsupported_parameter")
    for name, kind in (("store", bool), ("metadata", dict), ("user", str), ("include", list), ("text", dict)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise bad_request(f"'{name}' must be {'an object' if kind is dict else 'a ' + kind.__name__}", param=name)
    chat = {FIELDS[k]: v for k, v in body.items() if FIELDS.get(k) and v is not None}
    messages = [{"role": "system", "content": _string(body["instructions"], "instructions")}] \
        if body.get("instructions") is not None else []
    if body.get("input") is None:
        raise bad_request("'input' is required", param="input")
    chat["messages"] = messages + _messages(body["input"])
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": {"format": fmt or {"type": "text"}}, "user": body.get("user")}
    return json.dumps(chat).encode(), echo


def renamed(exc: ApiError) -> ApiError:
    """A chat error, in the Responses request's field names."""
    head = (exc.param or "").split(".")[0].split("[")[0]
    if head in PARAMS:
        exc.param = PARAMS[head] + (exc.param or "")[len(head):]
    return exc


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", param=name)
    return value


def _text(content: Any, name: str) -> str:
    """A message's content: a string, or input_text/output_text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"'{name}' must be a string or a list of input_text parts (this model reads text only)",
                      param=name)


def _messages(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or a list of items", param="input")
    out: list[dict] = []
    for i, item in enumerate(value):
        name = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{name}' must be an object", param=name)
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), f"{name}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)  # calls made together are one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _text(item.get("output"), f"{name}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not sent back to the model (as chat templates drop it)
        else:
            raise bad_request(f"'{name}.type' {kind!r} is not supported: message, function_call, "
                              "function_call_output or reasoning", param=f"{name}.type")
    return out


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"'tools[{i}]' must be a function tool (this server runs no built-in tools)",
                              param=f"tools[{i}]")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                                      if tool.get(k) is not None}})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value  # "auto", "none", "required"; chat's check refuses anything else


def _format(fmt: Any) -> dict:
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt  # {"type": "text"} or {"type": "json_object"}; chat's check refuses the rest


# -- the answer ------------------------------------------------------------------------------------


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _skeleton(rid: str, created: int, model: str, echo: dict, status: str) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model, "output": [],
            "error": None, "incomplete_details": None, "previous_response_id": None, "store": False,
            "truncation": "disabled", "reasoning": None, "usage": None, **echo}


def _finished(response: dict, finish_reason: str | None) -> dict:
    if finish_reason == "length":
        response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    else:
        response["status"] = "completed"
    return response


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_object(chat: dict, echo: dict) -> dict:
    """The Responses answer for a whole chat completion."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content") or not message.get("tool_calls"):
        output.append(message_item(message.get("content") or ""))
    output += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    response = _skeleton(_new_id("resp"), chat["created"], chat["model"], echo, "completed")
    response.update(output=output, usage=_usage(chat["usage"]))
    return _finished(response, choice["finish_reason"])


class ResponseEvents:
    """Turns a chat stream's chunks (serve/responses.py Responder) into Responses events: called
    with each chunk dict, the closing "[DONE]", or an error dict; returns SSE text."""

    def __init__(self, model: str, echo: dict):
        self.response = _skeleton(_new_id("resp"), int(time.time()), model, echo, "in_progress")
        self.seq = 0
        self.open: dict | None = None  # the output item being written
        self.finish_reason: str | None = None

    def __call__(self, chunk: dict | str) -> list[str]:
        if chunk == "[DONE]":
            if self.response["status"] == "failed":
                return []  # response.failed was the last event
            # response.completed even when max_output_tokens cut the reply (its status says
            # incomplete): the official client's stream helper finishes only on this event
            return self._events(self._close() + [("response.completed", {"response": _finished(self.response, self.finish_reason)})])
        if "error" in chunk:
            self.response["status"] = "failed"
            self.response["error"] = {"code": chunk["error"].get("code") or "server_error",
                                      "message": chunk["error"]["message"]}
            return self._events([("error", {"code": chunk["error"].get("code"), "message": chunk["error"]["message"],
                                            "param": None}), ("response.failed", {"response": self.response})])
        if chunk.get("usage"):
            self.response["usage"] = _usage(chunk["usage"])
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("role") is not None and self.seq == 0:
                events += [("response.created", {"response": dict(self.response)}),
                           ("response.in_progress", {"response": dict(self.response)})]
            if delta.get("reasoning_content"):
                events += self._write("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._write("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    events += self._close()
                    events += self._add(call_item(call["id"], call["function"]["name"], "", "in_progress"))
                if call["function"].get("arguments"):
                    self.open["arguments"] += call["function"]["arguments"]
                    events.append(("response.function_call_arguments.delta", {**self._where(), "delta": call["function"]["arguments"]}))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                if not any(item["type"] != "reasoning" for item in self.response["output"]):
                    events += self._close() + self._add(message_item("", "in_progress"))  # as a whole answer has
                events += self._close()
        return self._events(events)

    def _events(self, events: list[tuple[str, dict]]) -> list[str]:
        out = []
        for kind, data in events:
            data = {"type": kind, "sequence_number": self.seq, **data}
            self.seq += 1
            out.append(f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n")
        return out

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.response["output"]) - 1}

    def _add(self, item: dict) -> list[tuple[str, dict]]:
        self.response["output"].append(item)
        self.open = item
        events = [("response.output_item.added", {"output_index": len(self.response["output"]) - 1,
                                                  "item": json.loads(json.dumps(item))})]
        if item["type"] == "message":
            events.append(("response.content_part.added", {**self._where(), "content_index": 0,
                                                           "part": dict(item["content"][0])}))
        return events

    def _write(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._add(reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress"))
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [(name, {**self._where(), "content_index": 0, "delta": text, **extra})]

    def _close(self) -> list[tuple[str, dict]]:
        item, events = self.open, []
        if item is None:
            return events
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            events += [("response.output_text.done", {**where, "content_index": 0, "text": part["text"], "logprobs": []}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": dict(part)})]
        elif item["type"] == "reasoning":
            events.append(("response.reasoning_text.done", {**where, "content_index": 0, "text": item["content"][0]["text"]}))
        else:
            events.append(("response.function_call_arguments.done", {**where, "arguments": item["arguments"]}))
        item["status"] = "completed"
        events.append(("response.output_item.done", {"output_index": where["output_index"], "item": json.loads(json.dumps(item))}))
        self.open = None
        return events
