"""The README's tour shows what its commands print: the console block runs the tour's own
commands, and export, generate, optimize and bench (and docs/inspect.md's inspect), run here,
print lines of the shape shown (numbers aside; the generated text word for word)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from llmx.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TOUR = README[README.index("## A tour") :]
TOUR = TOUR[: TOUR.index("\n## ")]


def tour_commands() -> list[str]:
    """The tour's bash block, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", TOUR, flags=re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def shown(source: str, language: str = "console") -> dict[str, list[str]]:
    """`$ command` -> the lines shown after it, in ``source``'s ``language`` blocks."""
    outputs: dict[str, list[str]] = {}
    for block in re.findall(rf"```{language}\n(.*?)```", source, flags=re.S):
        lines: list[str] = []
        for line in block.splitlines():
            if line.startswith("$ "):
                lines = outputs.setdefault(line[2:].split("  #")[0].strip(), [])
            else:
                lines.append(line)
    return {command: _trimmed(lines) for command, lines in outputs.items()}


def _trimmed(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def shape(line: str) -> str:
    """A line with its numbers (times, sizes, counts) as # and runs of spaces as one."""
    return re.sub(r"\s+", " ", re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", line)).strip()


def run(args: list[str], capsys) -> tuple[str, list[str]]:
    """``llmx ARGS``: its stdout, its stderr lines (what fixtures printed before is dropped)."""
    capsys.readouterr()
    main(args)
    out, err = capsys.readouterr()
    return out, _trimmed(err.splitlines())


SHOWN = shown(TOUR)


def shown_output(command: str) -> list[str]:
    assert command in SHOWN, f"the README's tour no longer shows `$ {command}`"
    return SHOWN[command]


@pytest.fixture
def tour_dir(tmp_path, monkeypatch, demo_artifact) -> Path:
    """A folder where the tour's paths exist: art is the exported demo model."""
    (tmp_path / "art").symlink_to(demo_artifact)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_console_shows_the_tours_own_commands():
    commands = tour_commands()
    for command in SHOWN:
        assert command.startswith("curl ") or command in commands, f"shown but not in the tour: {command}"
    for i, line in enumerate(commands):  # every artifact a command reads, an earlier tour line writes
        words = line.split()
        if words[0] == "llmx" and words[1] != "export":
            assert any(f"-o {words[2]}" in earlier for earlier in commands[:i]), \
                f"`{line}` reads {words[2]}, which no earlier tour line makes"


def test_export_prints_the_lines_shown(store, tmp_path, monkeypatch, capsys):
    # The tiny Llama stands in for the demo model (same family, same lines, a fifth of the time).
    command = "llmx export llmx/demo_model -o art --verify"
    (tmp_path / "llmx").mkdir()
    (tmp_path / "llmx" / "demo_model").symlink_to(store.checkpoint("llama"))
    monkeypatch.chdir(tmp_path)
    _, err = run(command.split()[1:], capsys)
    still = "... still"  # the heartbeat: how many depends on the host's speed
    assert [shape(line) for line in err if still not in line] == \
           [shape(line) for line in shown_output(command) if still not in line]


def test_generate_prints_the_text_shown(tour_dir, capsys):
    command = next(c for c in tour_commands() if c.startswith("llmx generate art "))
    expected = shown_output(command)
    out, err = run(shlex.split(command)[1:], capsys)
    assert out.rstrip("\n").splitlines() == expected[:-1]
    assert [shape(line) for line in err] == [shape(expected[-1])]


def test_optimize_and_bench_print_the_lines_shown(tour_dir, capsys):
    optimize = next(c for c in tour_commands() if c.startswith("llmx optimize art "))
    bench = next(c for c in tour_commands() if c.startswith("llmx bench art-opt "))
    out, err = run(optimize.split()[1:], capsys)
    assert [shape(line) for line in err] == [shape(line) for line in shown_output(optimize)]
    out, _ = run(["bench", "art-opt", "--prompt-len", "16", "--new-tokens", "8", "--batch", "1", "--repeat", "1"], capsys)
    lines, expected = out.splitlines(), shown_output(bench)
    assert shape(lines[0]) == shape(expected[0])
    assert [_label(line) for line in lines[1:]] == [_label(line) for line in expected[1:]]


def _label(line: str) -> str:
    """bench's row name: `  peak RSS           130 MB` -> `peak RSS`."""
    return re.match(r"\s*(\S+(?: \S+)*?)\s{2,}", line).group(1)


def test_inspect_prints_the_lines_docs_inspect_shows(tour_dir, capsys):
    (command, expected), = shown((ROOT / "docs" / "inspect.md").read_text()).items()
    out, _ = run(shlex.split(command)[1:], capsys)
    assert [shape(line) for line in out.splitlines()] == [shape(line) for line in expected]
