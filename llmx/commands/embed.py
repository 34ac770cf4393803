import json
import sys

import click
import numpy as np

from llmx.commands.options import threads_option
from llmx.errors import InputError


def register(cli: click.Group) -> None:
    @cli.command("embed")
    @click.argument("artifact", type=click.Path(path_type=str))
    @click.argument("texts", nargs=-1)
    @click.option("--file", "file", type=click.File("r", encoding="utf-8"), help="Embed each non-empty line of this file ('-' for stdin).")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object: embeddings, dimensions, token counts.")
    @threads_option
    def embed(artifact, texts, file, as_json, threads):
        """Embed TEXTS (or the lines of --file) with an encoder artifact.

        Without --json, prints one line per input: the vector's first values and its norm.
        """
        from llmx.runtime.embed import Embedder

        inputs = list(texts) + ([line.rstrip("\n") for line in file if line.strip()] if file else [])
        if not inputs:
            raise InputError("give texts to embed as arguments or with --file")
        result = Embedder.load(artifact, threads=threads).embed(inputs)
        if as_json:
            click.echo(json.dumps({
                "model": str(artifact),
                "dimensions": int(result.vectors.shape[1]),
                "embeddings": result.vectors.round(7).tolist(),
                "token_counts": result.token_counts,
            }))
            return
        for text, vec in zip(inputs, result.vectors):
            head = " ".join(f"{v:+.4f}" for v in vec[:6])
            sys.stdout.write(f"[{head} ...] norm={np.linalg.norm(vec):.4f}  {text[:60]!r}\n")
