import click


def register(cli: click.Group) -> None:
    @cli.command("export")
    @click.argument("checkpoint", type=click.Path(path_type=str))
    @click.option("-o", "--output", required=True, type=click.Path(path_type=str), help="Artifact directory to write.")
    @click.option("--verify", is_flag=True, help="Run the graphs on ONNX Runtime and compare with PyTorch; fail on mismatch.")
    @click.option("--all-logits", is_flag=True, help="Prefill returns logits for every position (for evaluation), not only the last.")
    @click.option("--force", is_flag=True, help="Replace OUTPUT if it is an existing artifact.")
    def export(checkpoint: str, output: str, verify: bool, all_logits: bool, force: bool) -> None:
        """Export a local Hugging Face checkpoint directory to an artifact.

        \b
        Decoders (Llama, Mistral, Qwen2, GPT-2) become prefill.onnx + decode.onnx sharing
        weights.bin; the tokenizer and a manifest (llmx.json) come along.

        \b
        CHECKPOINT may also be a GGUF file (or a directory holding one): llama and qwen2
        architectures; Q8_0/Q4_0/Q4_1 weights stay in their blocks (MatMulNBits), other
        types are dequantized to float32 (docs/export.md).
        """
        from llmx.export import export_checkpoint

        log = lambda msg: click.echo(msg, err=True)  # noqa: E731
        manifest = export_checkpoint(checkpoint, output, verify=verify, all_logits=all_logits, force=force, log=log)
        click.echo(f"wrote {output} ({manifest.model['family']}, {len(manifest.graphs)} graphs)", err=True)
