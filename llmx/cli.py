"""The ``llmx`` command line. Each command lives in ``llmx/commands/<name>.py`` and imports
its stage lazily, so ``llmx serve`` on an edge box never imports torch."""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator

import click

from llmx import __version__
from llmx.errors import LlmxError, Terminated

# Command modules, in the order `llmx --help` lists them (pipeline order).
COMMAND_MODULES = ("export", "inspect", "optimize", "calibrate", "build", "generate", "bench", "eval", "embed", "serve")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="llmx")
def cli() -> None:
    """Export Hugging Face decoders to ONNX, quantize, build engines and serve them.

    \b
    Pipeline:  export -> optimize -> calibrate -> build -> generate / bench / serve
    Every stage reads an artifact directory (llmx.json + graphs) and writes a new one.
    """


for _name in COMMAND_MODULES:
    importlib.import_module(f"llmx.commands.{_name}").register(cli)


# What `timeout`, CI cancellation and `docker stop` send (SIGTERM), and a closed terminal (SIGHUP).
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def _signals_end_like_ctrl_c() -> Iterator[list[int]]:
    """Their default action kills the process on the spot, past every ``finally``. Instead each
    raises Terminated, as Ctrl-C raises KeyboardInterrupt, so stages clean up as they do on
    Ctrl-C; yields the signals received. ``llmx serve`` installs its own SIGTERM handler (drain)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # signal.signal would refuse
        yield received
        return

    def on_signal(signum, frame):
        received.append(signum)
        raise Terminated(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in ENDING_SIGNALS}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> None:
    with _signals_end_like_ctrl_c() as received:
        try:
            cli.main(args=argv, prog_name="llmx", standalone_mode=False)
        except BaseException as exc:
            sys.exit(_exit_code(exc, received))


def _exit_code(exc: BaseException, signals_received: list[int]) -> int:
    """Print the one line ``exc`` ends llmx with; the exit code."""
    if signals_received:  # whatever came out: C code may wrap Terminated (a module's import turns it into ImportError)
        click.echo(f"terminated ({signal.Signals(signals_received[0]).name})", err=True)
        return 128 + signals_received[0]
    if isinstance(exc, click.exceptions.Abort):
        click.echo("aborted", err=True)
        return 130
    if isinstance(exc, click.ClickException):
        exc.show()
        return exc.exit_code
    if isinstance(exc, LlmxError):
        click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        return 130
    raise exc


if __name__ == "__main__":
    main()
