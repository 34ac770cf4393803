"""The request side of tool calling: ``tools``, ``tool_choice``, ``parallel_tool_calls``, the
messages that carry calls and results, and the grammar that holds generation to a valid call.

Tools reach the model through its own chat template (the Jinja ``tools`` variable, assistant
``tool_calls`` with ``function.arguments`` as a dict: transformers' convention). With
``tool_choice`` "required" or a named function the reply is constrained to calls in the
template's format whose arguments match each function's parameters schema; with "auto" the reply
is free until it opens a call (the format's marker), and the call itself is then constrained
(a lazy llguidance grammar, the way its structural tags work).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from llmx.errors import InputError, LlmxError, require
from llmx.runtime.constraints import CompiledConstraint, ConstraintSpec, compile_constraint
from llmx.runtime.sampling import SamplingParams
from llmx.serve.errors import bad_request
from llmx.serve.tool_calls import GENERIC, ToolFormat

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
# Arguments are written the way the families' templates write them: no free whitespace, ", " and
# ": " separators. It also keeps a model from padding a call with endless spaces.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolRequest:
    """What a chat request asked of tools (None on the Job when it asked nothing)."""

    fmt: ToolFormat
    tools: list[dict]  # checked, OpenAI-shaped
    choice: str  # "auto", "required" or a function's name
    parallel: bool

    @property
    def calls_only(self) -> bool:
        """The reply is constrained to calls ("required" or a named function)."""
        return self.choice != "auto"

    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": t["function"]} for t in self.tools]

    def template_vars(self) -> dict:
        """The chat template's ``tools`` variable, where the template renders tools itself."""
        return {} if self.fmt is GENERIC else {"tools": self.template_tools()}

    def grammar(self, added_tokens: dict[str, int]) -> str:
        """The llguidance Lark grammar for this request's replies."""
        functions = [t["function"] for t in self.tools]
        named = self.choice not in ("auto", "required")
        if named:
            functions = [f for f in functions if f["name"] == self.choice]
        most = 1 if not self.parallel or named else self.fmt.max_calls  # a named function is called once (as vLLM does)
        rules = call_rules(self.fmt, functions, most, added_tokens)
        if self.choice != "auto":
            return "start: calls\n" + rules
        free = _free_rules(self.fmt, added_tokens)
        if not self.fmt.anywhere:  # a reply is calls, or text that does not open like one
            opening = "(PLAIN | special)" if "special:" in free else "PLAIN"
            return f"start: calls | plain?\nplain: {opening} piece*\nPLAIN: /[^{{](.|\\n)*/\n" + free + rules
        if _opens_with_token(self.fmt, added_tokens):
            return "start: piece* calls?\n" + free + rules
        return "start: piece* (TEXT | opening calls_tail)?\n" + free + _lazy_opening(self.fmt, functions, most, added_tokens)


def _free_rules(fmt: ToolFormat, added_tokens: dict[str, int]) -> str:
    """Free text for "auto": any text, and any added token that is not part of a call (a model's
    <think>, say, must stay possible); the call's own tokens only open or make up a call."""
    calls = fmt.open + fmt.before_call + fmt.after_call + fmt.close
    others = sorted(i for t, i in added_tokens.items() if t not in calls and t not in fmt.markers)
    if not others:
        return "piece: TEXT\nTEXT: /(.|\\n)+/\n"
    return f"piece: TEXT | special\nspecial: <[{_id_ranges(others)}]>\nTEXT: /(.|\\n)+/\n"


def _id_ranges(ids: list[int]) -> str:
    """llguidance's token-set syntax: 3-5,9 for 3, 4, 5, 9."""
    spans: list[list[int]] = []
    for i in ids:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _marker(fmt: ToolFormat) -> str:
    return (fmt.open + fmt.before_call)[: len(fmt.markers[0])]


def _opens_with_token(fmt: ToolFormat, added_tokens: dict[str, int]) -> bool:
    """A marker that is one token of its own cannot hide inside free text's bytes, so free text
    followed by the calls is unambiguous without a lazy lexeme."""
    return _marker(fmt) in added_tokens


