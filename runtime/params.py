"""The ranges of sampling and decoding parameters: one table for ``llmx generate`` and the server.

Both refuse the same values with the same words: ``'temperature' must be a number in [0, 2],
got 5`` is the CLI's ``error:`` line and the server's 400 message. The ranges are OpenAI's
where OpenAI has the field (temperature, top_p, penalties, 4 stop strings, 20 logprobs);
top_k, min_p, typical_p and repetition_penalty follow vLLM and llama.cpp's server.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from llmx.errors import InputError

MAX_STOPS = 4  # OpenAI's limit
# Long enough for any real stop sequence; bounds the per-request matcher tables (runtime/sequence.py).
MAX_STOP_CHARS = 4096
MAX_LOGPROBS = 20  # OpenAI's limit
MAX_CHOICES = 64  # prompts x n: sequences one request may ask for
MAX_LOGIT_BIAS = 1024  # entries: bounds the per-token work a request can ask for

Checker = Callable[[Any, str], Any]


class ParamError(InputError):
    """A parameter outside its range; ``param`` names it (the server's error.param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def shown(value: Any) -> str:
    try:
        return json.dumps(value)[:80]
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply"
    except (TypeError, ValueError):
        return repr(value)[:80]


def invalid(name: str, rule: str, value: Any) -> ParamError:
    return ParamError(f"'{name}' must be {rule}, got {shown(value)}", name)


def integer(lo: int | None = None, hi: int | None = None) -> Checker:
    rule = "an integer" + (f" in [{lo}, {hi}]" if lo is not None and hi is not None else f" >= {lo}" if lo is not None else "")

    def check(value, name):
        if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise invalid(name, rule, value)
        return value

    return check


def number(lo: float, hi: float, open_lo: bool = False) -> Checker:
    rule = f"a number in {'(' if open_lo else '['}{lo:g}, {hi:g}]"

    def check(value, name):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value > hi or value < lo or (open_lo and value == lo):
            raise invalid(name, rule, value)
        return float(value)

    return check


def stop_strings(value, name):
    """A string or a list of strings: at most MAX_STOPS, each 1..MAX_STOP_CHARS characters."""
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise invalid(name, f"a string or a list of at most {MAX_STOPS} strings, each 1 to {MAX_STOP_CHARS} characters",
                      value)
    for s in stops:
        text(s, name)
    return list(stops)


def logit_bias(vocab_size: int | None = None) -> Checker:
    """OpenAI's ``{"token id": bias}`` (ids as strings in JSON, ints from the CLI), biases in
    [-100, 100]; with ``vocab_size`` the ids must be below it. Returns {int id: float bias}."""
    ids = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
    rule = f"an object mapping at most {MAX_LOGIT_BIAS} token ids ({ids}) to numbers in [-100, 100]"

    def token_id(key) -> int | None:
        if isinstance(key, int) and not isinstance(key, bool):
            tid = key
        elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12:
            tid = int(key)
        else:
            return None
        return tid if tid >= 0 and (vocab_size is None or tid < vocab_size) else None

    def check(value, name):
        if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
            raise invalid(name, rule, value)
        out = {}
        for key, bias in value.items():
            tid = token_id(key)
            if tid is None:
                raise invalid(f"{name}[{shown(key)}]", f"a key that is a token id {ids}", key)
            out[tid] = number(-100, 100)(bias, f"{name}[{shown(key)}]")
        return out

    return check


def text(value: str, name: str) -> str:
    """A string the tokenizer can take: JSON's lone UTF-16 surrogates ("\\ud800") are not text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParamError(f"'{name}' is not valid Unicode text (a lone surrogate at character {exc.start})", name) from None
    return value


# The sampling fields, by their SamplingParams names (the server's max_tokens is max_new_tokens).
SAMPLING: dict[str, Checker] = {
    "max_new_tokens": integer(1),
    "temperature": number(0, 2),  # 0 is greedy
    "top_k": integer(-1),  # -1 or 0: off
    "top_p": number(0, 1, open_lo=True),
    "min_p": number(0, 1),
    "typical_p": number(0, 1, open_lo=True),
    "repetition_penalty": number(0, 10, open_lo=True),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "seed": integer(0, 2**63 - 1),
    "logprobs": integer(0, MAX_LOGPROBS),
    "stop": stop_strings,
    "logit_bias": logit_bias(),
}
BEAM: dict[str, Checker] = {
    "length_penalty": number(-10, 10),
}


def check_sampling(values: dict[str, Any]) -> None:
    """Raise ParamError on the first value outside its range (None means unset)."""
    for name, value in values.items():
        if name in SAMPLING and value is not None:
            SAMPLING[name](value, name)


# Beam search is deterministic and scores with the model's own log-probabilities: these fields
# are accepted only at values that change nothing (temperature 0 is greedy, 1 the model's own
# distribution; either is what beam search does). seed is accepted and has no effect.
NOT_FOR_BEAMS: dict[str, tuple] = {
    "temperature": (0.0, 1.0), "top_k": (0, -1), "top_p": (1.0,), "min_p": (0.0,), "typical_p": (1.0,),
    "repetition_penalty": (1.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "stop": ([],),
    "logprobs": (None,), "logit_bias": (None, {}),
}


def check_beam_compatible(values: dict[str, Any]) -> None:
    """Raise ParamError on the first sampling field beam search cannot honour."""
    for name, neutral in NOT_FOR_BEAMS.items():
        value = list(values[name]) if name == "stop" and values.get(name) is not None else values.get(name, neutral[0])
        if value not in neutral:
            allowed = " or ".join(shown(v) for v in neutral)
            raise ParamError(f"'{name}' is not supported with beam search (it is deterministic and scores with the "
                             f"model's own log-probabilities): leave it out or set it to {allowed}", name)


def prompt_room(prompt_tokens: int, max_len: int, name: str = "prompt") -> int:
    """How many tokens may follow a prompt: at least one, or a ParamError that says so."""
    if prompt_tokens == 0:
        raise ParamError(f"'{name}' is empty (it encodes to no tokens)", name)
    if prompt_tokens >= max_len:
        raise ParamError(f"the prompt has {prompt_tokens} tokens, but this model's maximum context length is {max_len} "
                         f"tokens and it must leave room for at least one new token: shorten it to at most "
                         f"{max_len - 1} tokens", name)
    return max_len - prompt_tokens
