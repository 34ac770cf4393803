"""The ``llmx`` command line. Each command lives in ``llmx/commands/<name>.py`` and imports
its stage lazily, so ``llmx serve`` on an edge box never imports torch."""

from __future__ import annotations

import importlib
import sys

import click

from llmx import __version__
from llmx.errors import LlmxError

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


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="llmx", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except LlmxError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
