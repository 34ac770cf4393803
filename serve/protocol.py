"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked and turned into work.

Every field has a checker (type and range, with OpenAI's names and limits) and a default;
``null`` means the default, as in OpenAI's API. Unknown fields are refused, as OpenAI does
("Unrecognized request argument"), so a typo never silently changes nothing. The result is a
``Job``: tokenized prompts and one ``SamplingParams`` per choice, ready for the scheduler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from llmx.errors import InputError, LlmxError
from llmx.runtime.beam import BeamParams
from llmx.runtime.chat import render_chat
from llmx.runtime.constraints import ConstraintSpec
from llmx.runtime.decoding_request import BEAM_OPTIONS, DecodingRequest, for_model
from llmx.runtime.params import (MAX_CHOICES, MAX_LOGPROBS, BEAM, SAMPLING, Checker, ParamError, check_beam_compatible,
                                 integer, invalid, prompt_room, text)
from llmx.runtime.sampling import SamplingParams
from llmx.serve.errors import ApiError, bad_request
from llmx.runtime.reasoning import Reasoning
from llmx.runtime.reasoning import detect_format as detect_reasoning
from llmx.serve.tool_calls import GENERIC, ToolFormat, detect_format
from llmx.serve.tool_request import ToolRequest, assistant_calls, generic_messages, tool_request, tool_result, with_tools

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def invalid_field(name: str, rule: str, value: Any) -> ApiError:
    return from_param(invalid(name, rule, value))


def from_param(exc: ParamError) -> ApiError:
    return bad_request(str(exc), param=exc.param)


def boolean(value, name):
    if not isinstance(value, bool):
        raise invalid_field(name, "a boolean", value)
    return value


def string(value, name):
    if not isinstance(value, str):
        raise invalid_field(name, "a string", value)
    return value


def stream_options(value, name):
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise invalid_field(name, 'an object {"include_usage": bool}', value)
    return {"include_usage": boolean(value.get("include_usage", False), f"{name}.include_usage")}


def spec_checker(check: Callable[[Any, str], ConstraintSpec | None]) -> Checker:
    """A checker that builds a ConstraintSpec: its ConstraintError (a schema that is not JSON,
    one too long) is a 400 naming the field."""

    def wrapped(value, name):
        try:
            return check(value, name)
        except ParamError:
            raise
        except InputError as exc:
            raise bad_request(str(exc), param=name, code="invalid_schema") from None

    return wrapped


@spec_checker
def response_format(value, name) -> ConstraintSpec | None:
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return ConstraintSpec.json_object()
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
            raise invalid_field(f"{name}.json_schema", 'an object {"name", "schema", "strict", "description"}', spec)
        string(spec.get("name", ""), f"{name}.json_schema.name")
        if spec.get("strict") is not None:
            boolean(spec["strict"], f"{name}.json_schema.strict")
        schema = spec.get("schema", {})  # OpenAI: no schema means any JSON value
        if not isinstance(schema, dict):
            raise invalid_field(f"{name}.json_schema.schema", "a JSON schema object", schema)
        return ConstraintSpec.json_schema(schema)
    raise invalid_field(name, 'one of {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", '
                              '"json_schema": {"name": ..., "schema": {...}}}', value)


# vLLM's extension field (extra_body={"structured_outputs": {...}}): exactly one of these keys.
STRUCTURED = {"json": "a JSON schema object", "regex": "a regular expression (Rust regex syntax)",
              "grammar": "a Lark grammar (llguidance's dialect)", "choice": "a non-empty list of strings"}


@spec_checker
def structured_outputs(value, name) -> ConstraintSpec:
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURED:
        raise invalid_field(name, f"an object with exactly one of {', '.join(STRUCTURED)}", value)
    (key, arg), = value.items()
    field = f"{name}.{key}"
    if key == "json":
        if not isinstance(arg, (str, dict)):  # a schema object, or its JSON text
            raise invalid_field(field, STRUCTURED[key], arg)
        return ConstraintSpec.json_schema(arg)
    if key == "choice":
        if not isinstance(arg, list) or not arg or not all(isinstance(c, str) and c for c in arg):
            raise invalid_field(field, "a non-empty list of non-empty strings", arg)
        return ConstraintSpec.lark("start: " + " | ".join(json.dumps(text(c, field)) for c in arg))
    if not isinstance(arg, str) or not arg:
        raise invalid_field(field, STRUCTURED[key], arg)
    return ConstraintSpec.regex(text(arg, field)) if key == "regex" else ConstraintSpec.lark(text(arg, field))


def early_stopping(value, name):
    if value not in (True, False, "never"):
        raise invalid_field(name, 'true, false or "never"', value)
    return value


def unsupported(allowed: Callable[[Any], bool], why: str) -> Checker:
    """A field OpenAI has but llmx does not implement: accepted only at its no-op value."""

    def check(value, name):
        if not allowed(value):
            raise bad_request(f"'{name}' {why}", param=name, code="unsupported_parameter")
        return value

    return check


# name -> (checker, default). Sampling fields keep OpenAI's ranges; top_k/min_p/typical_p/
# repetition_penalty/ignore_eos are the extensions vLLM and llama.cpp's server also accept, and
# use_beam_search/length_penalty/early_stopping are vLLM's beam-search fields.
COMMON: dict[str, tuple[Checker, Any]] = {
    "model": (string, None),
    "max_tokens": (SAMPLING["max_new_tokens"], None),
    "temperature": (SAMPLING["temperature"], 1.0),
    "top_p": (SAMPLING["top_p"], 1.0),
    "top_k": (SAMPLING["top_k"], 0),
    "min_p": (SAMPLING["min_p"], 0.0),
    "typical_p": (SAMPLING["typical_p"], 1.0),
    "presence_penalty": (SAMPLING["presence_penalty"], 0.0),
    "frequency_penalty": (SAMPLING["frequency_penalty"], 0.0),
    "repetition_penalty": (SAMPLING["repetition_penalty"], 1.0),
    "stop": (SAMPLING["stop"], []),
    "seed": (SAMPLING["seed"], None),
    "n": (integer(1, MAX_CHOICES), 1),
    "stream": (boolean, False),
    "stream_options": (stream_options, None),
    "ignore_eos": (boolean, False),
    "use_beam_search": (boolean, False),
    "length_penalty": (BEAM["length_penalty"], None),
    "early_stopping": (early_stopping, None),
    "user": (string, None),
    "logit_bias": (lambda v, n: v, None),  # checked by _parse_job against the model's vocabulary
    "response_format": (response_format, None),
    "structured_outputs": (structured_outputs, None),
}
COMPLETION = {
    **COMMON,
    "prompt": (lambda v, n: v, None),  # checked by prompt_ids: it needs the tokenizer
    "logprobs": (integer(0, MAX_LOGPROBS), None),
    "echo": (unsupported(lambda v: v is False, "is not supported (only false)"), False),
    "best_of": (integer(1, MAX_CHOICES), None),
    "suffix": (unsupported(lambda v: v == "", "is not supported"), None),
}
CHAT = {
    **COMMON,
    "messages": (lambda v, n: v, None),  # checked by chat_prompt
    "logprobs": (boolean, False),
    "top_logprobs": (integer(0, MAX_LOGPROBS), None),
    "max_completion_tokens": (SAMPLING["max_new_tokens"], None),
    "tools": (lambda v, n: v, None),  # checked by tool_request
    "tool_choice": (lambda v, n: v, None),
    "parallel_tool_calls": (boolean, None),
    "chat_template_kwargs": (lambda v, n: v, None),  # checked by template_kwargs
}

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Job:
    """A checked request: what to generate and how to answer."""

    chat: bool
    prompts: list[list[int]]  # token ids; choice i continues prompts[i // n]
    params: list[SamplingParams]  # one per choice
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token, when logprobs were asked for
    beam: list[BeamParams] | None = None  # use_beam_search: one per prompt (its n choices are the best n beams)
    tools: ToolRequest | None = None  # chat with tools: replies are parsed for calls
    reasoning: Reasoning | None = None  # chat with a thinking template: replies are split (runtime/reasoning.py)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


def check_fields(body: dict, table: dict[str, tuple[Checker, Any]]) -> dict[str, Any]:
    unknown = sorted(set(body) - set(table))
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0], code="unrecognized_argument")
    try:
        return {name: default if body.get(name) is None else check(body[name], name) for name, (check, default) in table.items()}
    except ParamError as exc:
        raise from_param(exc) from None


