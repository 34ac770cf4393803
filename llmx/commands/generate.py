import json
import sys
import time

import click

BACKEND_CHOICES = ("ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt")


def backend_options(f):
    """--backend/--threads, shared by every command that runs an artifact."""
    f = click.option("--threads", type=click.IntRange(min=1), default=None, help="Intra-op threads (default: physical cores).")(f)
    return click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="ort-cpu", show_default=True, help="Execution backend.")(f)


def register(cli: click.Group) -> None:
    @cli.command("generate")
    @click.argument("artifact", type=click.Path(path_type=str))
    @click.argument("prompt")
    @click.option("--max-new-tokens", type=int, default=64, show_default=True)
    @click.option("--temperature", type=float, default=1.0, show_default=True, help="0 means greedy.")
    @click.option("--top-k", type=int, default=0, show_default=True, help="0 disables.")
    @click.option("--top-p", type=float, default=1.0, show_default=True)
    @click.option("--min-p", type=float, default=0.0, show_default=True)
    @click.option("--typical-p", type=float, default=1.0, show_default=True)
    @click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
    @click.option("--presence-penalty", type=float, default=0.0, show_default=True)
    @click.option("--frequency-penalty", type=float, default=0.0, show_default=True)
    @click.option("--seed", type=int, default=None, help="Makes sampling reproducible.")
    @click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed.")
    @click.option("--ignore-eos", is_flag=True, help="Keep going past end-of-sequence tokens.")
    @click.option("--logprobs", type=int, default=None, help="Report each token's logprob and the top N alternatives (with --json).")
    @click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message with the model's chat template.")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end instead of streaming text.")
    @backend_options
    def generate(artifact, prompt, as_json, chat, backend, threads, **sampling):
        """Generate a continuation of PROMPT, streaming text to stdout as it is produced."""
        from llmx.runtime.chat import render_chat
        from llmx.runtime.engine import Engine
        from llmx.runtime.sampling import SamplingParams

        params = SamplingParams(**{**sampling, "stop": list(sampling["stop"])}).validate()
        engine = Engine.load(artifact, backend=backend, threads=threads)
        text = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt
        ids = engine.tokenizer.encode(text, add_special_tokens=not chat)
        from llmx.runtime.generate import generate as run

        start = time.perf_counter()
        first: list[float] = []

        def on_event(event):
            if not first:
                first.append(time.perf_counter())
            if not as_json and event[1]:
                sys.stdout.write(event[1])
                sys.stdout.flush()

        seq = run(engine.backend, engine.tokenizer, [ids], params, on_event=on_event)[0]
        elapsed = time.perf_counter() - start
        n = len(seq.output_ids)
        ttft = first[0] - start if first else elapsed
        decode_rate = (n - 1) / (elapsed - ttft) if n > 1 and elapsed > ttft else 0.0
        if as_json:
            result = {
                "text": seq.text,
                "finish_reason": seq.finish_reason,
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "token_ids": seq.output_ids,
                "ttft_ms": round(ttft * 1e3, 2),
                "decode_tokens_per_s": round(decode_rate, 2),
            }
            if params.logprobs is not None:
                result["logprobs"] = [
                    {"token": lp.text, "token_id": lp.token_id, "logprob": lp.logprob,
                     "top_logprobs": [{"token": t, "token_id": i, "logprob": v} for i, t, v in lp.top]}
                    for lp in seq.logprobs
                ]
            click.echo(json.dumps(result, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
            click.echo(
                f"[{n} tokens, finish_reason={seq.finish_reason}, TTFT {ttft * 1e3:.0f} ms, {decode_rate:.1f} tok/s]",
                err=True,
            )
