import json

import click

from llmx.commands.options import backend_options


def _contexts(value: str | None) -> list[int]:
    if not value:
        return []
    try:
        contexts = [int(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter("expected comma-separated token counts, e.g. 64,256,1024") from None
    if any(c < 1 for c in contexts):
        raise click.BadParameter("context lengths must be positive")
    return contexts


def register(cli: click.Group) -> None:
    @cli.command("bench")
    @click.argument("artifact", type=click.Path(path_type=str))
    @click.option("--prompt-len", type=click.IntRange(min=1), default=128, show_default=True, help="Prompt tokens per sequence.")
    @click.option("--new-tokens", type=click.IntRange(min=2), default=128, show_default=True, help="Tokens generated per sequence (EOS ignored).")
    @click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences generated together.")
    @click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="Timed runs; the report holds their medians.")
    @click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed runs first.")
    @click.option("--context", "contexts", default=None, metavar="N,N,...",
                  help="Also time one decode step at these context lengths (e.g. 64,256,1024).")
    @click.option("--spin/--no-spin", default=None,
                  help="Let ONNX Runtime's threads busy-wait while a graph runs (default: when each thread has a free "
                       "core at start-up; env LLMX_SPIN=0|1).")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
    @backend_options
    def bench(artifact, prompt_len, new_tokens, batch, repeat, warmup, contexts, spin, as_json, backend, threads, low_memory):
        """Measure TTFT, per-token latency, throughput and peak memory of greedy generation.

        \b
        A fixed prompt of exactly --prompt-len token ids; --new-tokens tokens each, EOS ignored;
        --warmup untimed runs, then --repeat timed runs; medians are reported.
        """
        from llmx.runtime.bench import bench as run_bench, context_sweep
        from llmx.runtime.engine import Engine, engine_options

        contexts = _contexts(contexts)
        engine = Engine.load(artifact, backend=backend, **engine_options(backend, threads, low_memory, spin))
        result = run_bench(engine.backend, engine.tokenizer, prompt_len, new_tokens, batch, repeat, warmup).to_dict()
        plan = getattr(engine.backend, "cpu_plan", None)
        result.update(artifact=str(artifact), backend=backend, threads=plan.threads if plan else threads,
                      spin=plan.spin if plan else spin, cpu_plan=plan.describe() if plan else None, low_memory=low_memory,
                      optimized=bool(engine.manifest.stage_applied("optimize")))
        if contexts:
            sweep = context_sweep(engine.backend, engine.tokenizer, contexts, batch=batch)
            result["decode_step_ms_by_context"] = {str(c): ms for c, ms in sweep.items()}
            result["step_ratio_last_vs_first"] = round(sweep[contexts[-1]] / sweep[contexts[0]], 3)
        if as_json:
            click.echo(json.dumps(result))
        else:
            click.echo(_table(result))

    return bench


def _table(r: dict) -> str:
    lines = [
        f"{r['artifact']}: prompt {r['prompt_len']}, {r['new_tokens']} new tokens, batch {r['batch']}, "
        f"median of {r['repeat']} runs" + (f"\n  threads     {r['cpu_plan']}" if r.get("cpu_plan") else ""),
        f"  TTFT        {r['ttft_ms']:10.1f} ms",
        f"  TPOT        {r['tpot_ms']:10.2f} ms   (p50 {r['tpot_p50_ms']:.2f}, p90 {r['tpot_p90_ms']:.2f})",
        f"  prefill     {r['prefill_tokens_per_s']:10.1f} tok/s",
        f"  decode      {r['decode_tokens_per_s']:10.1f} tok/s",
        f"  peak RSS    {r['peak_rss_mb']:10.0f} MB",
    ]
    if r.get("pss_mb") is not None:
        lines.append(f"  PSS now     {r['pss_mb']:10.0f} MB   (shared pages counted once)")
    for c, ms in r.get("decode_step_ms_by_context", {}).items():
        lines.append(f"  step @ {c:>6} {ms:8.2f} ms")
    if "step_ratio_last_vs_first" in r:
        lines.append(f"  step ratio last/first context: {r['step_ratio_last_vs_first']:.2f}")
    return "\n".join(lines)
