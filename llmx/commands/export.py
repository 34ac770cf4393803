import threading
import time

import click

from llmx.quant_blocks import UNSEARCHED_BLOCK_SIZE

# Export's slow phases (tracing each graph, writing weights) report nothing on their own for
# minutes on a real model: a line at least this often says it is still working.
HEARTBEAT_S = 15.0


class Progress:
    """Export's log lines with the elapsed time, and a heartbeat line during a long silence."""

    def __init__(self, echo=lambda msg: click.echo(msg, err=True)):
        self.echo, self.start, self.phase = echo, time.monotonic(), "starting"
        self._said = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="llmx-export-progress", daemon=True)

    def __call__(self, msg: str) -> None:
        self.phase, self._said = msg, time.monotonic()
        self.echo(f"[{self._said - self.start:6.1f} s] {msg}")

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, HEARTBEAT_S)):
            now = time.monotonic()
            if now - self._said >= HEARTBEAT_S:
                self._said = now
                self.echo(f"[{now - self.start:6.1f} s] ... still {self.phase[:1].lower()}{self.phase[1:]}")


def register(cli: click.Group) -> None:
    @cli.command("export")
    @click.argument("checkpoint", type=click.Path(path_type=str))
    @click.option("-o", "--output", required=True, type=click.Path(path_type=str), help="Artifact directory to write.")
    @click.option("--verify", is_flag=True, help="Run the graphs on ONNX Runtime and compare with PyTorch; fail on mismatch. "
                       "Loads the fp32 model (the only option of a decoder's export that does).")
    @click.option("--all-logits", is_flag=True, help="Prefill returns logits for every position (for evaluation), not only the last.")
    @click.option("--graphs", type=click.Choice(["portable", "fused"]), default=None,
                  help="portable: traced standard ONNX (TensorRT reads it). fused: ONNX Runtime's fused graphs "
                       "(what `llmx optimize` writes). Both stream the weights a tensor at a time. "
                       "Default: fused for w8/w4, else portable.")
    @click.option("--precision", default=None, metavar="fp32|fp16|bf16|w8|w4",
                  help="Weights as written (default fp32; a quantized GGUF keeps its own blocks, which "
                       "--precision fp32|fp16|bf16 dequantizes): w8/w4 quantize each MatMul weight as it streams past "
                       "(calibrate --no-search's blocks; no quality report); fp16/bf16 store weights in "
                       "16 bits and lower the portable graphs as `llmx build` does (for GPUs; on CPU, "
                       "ONNX Runtime computes them in fp32).")
    @click.option("--block-size", type=int, default=UNSEARCHED_BLOCK_SIZE, show_default=True,
                  help="w8/w4: input channels per scale (a power of two, at least 16).")
    @click.option("--force", is_flag=True, help="Replace OUTPUT if it is an existing artifact.")
    def export(checkpoint: str, output: str, verify: bool, all_logits: bool, graphs: str | None, precision: str,
               block_size: int, force: bool) -> None:
        """Export a Hugging Face checkpoint (a local directory or a hub id) to an artifact.

        \b
        Decoders become prefill.onnx + decode.onnx sharing weights.bin; the tokenizer and a
        manifest (llmx.json) come along. Families (config.json's model_type): llama, mistral,
        qwen2, gpt2, qwen3, gemma, gemma2, gemma3_text, granite, olmo2, smollm3, phi3, phi,
        gpt_neox, stablelm, starcoder2, mixtral, qwen3_moe;
        encoders: bert. Progress goes to stderr, a line per phase with the elapsed time.

        \b
        CHECKPOINT may also be a GGUF file (or a directory holding one), e.g. one written by
        llama.cpp's tools: its quantized weights stay in their own blocks (MatMulNBits, and the
        embedding looked up from its blocks), streamed a tensor at a time into ONNX Runtime's
        fused graphs; docs/export.md lists the architectures, pre-tokenizers and quant types.

        \b
        CHECKPOINT may also be a Hugging Face Hub id, ORG/NAME[@REVISION] (a branch, tag
        or commit; default main), when no local path of that name exists: only the files
        export reads are downloaded (config, tokenizer, the safetensors or else the
        pytorch_model*.bin weights) into the Hugging Face cache (HF_HUB_CACHE or HF_HOME;
        HF_TOKEN for gated or private repos; with HF_HUB_OFFLINE=1 the cache alone). A GGUF
        repo takes ORG/NAME[@REVISION]:QUANT as llama.cpp's -hf does: the .gguf whose name
        has QUANT (case-insensitive; without it Q4_K_M, then Q8_0, then the only one).

        \b
        A decoder's export never loads the model: the weights go from the checkpoint to
        weights.bin one tensor at a time (--precision w8/w4 quantizes them on the way,
        fp16/bf16 rounds them) and
        the portable graphs are traced on fake (shape-only) weights; --verify loads the
        fp32 model to compare with it. Before starting, export checks the memory and disk
        it will need and stops with the numbers, and the flags that would fit, if this
        machine lacks them.
        """
        from llmx.export import export_checkpoint
        from llmx.hub import resolve_checkpoint

        with Progress() as log:
            local = resolve_checkpoint(checkpoint, log)
            manifest = export_checkpoint(local, output, verify=verify, all_logits=all_logits, force=force,
                                         graphs=graphs, precision=precision, block_size=block_size, log=log,
                                         source=None if str(local) == checkpoint else checkpoint)
            log(f"wrote {output} ({manifest.model.family}, {len(manifest.graphs)} graph{'' if len(manifest.graphs) == 1 else 's'})")
