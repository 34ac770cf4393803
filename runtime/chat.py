"""Chat templates: render messages with the model's own Jinja template (tokenizer_config.json).

Rendered in a sandbox, as transformers does, with the same helpers templates rely on
(``raise_exception``, ``strftime_now``, ``bos_token``/``eos_token``).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmx.errors import InputError


@lru_cache(maxsize=8)
def _compile(source: str):
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    if not tokenizer.chat_template:
        raise InputError("this model has no chat template (tokenizer_config.json has none); use a plain prompt")
    try:
        return _compile(tokenizer.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **extra,
        )
    except TemplateError as exc:
        raise InputError(f"chat template rejected the messages: {exc}") from exc
