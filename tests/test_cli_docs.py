"""docs/export.md, docs/inspect.md and docs/generate.md describe the commands as they are:
every option of each command's --help is on its page, and generate's page states the ranges
runtime/params.py enforces (for the CLI and the server alike)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from llmx.cli import cli
from llmx.runtime.params import MAX_STOP_CHARS, MAX_STOPS, SAMPLING, ParamError

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("name", ["export", "inspect", "generate"])
def test_every_option_is_on_the_commands_page(name):
    page = (DOCS / f"{name}.md").read_text()
    command = cli.get_command(click.Context(cli), name)
    for param in command.params:
        flags = param.opts if isinstance(param, click.Option) else [param.human_readable_name]
        assert any(f"`{flag}" in page or f" {flag}`" in page for flag in flags), f"docs/{name}.md never mentions {flags}"


def rule(name: str) -> str:
    try:
        SAMPLING[name](object(), name)
    except ParamError as exc:
        return re.match(rf"'{name}' must be (.*), got", str(exc)).group(1)
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(set(SAMPLING) - {"stop"}))
def test_generate_page_states_each_range(name):
    page = (DOCS / "generate.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith(f"| `--{name.replace('_', '-')}`"))
    assert f"| {rule(name)} |" in row, (row, rule(name))
    stop_row = next(line for line in page.splitlines() if line.startswith("| `--stop`"))
    assert f"at most {MAX_STOPS}, each 1 to {MAX_STOP_CHARS} characters" in stop_row
