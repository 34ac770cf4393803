"""The README and the CLI describe the same system: every `llmx ...` line in the README's code
blocks parses with the real commands, every command has help, and the README opens with the
two set-up commands."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from llmx.cli import COMMAND_MODULES, cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def readme_commands() -> list[str]:
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", README, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("llmx "):
                lines.append(line)
    return lines


COMMANDS = readme_commands()


def test_readme_starts_with_the_two_setup_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]
    assert README.index(first_block) < 200  # right at the top
    assert (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text().strip().endswith("bash scripts/test.sh")


def test_readme_shows_every_command():
    used = {shlex.split(c)[1] for c in COMMANDS}
    assert set(cli.commands) <= used, f"README never shows: {sorted(set(cli.commands) - used)}"
    assert len(cli.commands) == len(COMMAND_MODULES)


@pytest.mark.parametrize("line", COMMANDS)
def test_readme_command_parses(line):
    args = shlex.split(line.split(" #")[0])[1:]
    args = [a for a in args if not a.startswith(("|", ">"))]
    name, rest = args[0], args[1:]
    command = cli.get_command(click.Context(cli), name)
    assert command is not None, f"unknown command in README: {line}"
    try:
        command.make_context(name, rest, parent=click.Context(cli, info_name="llmx"))
    except click.exceptions.Exit:
        pass  # --help
    except click.UsageError as exc:
        pytest.fail(f"README command does not parse: {line}\n{exc}")


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_every_command_has_help(name):
    command = cli.commands[name]
    assert command.help and len(command.help.strip()) > 20
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden and param.name != "help":
            assert param.help, f"llmx {name} {param.opts[0]} has no help text"
