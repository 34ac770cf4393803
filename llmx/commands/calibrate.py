import json

import click

from llmx.commands.options import force_option, threads_option
from llmx.errors import InputError


def tqdm_progress(desc: str, total: int):
    """A progress bar on stderr (stdout carries the report)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", leave=False, dynamic_ncols=True)


OFF = "off"  # --smoothquant off: fixed at no smoothing (None would leave it to the search)


def _alpha(ctx, param, value: str | None) -> float | str | None:
    if value is None:
        return None
    if value.lower() in ("off", "none", "no"):
        return OFF
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(f"expected a number in [0, 1] or 'off', got {value!r}") from None


def _block_size(ctx, param, value: str) -> int | None:
    if value.lower() == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"expected a power of two >= 16 or 'auto', got {value!r}") from None


def search_space(scheme, search: bool, target, fallback: bool, method, alpha, awq):
    """The search's dimensions: every flag given fixes its own; None without search or a scheme."""
    from llmx.calibration.search import ALPHAS, METHODS, SearchSpace

    if not search or scheme is None:
        if target is not None:
            raise InputError("--target needs the search (drop --no-search)")
        return None
    return SearchSpace(target=target, fallback=fallback,
                       methods=(method,) if method else METHODS,
                       alphas=ALPHAS if alpha is None else (None if alpha == OFF else alpha,),
                       awq=(False, True) if awq is None else (awq,))


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
    @click.option("--target", type=float, default=None,
                  help="Quality the search must reach: max perplexity ratio for decoders (default w8a8 1.02, w8 1.005, "
                       "w4 1.03), held on the held-out windows (one standard error above) and as exp(mean KL), the "
                       "ratio on the fp32 model's own text; min mean cosine to fp32 for encoders (default 0.99).")
    @click.option("--search/--no-search", default=True, show_default=True,
                  help="Search recipes and per-MatMul fallbacks for the fastest one meeting --target; "
                       "--no-search quantizes with exactly the flags given.")
    @click.option("--fallback/--no-fallback", default=True, show_default=True,
                  help="Let the search keep the most sensitive MatMuls in higher precision.")
    @click.option("--method", default=None,
                  help="w8a8 activation ranges: minmax, entropy or percentile (fixes the search's choice; "
                       "without search: percentile).")
    @click.option("--smoothquant", "alpha", callback=_alpha, default=None,
                  help="SmoothQuant alpha (e.g. 0.5), or 'off': w8a8, and w8/w4 whose MatMulNBits round activations "
                       "to INT8 (fixes the search's choice; without search: off).")
    @click.option("--awq/--no-awq", default=None, help="w4/w8: AWQ activation-aware scales (fixes the search's choice; "
                                                       "without search: off).")
    @click.option("--per-channel/--per-tensor", default=True, show_default=True, help="w8a8 weight scales.")
    @click.option("--block-size", callback=_block_size, default="auto", show_default=True, metavar="N|auto",
                  help="w8/w4: input channels per scale (power of 2, >= 16). auto: the search tries 128 (faster) "
                       "and falls back to 32 when quality needs it; without search: 32. A number fixes the "
                       "search's choice.")
    @click.option("--symmetric/--asymmetric", default=True, show_default=True, help="w8/w4: symmetric blocks (no zero points) or asymmetric.")
    @click.option("--samples", type=int, default=32, show_default=True, help="Calibration windows (at most).")
    @click.option("--seq-len", type=int, default=256, show_default=True, help="Tokens per window.")
    @click.option("--eval-data", type=click.Path(path_type=str), default=None,
                  help="Text for the quality report (default: a held-out tail of --data).")
    @click.option("--eval-samples", type=int, default=16, show_default=True, help="Evaluation windows (at most).")
    @click.option("--layered/--whole", default=None,
                  help="w8/w4: run the fp32 graphs a decoder layer at a time (default: when they do not fit in memory).")
    @threads_option
    @click.option("--json", "as_json", is_flag=True, help="Print the quality report as one JSON object.")
    @force_option
    def calibrate(artifact, output, data, scheme, kv_cache, target, search, fallback, method, alpha, awq, per_channel,
                  block_size, symmetric, samples, seq_len, eval_data, eval_samples, layered, threads, as_json, force):
        """Quantize ARTIFACT to INT8/INT4 and report what it cost in quality.

        \b
        llmx calibrate ./art --data calib.txt --scheme w8a8 -o ./art-int8              # searched, <= 1.02x
        llmx calibrate ./art --data calib.txt --scheme w8a8 --target 1.01 -o ./art-int8
        llmx calibrate ./art --data calib.txt --scheme w8a8 --no-search --method entropy --smoothquant 0.5 -o ./x
        llmx calibrate ./art --data calib.jsonl --scheme w8 -o ./art-w8
        llmx calibrate ./art --data calib.txt --scheme w4 -o ./art-w4                  # block 128, or 32 if needed
        llmx calibrate ./art --data calib.txt --scheme w4 --block-size 32 -o ./art-w4
        llmx calibrate ./art --data calib.txt --kv-cache int8 -o ./art-kv8          # int8 KV cache alone
        llmx calibrate ./art --data calib.txt --scheme w8 --kv-cache int8 -o ./art-w8-kv8

        By default the search tries range methods and SmoothQuant alphas (w8a8, w8) or AWQ (w4)
        at block size 128, then smaller blocks only if no 128 recipe meets --target (w8: 32, 16;
        w4: 32), then keeps the most sensitive MatMuls (ranked in one local pass) in higher
        precision until --target holds. Every candidate is timed on this machine, and the
        fastest that meets the target is picked; if none does, it says so and exits non-zero
        (--force keeps the best). Both graphs are quantized (decode calibrated on real KV caches). The new
        artifact holds quality.json: perplexity fp32 vs quantized on held-out text, top-1
        agreement, mean KL, graph sizes and the whole search; w8a8 also holds TensorRT
        calibration tables under tensorrt/.

        A w8/w4 model whose fp32 graphs do not fit in memory is calibrated a decoder layer at a
        time (an 8B model on a 24 GiB box): the fp32 reference and statistics are computed one
        layer's weights at a time, the candidates run whole (they fit), and the per-layer
        sensitivity evaluations are skipped (their graphs are mostly fp32).
        """
        from llmx.calibration import CalibrationOptions, calibrate_artifact
        from llmx.calibration.report import format_report

        space = search_space(scheme, search, target, fallback, method, alpha, awq)
        options = CalibrationOptions(scheme=scheme, method=method or "percentile", smoothquant=None if alpha == OFF else alpha,
                                     per_channel=per_channel, block_size=block_size, symmetric=symmetric,
                                     samples=samples, seq_len=seq_len, eval_samples=eval_samples, threads=threads,
                                     kv_cache=kv_cache, awq=bool(awq), search=space, layered=layered)
        log = lambda msg: click.echo(msg, err=True)  # noqa: E731
        manifest = calibrate_artifact(artifact, output, data, options, eval_data=eval_data, force=force, log=log,
                                      progress=tqdm_progress)
        report = manifest.extras["quality"]
        click.echo(json.dumps(report) if as_json else format_report(report))
        click.echo(f"wrote {output} ({options.label})", err=True)
