import json

import click

from llmx.commands.options import backend_options
from llmx.errors import InputError


def register(cli: click.Group) -> None:
    @cli.command("eval")
    @click.argument("artifact", type=click.Path(path_type=str))
    @click.option("--data", required=True, type=click.Path(path_type=str),
                  help="Text to score: a UTF-8 file, JSONL with a \"text\" field, or a folder of text files.")
    @click.option("--samples", type=int, default=64, show_default=True, help="Windows to score (at most, evenly spread).")
    @click.option("--seq-len", type=int, default=256, show_default=True, help="Tokens per window.")
    @click.option("--reference", type=click.Path(path_type=str), default=None,
                  help="Also score this artifact (e.g. the fp32 one) and report top-1 agreement and mean KL.")
    @click.option("--score-from", type=int, default=1, show_default=True,
                  help="First position of each window that is scored; earlier tokens are context only "
                       "(llama.cpp's llama-perplexity -c 256 scores from 128).")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
    @backend_options
    def evaluate(artifact, data, samples, seq_len, reference, score_from, as_json, backend, threads, low_memory):
        """Perplexity of ARTIFACT on text (windows of --seq-len tokens, scored by the decode graph)."""
        from llmx.calibration.data import pick_windows, read_text_data, token_windows
        from llmx.runtime.engine import Engine, engine_options
        from llmx.runtime.evaluate import agreement, perplexity

        options = engine_options(backend, threads, low_memory)
        if backend == "ort-cpu":
            options["lazy_prefill"] = False  # score the prefill graph even for one-row window batches
        engine = Engine.load(artifact, backend=backend, **options)
        if seq_len > engine.max_seq_len:
            raise InputError(f"--seq-len {seq_len} exceeds the model's maximum length {engine.max_seq_len}")
        text = read_text_data(data)
        windows = pick_windows(token_windows(engine.tokenizer, text, seq_len), samples, seq_len, data)
        if reference is not None and score_from != 1:
            raise InputError("--score-from applies to perplexity; --reference compares every position")
        result = {"artifact": artifact, "data": data, "data_sha256": text.sha256, "seq_len": seq_len,
                  "scheme": engine.manifest.precision.scheme}
        if reference is None:
            score = perplexity(engine.backend, windows, score_from=score_from)
            result.update(perplexity=score.perplexity, tokens=score.tokens, windows=score.windows)
        else:
            ref = Engine.load(reference, backend=backend, **options)
            summary = agreement(ref.backend, engine.backend, windows).summary()
            result.update(reference=reference, **summary)
        if as_json:
            click.echo(json.dumps(result))
        else:
            line = f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens ({result['windows']} windows x {seq_len})"
            if reference is not None:
                line += (f"; reference {result['reference_perplexity']:.4f} (ratio {result['perplexity_ratio']:.4f}x), "
                         f"top-1 agreement {result['top1_agreement']:.2%}, mean KL {result['mean_kl']:.5f}")
            click.echo(line)
