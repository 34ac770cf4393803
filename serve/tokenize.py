"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's request and response shapes.

    /tokenize   {"prompt": "text", "add_special_tokens": true}
                {"messages": [...], "add_generation_prompt": true}   (through the chat template)
             -> {"count": 3, "max_model_len": 512, "tokens": [...], "token_strs": [...] | null}
    /detokenize {"tokens": [...]} -> {"prompt": "text"}

``token_strs`` is filled when ``return_token_strs`` is true. Useful to build ``logit_bias``.
"""

from __future__ import annotations

from typing import Any

from llmx.serve.errors import bad_request
from llmx.serve.protocol import (Checker, boolean, chat_messages, check_chars, check_fields, invalid_field, parse_body,
                                 rendered_chat, string, template_kwargs)
from llmx.runtime.params import text

TOKENIZE: dict[str, tuple[Checker, Any]] = {
    "model": (string, None),
    "prompt": (string, None),
    "messages": (lambda v, n: v, None),
    "add_special_tokens": (boolean, None),
    "add_generation_prompt": (boolean, True),
    "return_token_strs": (boolean, False),
    "chat_template_kwargs": (lambda v, n: v, None),  # checked by template_kwargs
}
DETOKENIZE: dict[str, tuple[Checker, Any]] = {"model": (string, None), "tokens": (lambda v, n: v, None)}


def tokenize(raw: bytes, engine) -> dict:
    f = check_fields(parse_body(raw), TOKENIZE)
    tok, limit = engine.tokenizer, engine.max_seq_len
    if (f["prompt"] is None) == (f["messages"] is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
    if f["prompt"] is not None:
        special = True if f["add_special_tokens"] is None else f["add_special_tokens"]
        ids = tok.encode(check_chars(text(f["prompt"], "prompt"), tok, limit, "prompt"), add_special_tokens=special)
    else:
        rendered = rendered_chat(tok, chat_messages(f["messages"]), limit, add_generation_prompt=f["add_generation_prompt"],
                                 **template_kwargs(f["chat_template_kwargs"]))
        ids = tok.encode(rendered, add_special_tokens=bool(f["add_special_tokens"]))
    strs = [tok.token_text(i) for i in ids] if f["return_token_strs"] else None
    return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}


def detokenize(raw: bytes, engine) -> dict:
    f = check_fields(parse_body(raw), DETOKENIZE)
    vocab = engine.manifest.model.vocab_size
    ids = f["tokens"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise invalid_field("tokens", f"a list of token ids in [0, {vocab})", ids)
    return {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}