# Normalizers may fold several characters into one (NFKC, combining marks): a generous margin.
CHARS_PER_TOKEN_MARGIN = 4


def check_chars(text_: str, tokenizer, limit: int, param: str) -> str:
    """Refuse text that cannot fit the context before tokenizing it: a 1 MiB prompt costs the
    tokenizer seconds of CPU for an answer known from its length alone."""
    most = limit * tokenizer.max_token_chars * CHARS_PER_TOKEN_MARGIN
    if len(text_) > most:
        raise bad_request(f"'{param}' has {len(text_)} characters: more than this model's maximum context length of "
                          f"{limit} tokens can hold", param=param, code="context_length_exceeded")
    return text_


def prompt_ids(value: Any, tokenizer, vocab_size: int, limit: int) -> list[list[int]]:
    """OpenAI's four prompt forms: a string, strings, token ids, lists of token ids."""
    def is_token(t):
        return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size

    if isinstance(value, str):
        return [tokenizer.encode(check_chars(text(value, "prompt"), tokenizer, limit, "prompt"))]
    if isinstance(value, list) and value and all(is_token(t) for t in value):
        return [list(value)]  # one prompt of token ids: as long as the context allows
    if isinstance(value, list) and 0 < len(value) <= MAX_CHOICES:
        if all(isinstance(p, str) for p in value):
            return [tokenizer.encode(check_chars(text(p, "prompt"), tokenizer, limit, "prompt")) for p in value]
        if all(isinstance(p, list) and p and all(is_token(t) for t in p) for p in value):
            return [list(p) for p in value]
    rule = f"a string, a list of strings, or token ids in [0, {vocab_size}) (a list, or a list of lists), at most {MAX_CHOICES} prompts"
    raise invalid_field("prompt", rule, value)


