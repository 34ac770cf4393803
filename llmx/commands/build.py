import json
import re
from pathlib import Path

import click

from llmx.artifact.handle import Artifact
from llmx.artifact.tensorrt import LAYOUTS, BuildLimits
from llmx.commands.options import force_option

PRECISION_HELP = (
    "Engine precision. auto: int8/fp8 for a calibrated (Q/DQ) artifact, else fp16. "
    "fp16/bf16 convert the graphs (norms, softmax, position math stay fp32); tf32 is fp32 with TF32 matmuls."
)


def register(cli: click.Group) -> None:
    from llmx.engine.tensorrt import PRECISIONS

    @cli.command("build")
    @click.argument("artifact", type=click.Path(path_type=Path))
    @click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Artifact directory to write.")
    @click.option("--precision", type=click.Choice(PRECISIONS), default="auto", show_default=True, help=PRECISION_HELP)
    @click.option("--layout", type=click.Choice(LAYOUTS), default="split", show_default=True,
                  help="split: prefill and decode engines; shared: one engine, a prefill and a decode profile (weights once).")
    @click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True, help="Most sequences per call.")
    @click.option("--max-seq-len", type=click.IntRange(min=2), default=None, help="Longest sequence (default: min(model maximum, 2048)).")
    @click.option("--max-decode-tokens", type=click.IntRange(min=1), default=8, show_default=True,
                  help="Most tokens one decode step takes (speculative drafts, chunked continuation).")
    @click.option("--prefill-chunk", type=click.IntRange(min=1), default=None, help="shared layout: prompt tokens per prefill call.")
    @click.option("--opt-batch", type=click.IntRange(min=1), default=1, show_default=True, help="Batch size TensorRT tunes kernels for.")
    @click.option("--workspace", type=click.FloatRange(min=0.0, min_open=True), default=None,
                  help="GiB of scratch memory TensorRT may use while choosing kernels (memory pool limit).")
    @click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
                  help="Timing cache file to reuse and update (default: one per TensorRT version and GPU under ~/.cache/llmx).")
    @click.option("--opt-level", type=click.IntRange(0, 5), default=None, help="TensorRT builder optimization level.")
    @click.option("--device", type=click.IntRange(min=0), default=0, show_default=True, help="GPU index.")
    @click.option("--onnx-only", is_flag=True, help="Write the converted graphs without engines (no TensorRT needed); "
                  "takes fused (w8/w4, optimized) graphs too, for --backend ort-cuda.")
    @click.option("--dry-run", is_flag=True, help="Print the build plan (precision, engines, profiles) as JSON and stop.")
    @force_option
    def build(artifact, output, precision, layout, max_batch, max_seq_len, max_decode_tokens, prefill_chunk, opt_batch,
              workspace, timing_cache, opt_level, device, onnx_only, dry_run, force):
        """Build TensorRT engines for an artifact: prefill and decode, with KV-cache profiles.

        \b
        The output holds the engines, the ONNX graphs they were built from (in the engine's
        precision, so --backend ort-cuda runs them too), the tokenizer and a manifest that
        records the TensorRT version and GPU; engines refuse to load anywhere else.
        """
        from llmx.engine.tensorrt import build_artifact, plan_build

        artifact = Artifact.open(artifact)
        limits = BuildLimits(max_batch, max_seq_len, max_decode_tokens, prefill_chunk, opt_batch)
        plan = plan_build(artifact, precision, layout, limits, engines=not onnx_only)
        if dry_run:
            text = json.dumps(plan.to_dict(), indent=2)  # shapes on one line each: [1, 128]
            click.echo(re.sub(r"\[\s*((?:-?\d+,\s*)*-?\d+)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text))
            return
        log = lambda msg: click.echo(msg, err=True)  # noqa: E731
        factory = None
        if not onnx_only:
            def factory():
                from llmx.engine.trt_build import PolygraphyBuilder

                return PolygraphyBuilder(timing_cache, int(workspace * (1 << 30)) if workspace else None, opt_level, device)
        manifest = build_artifact(artifact, output, plan, factory, force=force, log=log)
        record = manifest.tensorrt
        what = (f"{len(record.engines)} engine(s), TensorRT {record.version} on {record.device.name}, "
                f"{record.build_seconds:.1f} s") if record else "graphs only"
        click.echo(f"wrote {output} ({plan.precision}, {what})", err=True)
