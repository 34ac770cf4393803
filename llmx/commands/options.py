"""Options several commands share, defined once so their names, defaults and help agree."""

from __future__ import annotations

import click

from llmx.errors import InputError

# runtime.engine.BACKENDS, spelled here so `llmx --help` does not import the runtime (a test keeps them equal).
BACKEND_CHOICES = ("ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt")

threads_option = click.option("--threads", type=click.IntRange(min=1), default=None,
                              help="Intra-op threads (default: the cores free at start-up when generating, else physical cores).")
force_option = click.option("--force", is_flag=True, help="Replace OUTPUT if it is an existing artifact.")


def backend_options(f):
    """--backend/--threads/--low-memory, shared by every command that runs an artifact."""
    f = click.option("--low-memory", is_flag=True,
                     help="ort-cpu, unquantized artifacts: share one memory-mapped copy of the weights between "
                          "the graphs (and processes) instead of packing a copy per graph; ~45% less memory, "
                          "~5% slower decode.")(f)
    f = threads_option(f)
    return click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="ort-cpu", show_default=True, help="Execution backend.")(f)


def speculative_options(f):
    """--speculative/--draft/--num-draft-tokens, shared by generate and serve."""
    f = click.option("--num-draft-tokens", type=int, default=None,
                     help="Tokens drafted per step: ngram and draft 4; auto sizes its drafts up to this cap (8).")(f)
    f = click.option("--draft", type=click.Path(path_type=str), default=None,
                     help="Draft model artifact for --speculative draft (same tokenizer, smaller model).")(f)
    return click.option("--speculative", type=click.Choice(["auto", "ngram", "draft", "off"]), default="auto", show_default=True,
                        help="Speculative decoding: auto (prompt lookup where it pays: one running request with text "
                             "to copy), ngram (prompt lookup every step), draft (--draft ART), off. Output is the same.")(f)


def check_speculative_options(ctx: click.Context, speculative: str) -> None:
    if speculative == "off":
        for name in ("draft", "num_draft_tokens"):
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                raise InputError(f"--{name.replace('_', '-')} applies to speculative decoding, which --speculative off turns off")