def chat_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise invalid_field("messages", "a non-empty list of messages", value)
    messages, call_names = [], {}
    for i, m in enumerate(value):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid_field(name, "an object with 'role' and 'content'", m)
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise invalid_field(f"{name}.role", f"one of {', '.join(ROLES)}", m.get("role"))
        calls = assistant_calls(m["tool_calls"], f"{name}.tool_calls") if m["role"] == "assistant" and m.get("tool_calls") else None
        content = "" if calls and m.get("content") is None else message_text(m.get("content"), f"{name}.content")
        message = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = calls  # only when present: templates test `'tool_calls' in message`
            call_names.update((c["id"], c["function"]["name"]) for c in calls)
        if m["role"] == "tool":
            message.update(tool_result(m, name, call_names))
        messages.append(message)
    return messages


def rendered_chat(tokenizer, messages: list[dict], limit: int, **template_vars) -> str:
    """Checked ``messages`` through the model's chat template: a 400 when the template refuses
    them or the text cannot fit ``limit`` tokens."""
    try:
        rendered = render_chat(tokenizer, messages, **template_vars)
    except InputError as exc:
        raise bad_request(str(exc), param="messages", code="chat_template_error") from None
    return check_chars(rendered, tokenizer, limit, "messages")


def message_text(content: Any, name: str) -> str:
    parts = content if isinstance(content, list) else None
    if parts is not None and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        content = "".join(p["text"] for p in parts)
    if not isinstance(content, str):
        raise invalid_field(name, "a string or a list of text parts", content)
    return text(content, name)


# What the template is called with by llmx itself: a request's chat_template_kwargs may not replace it.
TEMPLATE_OWN = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


