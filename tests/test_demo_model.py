"""The built-in demo model: its card's numbers are reproducible, and it writes Python."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

import llmx
from llmx.cli import main

ROOT = Path(__file__).resolve().parents[1]
CARD = Path(llmx.__file__).parent / "demo_model" / "MODEL_CARD.md"
sys.path.insert(0, str(ROOT / "scripts"))


def card_eval_perplexity() -> float:
    return float(re.search(r"llmx eval perplexity: \*\*([\d.]+)\*\*", CARD.read_text()).group(1))


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the card's held-out files are CPython 3.11's stdlib")
def test_llmx_eval_reproduces_the_model_card(demo_artifact, tmp_path, capsys):
    from demo_data import copy_held_out

    held = copy_held_out(tmp_path / "heldout")
    assert len(held) == 18 and "argparse.py" in held
    main(["eval", str(demo_artifact), "--data", str(tmp_path / "heldout"), "--seq-len", "512", "--samples", "1000", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["windows"] == 155
    assert result["perplexity"] == pytest.approx(card_eval_perplexity(), abs=5e-4)


def test_demo_model_is_packaged_and_writes_python(demo_artifact, capsys):
    manifest = json.loads((demo_artifact / "llmx.json").read_text())
    assert manifest["model"]["family"] == "llama" and manifest["model"]["num_layers"] == 6
    main(["generate", str(demo_artifact), "def fibonacci(n):", "--max-new-tokens", "48", "--temperature", "0.7",
          "--seed", "1", "--json"])
    text = "def fibonacci(n):" + json.loads(capsys.readouterr().out)["text"]
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) >= 3 and sum(line.startswith("    ") for line in lines) >= 2  # an indented body
    keywords = re.findall(r"\b(return|def|if|for|import|self|None|raise|in|not|is)\b", text)
    assert len(keywords) >= 3, text
    # Not necessarily valid Python (a 4.9M model), but mostly tokenizable as such.
    try:
        ast.parse(text)
    except SyntaxError as exc:
        assert exc.lineno and exc.lineno > 2, text


def test_demo_chat_template_renders_like_transformers_with_tools(demo_artifact):
    """The shipped ChatML-like template (with the Jinja `tools` variable) is exported with the
    artifact and renders exactly as transformers' apply_chat_template does."""
    import transformers

    from llmx.runtime.chat import render_chat
    from llmx.runtime.engine import Engine
    from train_demo_model import CHAT_TEMPLATE

    source = Path(llmx.__file__).parent / "demo_model"
    assert json.loads((source / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    hf = transformers.AutoTokenizer.from_pretrained(source)
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    tokenizer = Engine.load(demo_artifact, threads=1).tokenizer
    for extra in ({}, {"tools": tools}):
        ours = render_chat(tokenizer, messages, **extra)
        assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        assert ours.endswith("<|im_start|>assistant\n")
    with_tools = render_chat(tokenizer, messages, tools=tools)
    assert '<tools>\n{"name": "add"' in with_tools and '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in with_tools
