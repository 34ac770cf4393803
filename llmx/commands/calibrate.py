import json

import click

from llmx.commands.options import force_option, threads_option


def tqdm_progress(desc: str, total: int):
    """A progress bar on stderr (stdout carries the report)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", leave=False, dynamic_ncols=True)


def register(cli: click.Group) -> None:
    @cli.command("calibrate")
    @click.argument("artifact", type=click.Path(path_type=str))
    @click.option("-o", "--output", required=True, type=click.Path(path_type=str), help="Quantized artifact directory to write.")
    @click.option("--data", required=True, type=click.Path(path_type=str),
                  help="Calibration text: a UTF-8 file, JSONL with a \"text\" field, or a folder of text files.")
    @click.option("--scheme", default=None,
                  help="w8a8 (static INT8 Q/DQ), w8 or w4 (weight-only MatMulNBits); optional with --kv-cache int8.")
    @click.option("--kv-cache", type=click.Choice(["float32", "int8"]), default="float32", show_default=True,
                  help="int8: store the KV cache as int8 with calibrated per-channel scales (a quarter of the memory).")
    @click.option("--method", default="percentile", show_default=True, help="w8a8 activation ranges: minmax, entropy or percentile.")
    @click.option("--smoothquant", "alpha", type=float, default=None, help="w8a8: apply SmoothQuant with this alpha (e.g. 0.5).")
    @click.option("--per-channel/--per-tensor", default=True, show_default=True, help="w8a8 weight scales.")
    @click.option("--block-size", type=int, default=32, show_default=True, help="w8/w4: input channels per scale (power of 2, >= 16).")
    @click.option("--symmetric/--asymmetric", default=True, show_default=True, help="w8/w4: symmetric blocks (no zero points) or asymmetric.")
    @click.option("--samples", type=int, default=32, show_default=True, help="Calibration windows (at most).")
    @click.option("--seq-len", type=int, default=256, show_default=True, help="Tokens per window.")
    @click.option("--eval-data", type=click.Path(path_type=str), default=None,
                  help="Text for the quality report (default: a held-out tail of --data).")
    @click.option("--eval-samples", type=int, default=16, show_default=True, help="Evaluation windows (at most).")
    @threads_option
    @click.option("--json", "as_json", is_flag=True, help="Print the quality report as one JSON object.")
    @force_option
    def calibrate(artifact, output, data, scheme, kv_cache, method, alpha, per_channel, block_size, symmetric, samples, seq_len,
                  eval_data, eval_samples, threads, as_json, force):
        """Quantize ARTIFACT to INT8/INT4 and report what it cost in quality.

        \b
        llmx calibrate ./art --data calib.txt --scheme w8a8 --method entropy --smoothquant 0.5 -o ./art-int8
        llmx calibrate ./art --data calib.jsonl --scheme w8 -o ./art-w8
        llmx calibrate ./art --data calib.txt --scheme w4 --block-size 32 -o ./art-w4
        llmx calibrate ./art --data calib.txt --kv-cache int8 -o ./art-kv8          # int8 KV cache alone
        llmx calibrate ./art --data calib.txt --scheme w8 --kv-cache int8 -o ./art-w8-kv8

        Both graphs are quantized (decode calibrated on real KV caches). The new artifact holds
        quality.json: perplexity fp32 vs quantized on held-out text, top-1 agreement, mean KL and
        graph sizes; w8a8 also holds TensorRT calibration tables under tensorrt/.
        """
        from llmx.calibration import CalibrationOptions, calibrate_artifact
        from llmx.calibration.report import format_report

        options = CalibrationOptions(scheme=scheme, method=method, smoothquant=alpha, per_channel=per_channel,
                                     block_size=block_size, symmetric=symmetric, samples=samples, seq_len=seq_len,
                                     eval_samples=eval_samples, threads=threads, kv_cache=kv_cache)
        log = lambda msg: click.echo(msg, err=True)  # noqa: E731
        manifest = calibrate_artifact(artifact, output, data, options, eval_data=eval_data, force=force, log=log,
                                      progress=tqdm_progress)
        report = manifest.extras["quality"]
        click.echo(json.dumps(report) if as_json else format_report(report))
        click.echo(f"wrote {output} ({options.label})", err=True)