def template_kwargs(value: Any) -> dict:
    """A request's extra chat-template variables (e.g. Qwen3's enable_thinking), as vLLM takes them."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_field("chat_template_kwargs", "an object", value)
    taken = sorted(set(value) & set(TEMPLATE_OWN))
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {taken[0]!r}: the server sets it",
                          param="chat_template_kwargs")
    return value


def parse_job(raw: bytes, chat: bool, engine, served_model: str, tool_format: ToolFormat | None = None,
              reasoning_format: str = "auto") -> Job:
    """Check a request body against the engine it will run on; raise ApiError on anything wrong.
    ``tool_format``: how this model writes tool calls (default: read from its chat template);
    ``reasoning_format``: "auto" splits reasoning from answers where the template thinks, "none" never."""
    try:
        return _parse_job(raw, chat, engine, served_model, tool_format, reasoning_format)
    except ParamError as exc:
        raise from_param(exc) from None


def _parse_job(raw: bytes, chat: bool, engine, served_model: str, tool_format: ToolFormat | None,
               reasoning_format: str = "auto") -> Job:
    f = check_fields(parse_body(raw), CHAT if chat else COMPLETION)
    if f["model"] is not None and f["model"] != served_model:
        raise ApiError(404, f"The model '{f['model']}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    if f["stream_options"] is not None and not f["stream"]:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not chat and f["best_of"] not in (None, f["n"]) and not f["use_beam_search"]:
        raise bad_request("'best_of' is supported with use_beam_search (the beam width) or equal to n",
                          param="best_of", code="unsupported_parameter")
    if chat and f["top_logprobs"] is not None and not f["logprobs"]:
        raise bad_request("'logprobs' must be true when 'top_logprobs' is used", param="top_logprobs")
    if chat:
        if f["messages"] is None:
            raise bad_request("'messages' is required", param="messages")
        messages = chat_messages(f["messages"])
        tools = tool_request(f, tool_format or detect_format(engine.tokenizer.chat_template))
        extra = {**template_kwargs(f["chat_template_kwargs"]), **(tools.template_vars() if tools else {})}
        if tools and tools.fmt is GENERIC:
            try:
                rendered = rendered_chat(engine.tokenizer, generic_messages(messages, tools), engine.max_seq_len, **extra)
            except ApiError as exc:  # a template that refuses a system turn (Gemma's): the tools go in the first user turn
                if exc.code != "chat_template_error":
                    raise
                rendered = rendered_chat(engine.tokenizer, generic_messages(messages, tools, system=False),
                                         engine.max_seq_len, **extra)
        else:
            rendered = rendered_chat(engine.tokenizer, messages, engine.max_seq_len, **extra)
        prompts = [engine.tokenizer.encode(rendered, add_special_tokens=False)]
        thinks = detect_reasoning(engine.tokenizer.chat_template) if reasoning_format == "auto" else None
        reasoning = Reasoning.for_prompt(thinks, rendered)
        logprobs = (f["top_logprobs"] or 0) if f["logprobs"] else None
        max_tokens = f["max_completion_tokens"] or f["max_tokens"]
    else:
        tools = reasoning = None
        if f["prompt"] is None:
            raise bad_request("'prompt' is required", param="prompt")
        prompts = prompt_ids(f["prompt"], engine.tokenizer, engine.manifest.model.vocab_size, engine.max_seq_len)
        logprobs, max_tokens = f["logprobs"], f["max_tokens"] or COMPLETION_DEFAULT_MAX_TOKENS
    if len(prompts) * f["n"] > MAX_CHOICES:
        raise bad_request(f"prompts x n may be at most {MAX_CHOICES}", param="n")
    budgets = [fit_context(p, max_tokens, engine.max_seq_len, "messages" if chat else "prompt") for p in prompts]
    given = decoding_rules(f, logprobs)
    f["logit_bias"], f["constraint"] = for_engine(f, given, engine)
    params = [sampling_params(f, budget, logprobs, j) for budget in budgets for j in range(f["n"])]
    include_usage = bool(f["stream_options"] and f["stream_options"]["include_usage"])
    beam = beam_params(f, budgets, chat)
    if tools:
        if beam:
            raise bad_request("tools cannot be combined with use_beam_search", param="tools", code="unsupported_parameter")
        if f["constraint"] is not None:
            raise bad_request("'tools' and a response format do not combine: tool calls have their own grammar",
                              param="tools", code="unsupported_parameter")
        params = with_tools(params, tools, engine)
    return Job(chat, prompts, params, f["n"], f["stream"], include_usage, logprobs, beam, tools, reasoning)


class Fields:
    """The shared decoding rules' refusals (runtime/decoding_request.py), in the request's field names.
    A request cannot ask for speculative decoding (the server's own is checked by the service),
    so the mode refused here is always beam search."""

    def __init__(self, bias):
        self.bias = bias

    def several_constraints(self, names: list[str]):
        raise bad_request(f"{' and '.join(repr(n) for n in names)} do not combine: send one", param=names[1])

    def not_combined(self, feature: str, mode: str):
        if feature == "logit_bias":
            check_beam_compatible({"logit_bias": self.bias})  # in beam search's words for every sampling field
        raise bad_request(f"'{feature}' is not supported with beam search", param=feature, code="unsupported_parameter")

    def beam_option_alone(self, name: str):
        raise bad_request(f"'{name}' applies to beam search: set use_beam_search", param=name)


def decoding_rules(f: dict, logprobs: int | None) -> str | None:
    """Refuse what this request's constraint, logit_bias and beam search cannot combine; the
    constraint's field, if one was given."""
    given = [name for name in ("response_format", "structured_outputs") if f[name] is not None]
    request = DecodingRequest(given, bool(f["logit_bias"]), f["use_beam_search"],
                              beam_options=[name for name in BEAM_OPTIONS if f[name] is not None],
                              sampling={**f, "logprobs": logprobs})
    try:
        request.check(Fields(f["logit_bias"]))
    except ParamError as exc:
        raise bad_request(str(exc), param=exc.param, code="unsupported_parameter") from None
    return given[0] if given else None


def for_engine(f: dict, given: str | None, engine):
    """logit_bias checked against the vocabulary ("", 0 and [] are wrong types, not "none"), and the
    grammar compiled and tried now: a 400 before any work is queued."""
    try:
        return for_model(f[given] if given else None, f["logit_bias"], engine.tokenizer, engine.manifest.model.vocab_size)
    except ParamError:
        raise  # a bad logit_bias entry: parse_job names it
    except InputError as exc:
        raise bad_request(str(exc), param=given, code="invalid_schema") from None
    except LlmxError as exc:  # llguidance not installed on this server
        raise bad_request(str(exc), param=given, code="unsupported_parameter") from None


def beam_params(f: dict, budgets: list[int], chat: bool) -> list[BeamParams] | None:
    """BeamParams per prompt for use_beam_search (width best_of, else n; the n best are returned)."""
    if not f["use_beam_search"]:
        return None
    width = f["n"] if chat or f["best_of"] is None else f["best_of"]
    if width < f["n"]:
        raise bad_request(f"'best_of' ({width}) must be at least n ({f['n']})", param="best_of")
    try:
        return [BeamParams(num_beams=width, max_new_tokens=budget, num_return_sequences=f["n"],
                           length_penalty=1.0 if f["length_penalty"] is None else f["length_penalty"],
                           early_stopping=bool(f["early_stopping"]) if f["early_stopping"] != "never" else "never",
                           ignore_eos=f["ignore_eos"]).validate() for budget in budgets]
    except InputError as exc:
        raise bad_request(str(exc), param="best_of" if not chat else "n") from None


def fit_context(prompt: list[int], max_tokens: int | None, limit: int, param: str) -> int:
    """The completion budget of one prompt; 400 when prompt + max_tokens exceed the context."""
    try:
        room = prompt_room(len(prompt), limit, param)  # the prompt must leave room for one token
    except ParamError as exc:
        raise bad_request(str(exc), param=param, code="context_length_exceeded" if prompt else None) from None
    budget = room if max_tokens is None else max_tokens
    if len(prompt) + budget > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, however you requested {len(prompt) + max(budget, 0)} "
            f"tokens ({len(prompt)} in the prompt, {max(budget, 0)} for the completion). Shorten the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
    return budget


def sampling_params(f: dict, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
    """Choice j of n samples with seed + j: choice 0 equals ``llmx generate --seed`` exactly."""
    params = SamplingParams(
        max_new_tokens=max_tokens, temperature=f["temperature"], top_k=max(f["top_k"], 0), top_p=f["top_p"],
        min_p=f["min_p"], typical_p=f["typical_p"], repetition_penalty=f["repetition_penalty"],
        presence_penalty=f["presence_penalty"], frequency_penalty=f["frequency_penalty"],
        seed=None if f["seed"] is None else f["seed"] + choice, stop=list(f["stop"]), ignore_eos=f["ignore_eos"],
        logprobs=logprobs, logit_bias=f["logit_bias"] or None, constraint=f["constraint"])
    try:
        return params.validate()
    except InputError as exc:
        raise bad_request(str(exc)) from None
