import click

from llmx.commands.options import force_option


def register(cli: click.Group) -> None:
    @cli.command("optimize")
    @click.argument("artifact", type=click.Path(path_type=str))
    @click.option("-o", "--output", required=True, type=click.Path(path_type=str), help="Artifact directory to write.")
    @force_option
    def optimize(artifact: str, output: str, force: bool) -> None:
        """Rewrite a portable artifact's graphs with ONNX Runtime's fused kernels.

        \b
        Writes a new artifact (same inputs, outputs and KV cache) whose graphs use
        GroupQueryAttention, skip + RMS/LayerNorm and fused activations: faster on ONNX
        Runtime's CPU and CUDA providers. The source stays portable (TensorRT reads it).
        """
        from llmx.optimize.fuse import optimize_artifact

        log = lambda msg: click.echo(msg, err=True)  # noqa: E731
        optimize_artifact(artifact, output, force=force, log=log)
