import json
import sys
import time

import click

from llmx.commands.options import backend_options, check_speculative_options, speculative_options
from llmx.errors import InputError


def register(cli: click.Group) -> None:
    @cli.command("generate")
    @click.argument("artifact", type=click.Path(path_type=str))
    @click.argument("prompt")
    @click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Tokens to generate at most.")
    @click.option("--temperature", type=float, default=1.0, show_default=True, help="0 means greedy; at most 2.")
    @click.option("--top-k", type=int, default=0, show_default=True, help="0 disables.")
    @click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling: keep the most likely tokens up to this mass.")
    @click.option("--min-p", type=float, default=0.0, show_default=True, help="Drop tokens less likely than this fraction of the top token.")
    @click.option("--typical-p", type=float, default=1.0, show_default=True, help="Locally typical sampling mass (1 disables).")
    @click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
                  help="CTRL-style penalty on tokens of the prompt and output (1 disables).")
    @click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                  help="OpenAI-style: subtract this from tokens already generated.")
    @click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                  help="OpenAI-style: subtract this times each token's count so far.")
    @click.option("--seed", type=int, default=None, help="Makes sampling reproducible.")
    @click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed.")
    @click.option("--ignore-eos", is_flag=True, help="Keep going past end-of-sequence tokens.")
    @click.option("--logprobs", type=int, default=None, help="Report each token's logprob and the top N alternatives (with --json).")
    @click.option("--num-beams", type=int, default=1, show_default=True,
                  help="Beam search with this many beams (deterministic; prints the best, --json lists all).")
    @click.option("--length-penalty", type=float, default=1.0, show_default=True,
                  help="Beam score = logprob / length**PENALTY (> 0 favours longer hypotheses).")
    @click.option("--early-stopping", type=click.Choice(["true", "false", "never"]), default="false", show_default=True,
                  is_flag=False, flag_value="true", help="Beam search stopping rule, as transformers' (flag alone: true).")
    @click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID=BIAS",
                  help="Add BIAS (-100 to 100; -100 bans) to token ID's logit (repeatable).")
    @click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
                  help="Constrain the output to JSON matching the schema in this file.")
    @click.option("--regex", default=None, help="Constrain the output to match this regular expression.")
    @click.option("--grammar", type=click.Path(exists=True, dir_okay=False), default=None,
                  help="Constrain the output to this Lark grammar file (llguidance's dialect).")
    @speculative_options
    @click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message with the model's chat template.")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end instead of streaming text.")
    @backend_options
    @click.pass_context
    def generate(ctx, artifact, prompt, as_json, chat, backend, threads, low_memory, num_beams, length_penalty,
                 early_stopping, speculative, draft, num_draft_tokens, logit_bias, json_schema, regex, grammar, **sampling):
        """Generate a continuation of PROMPT, streaming text to stdout as it is produced.

        \b
        llmx generate ./art "def fibonacci(n):" --temperature 0
        llmx generate ./art "$(cat code.py)" --temperature 0 --speculative ngram
        llmx generate ./art "def fibonacci(n):" --speculative draft --draft ./small-art
        llmx generate ./art "The capital of France" --num-beams 4 --length-penalty 0.8 --json
        llmx generate ./art "user = " --json-schema person.schema.json --temperature 0
        """
        from llmx.runtime.chat import render_chat
        from llmx.runtime.decoding_request import BEAM_OPTIONS, DecodingRequest, for_model
        from llmx.runtime.engine import Engine, engine_options
        from llmx.runtime.sampling import SamplingParams

        check_speculative_options(ctx, speculative)
        params = SamplingParams(**{**sampling, "stop": list(sampling["stop"])}).validate()  # the server's ranges
        constraints = [flag for flag, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
                       if value]
        given = [name for name in BEAM_OPTIONS if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
        from llmx.runtime.drafters import EXPLICIT, make_drafter

        DecodingRequest(constraints, bool(logit_bias), num_beams > 1, speculative in EXPLICIT, given, sampling).check(FLAGS)
        spec = _constraint_spec(json_schema, regex, grammar)
        bias = _logit_bias(logit_bias)
        beams = _beam_params(num_beams, length_penalty, early_stopping, sampling)
        engine = Engine.load(artifact, backend=backend, **engine_options(backend, threads, low_memory))
        params.logit_bias, params.constraint = for_model(spec, bias, engine.tokenizer, engine.manifest.model.vocab_size)
        text = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt
        ids = engine.tokenizer.encode(text, add_special_tokens=not chat)
        if beams is not None:
            return _run_beams(engine, ids, beams, as_json)
        drafter = make_drafter(speculative, engine, num_draft_tokens, draft, backend=backend, threads=threads)
        thinking = None
        if chat:
            from llmx.runtime.reasoning import Reasoning, detect_format

            thinking = Reasoning.for_prompt(detect_format(engine.tokenizer.chat_template), text)
        _run(engine, ids, params, as_json, drafter, thinking)


class Flags:
    """The shared decoding rules' refusals (runtime/decoding_request.py), in this command's flags."""

    def several_constraints(self, names: list[str]):
        raise InputError(f"{' and '.join(names)} do not combine: give one constraint")

    def not_combined(self, feature: str, mode: str):
        if feature == "beams":
            raise InputError("beam search and speculative decoding do not combine: drop --speculative or --num-beams")
        what = "--logit-bias" if feature == "logit_bias" else "a constraint (--json-schema/--regex/--grammar)"
        raise InputError(f"{what} does not combine with --num-beams")  # the only mode that refuses them

    def beam_option_alone(self, name: str):
        raise InputError(f"--{name.replace('_', '-')} applies to beam search: add --num-beams N (N > 1)")


FLAGS = Flags()


def _constraint_spec(json_schema: str | None, regex: str | None, grammar: str | None):
    """The constraint asked for (runtime/constraints.py; one at most, checked already), or None."""
    from llmx.runtime.constraints import ConstraintSpec

    if json_schema:
        return ConstraintSpec.json_schema(_read_text(json_schema, "--json-schema"))
    if grammar:
        return ConstraintSpec.lark(_read_text(grammar, "--grammar"))
    return ConstraintSpec.regex(regex) if regex else None


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{flag}: cannot read {path}: {exc}") from None


def _logit_bias(pairs: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        tid, _, bias = pair.partition("=")  # no "=": bias is "", which float() refuses too
        try:
            out[tid.strip()] = float(bias)
        except ValueError:
            raise InputError(f"--logit-bias must be ID=BIAS (a token id and a number), got {pair!r}") from None
    return out


def _beam_params(num_beams: int, length_penalty: float, early_stopping: str, sampling: dict):
    """BeamParams for --num-beams > 1 (what beam search cannot honour is refused already), else None."""
    from llmx.runtime.beam import BeamParams

    if num_beams == 1:
        return None
    stopping = {"true": True, "false": False}.get(early_stopping, early_stopping)
    return BeamParams(num_beams=num_beams, max_new_tokens=sampling["max_new_tokens"], length_penalty=length_penalty,
                      early_stopping=stopping, ignore_eos=sampling["ignore_eos"]).validate()


def _run_beams(engine, ids: list[int], params, as_json: bool) -> None:
    from llmx.runtime.beam import BeamSearch

    start = time.perf_counter()
    search = BeamSearch(engine.backend, ids, params, engine.tokenizer.eos_token_ids)
    hypotheses = search.run()
    elapsed = time.perf_counter() - start
    decode = engine.tokenizer.decode
    best = hypotheses[0]
    if not as_json:
        click.echo(decode(best.token_ids))
        click.echo(f"[best of {params.num_beams} beams: {len(best.token_ids)} tokens, score {best.score:.4f}, "
                   f"finish_reason={best.finish_reason}, {elapsed:.2f} s]", err=True)
        return
    beams = [{"text": decode(h.token_ids), "token_ids": h.token_ids, "score": h.score, "logprob": h.logprob,
              "finish_reason": h.finish_reason} for h in hypotheses]
    click.echo(json.dumps({
        "text": beams[0]["text"], "finish_reason": best.finish_reason, "prompt_tokens": len(ids),
        "completion_tokens": len(best.token_ids), "token_ids": best.token_ids, "score": best.score, "beams": beams,
        "num_beams": params.num_beams, "elapsed_ms": round(elapsed * 1e3, 2),
        "kv_slots_copied": search.copied_slots, "kv_slots_gather_would_copy": search.gather_slots,
    }, ensure_ascii=False))


def _run(engine, ids: list[int], params, as_json: bool, drafter, thinking=None) -> None:
    """Generate and print. ``thinking`` (--chat with a thinking template, runtime/reasoning.py):
    the reasoning goes to stderr as it streams, the answer to stdout; --json has both apart."""
    from llmx.runtime.generate import generate as run
    from llmx.runtime.reasoning import ReasoningParser, split_reasoning

    start = time.perf_counter()
    first: list[float] = []
    parser = ReasoningParser(thinking) if thinking else None

    def show(reasoning: str, content: str) -> None:
        if reasoning:
            sys.stderr.write(reasoning)
            sys.stderr.flush()
        if content:
            sys.stdout.write(content)
            sys.stdout.flush()

    def on_event(event):
        if not first:
            first.append(time.perf_counter())
        if not as_json and event[1]:
            if parser:
                show(*parser.feed(event[1]))
            else:
                show("", event[1])

    seq = run(engine.backend, engine.tokenizer, [ids], params, on_event=on_event, drafter=drafter)[0]
    if parser and not as_json:
        show(*parser.finish())
    elapsed = time.perf_counter() - start
    n = len(seq.output_ids)
    ttft = first[0] - start if first else elapsed
    decode_rate = (n - 1) / (elapsed - ttft) if n > 1 and elapsed > ttft else 0.0
    spec = {"method": drafter.name, "num_draft_tokens": drafter.num_tokens, **drafter.stats.summary()} if drafter else None
    if not as_json:
        sys.stdout.write("\n")
        extra = (f", speculative {spec['method']}: {spec['accepted']}/{spec['drafted']} drafts accepted "
                 f"({spec['acceptance_rate']:.0%}), {spec['tokens_per_step']:.2f} tokens/step") if spec else ""
        click.echo(f"[{n} tokens, finish_reason={seq.finish_reason}, TTFT {ttft * 1e3:.0f} ms, {decode_rate:.1f} tok/s{extra}]",
                   err=True)
        return
    reasoning, text = split_reasoning(thinking, seq.text) if thinking else (None, seq.text)
    result = {
        "text": text,
        **({"reasoning_content": reasoning} if thinking else {}),
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(ids),
        "completion_tokens": n,
        "token_ids": seq.output_ids,
        "ttft_ms": round(ttft * 1e3, 2),
        "decode_tokens_per_s": round(decode_rate, 2),
    }
    if spec:
        result["speculative"] = spec
    if params.logprobs is not None:
        result["logprobs"] = [
            {"token": lp.text, "token_id": lp.token_id, "logprob": lp.logprob,
             "top_logprobs": [{"token": t, "token_id": i, "logprob": v} for i, t, v in lp.top]}
            for lp in seq.logprobs
        ]
    click.echo(json.dumps(result, ensure_ascii=False))