def _lazy_opening(fmt: ToolFormat, functions: list[dict], most: int | None, added_tokens: dict[str, int]) -> str:
    marker = _marker(fmt)
    tail = call_rules(fmt, functions, most, added_tokens, drop=len(marker)).replace("calls:", "calls_tail:", 1)
    return f"opening[lazy]: /(.|\\n)*{re.escape(marker)}/\n" + tail


def lark_text(text: str, added_tokens: dict[str, int]) -> str:
    """``text`` as Lark: string literals, with added tokens (llguidance's special tokens) as <[id]>."""
    found = [t for t in added_tokens if t and t in text]
    if not found:
        return json.dumps(text, ensure_ascii=False) if text else ""
    parts = re.split("(" + "|".join(map(re.escape, sorted(found, key=len, reverse=True))) + ")", text)
    return " ".join(f"<[{added_tokens[p]}]>" if p in added_tokens else json.dumps(p, ensure_ascii=False)
                    for p in parts if p)


def call_rules(fmt: ToolFormat, functions: list[dict], most: int | None, added_tokens: dict[str, int],
               drop: int = 0) -> str:
    """Rules ``calls`` (up to ``most`` calls in ``fmt``) and one ``fn_i`` per function.
    ``drop``: characters of the opening already matched (a lazy lexeme took the marker)."""
    lit = lambda s: lark_text(s, added_tokens)  # noqa: E731
    first = (fmt.open + fmt.before_call)[drop:]
    repeat = "" if most == 1 else f' ({lit(fmt.after_call + fmt.separator + fmt.before_call)} call)' + \
        ("*" if most is None else f"{{0,{most - 1}}}")
    lines = [f"calls: {lit(first)} call{repeat} {lit(fmt.after_call + fmt.close)}",
             "call: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
    for i, f in enumerate(functions):
        head = '{"name": ' + json.dumps(f["name"]) + f', "{fmt.args_key}": '
        schema = {**(f.get("parameters") or NO_PARAMETERS), "x-guidance": JSON_STYLE}
        lines.append(f"fn_{i}: {lit(head)} %json {json.dumps(schema)} {lit('}')}")
    return "\n".join(lines) + "\n"


def with_tools(params: list[SamplingParams], tools: ToolRequest, engine) -> list[SamplingParams]:
    """Each choice's params for a request with tools: held to the tool-call grammar, and shown
    the calls' marker even where it is a control token (Mistral's [TOOL_CALLS])."""
    changes = {"constraint": tool_constraint(tools, engine)}
    if any(m in engine.tokenizer.added_tokens(special_only=True) for m in tools.fmt.markers):
        changes["skip_special_tokens"] = False
    return [dataclasses.replace(p, **changes) for p in params]


def tool_constraint(tools: ToolRequest, engine) -> CompiledConstraint:
    grammar = tools.grammar(engine.tokenizer.added_tokens())
    try:
        # Bounded numbers: a runaway number in an argument would leave a call max_tokens cuts off.
        return compile_constraint(ConstraintSpec.lark(grammar, bound_numbers=True), engine.tokenizer, engine.manifest.model.vocab_size)
    except InputError as exc:  # a ConstraintError
        raise bad_request(f"the tools cannot be enforced: {exc}", param="tools", code="invalid_tool_schema") from None


# -- checks ------------------------------------------------------------------------------------

def check_tools(value: Any) -> list[dict]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
        f = tool["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad_request(f"'{where}.function' has an unknown field '{sorted(unknown)[0]}'", param=where)
        if not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
            raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'", param=where)
        if f["name"] in names:
            raise bad_request(f"'{where}.function.name': '{f['name']}' is defined twice; tool names must be unique", param=where)
        if "description" in f and not isinstance(f["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", param=where)
        names.add(f["name"])
        check_parameters(f.get("parameters"), f"{where}.function.parameters")
        tools.append({"type": "function", "function": dict(f)})  # rendered as sent, as transformers does
    return tools


def check_parameters(schema: Any, where: str) -> None:
    """A JSON schema llguidance compiles (refused with its reason otherwise)."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}' must be a JSON schema object", param=where)
    try:
        matcher = require("llguidance", "tool calling", "serve").LLMatcher
    except LlmxError as exc:
        raise bad_request(str(exc), param="tools", code="unsupported_parameter") from None
    try:
        error = matcher.validate_grammar(matcher.grammar_from_json_schema({**schema, "x-guidance": JSON_STYLE}))
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise bad_request(f"'{where}' is not a JSON schema llmx can enforce: {error.splitlines()[0][:300]}",
                          param=where, code="invalid_tool_schema")


def check_tool_choice(value: Any, tools: list[dict]) -> str:
    if value in ("none", "auto", "required"):
        return value
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise bad_request('\'tool_choice\' must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}', param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"'tool_choice' names the function '{name}', which is not in 'tools'", param="tool_choice")
    return name


def tool_request(f: dict, fmt: ToolFormat | None) -> ToolRequest | None:
    """The checked tools, tool_choice and parallel_tool_calls of a chat request's fields ``f``."""
    tools = check_tools(f["tools"]) if f["tools"] is not None else []
    if f["tool_choice"] is not None and not tools and f["tool_choice"] != "none":
        raise bad_request("'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
    choice = check_tool_choice(f["tool_choice"] or ("auto" if tools else "none"), tools)
    if not tools or choice == "none":  # "none": the model is not shown the tools, its reply is not parsed
        return None
    return ToolRequest(fmt or GENERIC, tools, choice, f["parallel_tool_calls"] is not False)


# -- the generic format: tools for a template that renders none ------------------------------------

GENERIC_PROMPT = ("You can call these functions:\n{functions}\nTo call one, reply with only "
                  '{{"name": <function name>, "arguments": <arguments object>}}.')


def generic_messages(messages: list[dict], tools: ToolRequest, system: bool = True) -> list[dict]:
    """``messages`` for a template that knows no tools: the functions described in the system
    message (as llama.cpp's server does for such templates), calls made earlier written as the
    JSON the model is asked for, and results as user turns (merged into a user turn before them,
    for templates that insist on alternating roles)."""
    functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools.tools)
    prompt = GENERIC_PROMPT.format(functions=functions)
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                          ensure_ascii=False) for c in m["tool_calls"])
            m = {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls}
        elif m["role"] == "tool":
            result = {"tool_response": {"name": m.get("name"), "content": m["content"]}}
            m = {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + m["content"]}
        else:
            out.append(dict(m))
    if out and out[0]["role"] in ("system", "developer"):
        out[0]["content"] = out[0]["content"] + "\n\n" + prompt
    elif system:
        out.insert(0, {"role": "system", "content": prompt})
    else:
        first = next((m for m in out if m["role"] == "user"), None)
        if first is None:
            out.insert(0, {"role": "user", "content": prompt})
        else:
            first["content"] = prompt + "\n\n" + first["content"]
    return out


# -- messages ----------------------------------------------------------------------------------

def assistant_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, as templates read them (arguments as a dict)."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{where}' must be a non-empty list of tool calls", param=where)
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad_request(f"'{where}[{j}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                              f"{{\"name\", \"arguments\": a JSON string}}}}", param=where)
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError:
            raise bad_request(f"'{where}[{j}].function.arguments' is not valid JSON", param=where) from None
        calls.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": fn["name"], "arguments": arguments}})
    return calls


def tool_result(m: dict, where: str, names: dict[str, str]) -> dict:
    """A role "tool" message: its tool_call_id is required; where it names a call made earlier in the
    conversation, the result also carries that function's name."""
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"'{where}.tool_call_id' is required on a tool message", param=f"{where}.tool_call_id")
    out = {"role": "tool", "tool_call_id": call_id}
    if call_id in names:
        out["name"] = names[call_id]  # some templates label a result with its function's name
    return out
