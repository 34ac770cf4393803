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
