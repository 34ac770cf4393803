"""What a JSON schema costs per token: decode tok/s unconstrained vs constrained, side by side.

    python benchmarks/constraint_cost.py             # batch 1 and 8, 5 rounds, + the engine comparison
    python benchmarks/constraint_cost.py --quick     # 2 rounds, fewer tokens

Decode: the demo model (llmx/demo_model, vocab 4096), greedy, ``max_new_tokens`` tokens per row
through ``runtime.generate`` (the loop ``llmx generate`` and the server share), with
``ignore_eos`` and a schema that never closes before max tokens (an array of many small
objects), so both arms decode the same number of tokens. Arms alternate round by round; the
table reports medians. Constrained decoding runs twice: masks computed as each row samples
(inline) and beside the model step (overlap; runtime/batch.py picks by the step's time). "mask"
is the inline arm's time inside ``Matcher.mask_logits`` (compute the mask, apply it) per token.

Engines: per-token mask time of llguidance vs xgrammar for the same schemas, over the token
sequence of a valid document (teacher-forced), on the demo tokenizer (4096) and on a
49152-entry byte-level BPE (SmolLM-135M's vocabulary size, benchmarks/smollm_shape.py).
xgrammar needs torch; it is measured when importable (``PYTHONPATH`` to a throwaway install).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Never closes within the token budget: both arms decode exactly max_new_tokens.
LONG_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8},
                                     "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]}},
    "required": ["id", "name", "ok", "kind"], "additionalProperties": False}, "minItems": 100}}, "required": ["rows"],
    "additionalProperties": False}
SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                                 "email": {"type": "string", "format": "email"}},
                "required": ["name", "age", "email"], "additionalProperties": False},
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    "rows": ({**LONG_SCHEMA, "properties": {"rows": {**LONG_SCHEMA["properties"]["rows"], "minItems": 1}}},
             {"rows": [{"id": i, "name": f"n{i}", "ok": i % 2 == 0, "kind": "abc"[i % 3]} for i in range(12)]}),
}


def demo_artifact(work: Path) -> Path:
    from llmx.export import export_checkpoint

    out = work / "demo"
    if not out.exists():
        export_checkpoint(ROOT / "llmx" / "demo_model", out)
    return out


class MaskTimer:
    """Wraps Matcher.mask_logits (compute the mask, apply it to a row) and prefetch waits to count
    the time spent on masks in the loop."""

    def __init__(self):
        from llmx.runtime import batch, constraints

        self.seconds, self.calls = 0.0, 0
        self._mask, self._prefetch = constraints.Matcher.mask_logits, batch.prefetch_masks
        timer = self

        def mask(matcher, logits):
            t = time.perf_counter()
            try:
                return timer._mask(matcher, logits)
            finally:
                timer.seconds += time.perf_counter() - t
                timer.calls += 1

        class Timed:
            def __init__(self, future):
                self.future = future

            def result(self):
                t = time.perf_counter()
                self.future.result()
                timer.seconds += time.perf_counter() - t

        def prefetch(matchers):
            future = timer._prefetch(matchers)
            return None if future is None else Timed(future)

        constraints.Matcher.mask_logits, batch.prefetch_masks = mask, prefetch

    def close(self) -> None:
        from llmx.runtime import batch, constraints

        constraints.Matcher.mask_logits, batch.prefetch_masks = self._mask, self._prefetch


def decode_run(engine, batch: int, tokens: int, constrained: bool) -> tuple[float, float]:
    """(decode tok/s over all rows, mask seconds per constrained token)."""
    from llmx.runtime.constraints import ConstraintSpec, compile_constraint
    from llmx.runtime.generate import generate
    from llmx.runtime.sampling import SamplingParams

    constraint = compile_constraint(ConstraintSpec.json_schema(LONG_SCHEMA), engine.tokenizer,
                                    engine.manifest.model.vocab_size) if constrained else None
    params = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True, constraint=constraint)
    prompts = [engine.tokenizer.encode(f"rows_{i} = ") for i in range(batch)]
    first: list[float] = []
    timer = MaskTimer() if constrained else None
    start = time.perf_counter()
    try:
        seqs = generate(engine.backend, engine.tokenizer, prompts, params,
                        on_event=lambda e: first or first.append(time.perf_counter()))
    finally:
        if timer:
            timer.close()
    end = time.perf_counter()
    produced = sum(len(s.output_ids) for s in seqs)
    assert all(len(s.output_ids) == tokens for s in seqs), [len(s.output_ids) for s in seqs]
    rate = (produced - batch) / (end - first[0])
    return rate, (timer.seconds / produced if timer else 0.0)


def decode_table(engine, rounds: int, tokens: int) -> list[dict]:
    """Three arms per round: unconstrained; constrained with masks computed as each row samples
    (``inline``); constrained with masks computed beside the model step (``overlap``)."""
    from llmx.runtime import batch as batch_module

    default = batch_module.OVERLAP_MIN_STEP_S
    rows = []
    for batch in (1, 8):
        rates = {"plain": [], "inline": [], "overlap": []}
        masks = []
        decode_run(engine, batch, 8, True)  # warm both paths
        decode_run(engine, batch, 8, False)
        try:
            for _ in range(rounds):
                rates["plain"].append(decode_run(engine, batch, tokens, False)[0])
                batch_module.OVERLAP_MIN_STEP_S = float("inf")
                rate, mask = decode_run(engine, batch, tokens, True)
                rates["inline"].append(rate)
                masks.append(mask)
                batch_module.OVERLAP_MIN_STEP_S = 0.0
                rates["overlap"].append(decode_run(engine, batch, tokens, True)[0])
        finally:
            batch_module.OVERLAP_MIN_STEP_S = default
        p, i, o = (statistics.median(rates[k]) for k in ("plain", "inline", "overlap"))
        rows.append({"batch": batch, "tokens_per_row": tokens, "unconstrained_tok_s": round(p, 1),
                     "json_schema_inline_tok_s": round(i, 1), "json_schema_overlap_tok_s": round(o, 1),
                     "slowdown_inline_pct": round(100 * (1 - i / p), 1), "slowdown_overlap_pct": round(100 * (1 - o / p), 1),
                     "mask_us_per_token": round(1e6 * statistics.median(masks), 1), "rounds": rounds,
                     "all_tok_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()}})
    return rows


# -- llguidance vs xgrammar, mask time per token -------------------------------------------------

def vocabularies(work: Path) -> dict[str, Path]:
    from smollm_shape import write_tokenizer

    big = work / "bpe49152"
    if not (big / "tokenizer.json").exists():
        big.mkdir(parents=True, exist_ok=True)
        write_tokenizer(big, 49152)
    return {"demo (4096)": ROOT / "llmx" / "demo_model" / "tokenizer.json", "bpe (49152)": big / "tokenizer.json"}


def forced_tokens(tokenizer_json: Path, document: dict) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).encode(json.dumps(document, separators=(",", ":")),
                                                           add_special_tokens=False).ids


def llguidance_mask_us(tokenizer_json: Path, schema: dict, tokens: list[int], repeats: int) -> tuple[float, float]:
    """(median mask time per token in us, schema -> first mask in ms)."""
    import llguidance as llg
    import llguidance.numpy as lln

    from llmx.runtime.constraints import JSON_DEFAULTS

    tok = llg.LLTokenizer(tokenizer_json.read_text())
    mask = lln.allocate_token_bitmask(1, tok.vocab_size)
    start = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
    lln.fill_next_token_bitmask(llg.LLMatcher(tok, grammar, log_level=0), mask, 0)
    compile_ms = 1e3 * (time.perf_counter() - start)
    times = []
    for _ in range(repeats):
        m = llg.LLMatcher(tok, grammar, log_level=0)
        for t in tokens:
            start = time.perf_counter()
            lln.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - start)
            assert m.consume_token(t), m.get_error()
    return 1e6 * float(np.median(times)), compile_ms


def xgrammar_mask_us(tokenizer_json: Path, schema: dict, tokens: list[int], repeats: int) -> tuple[float, float] | None:
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return None
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
    compile_ms = 1e3 * (time.perf_counter() - start)
    times = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        for t in tokens:
            start = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - start)
            assert m.accept_token(t), (t, tokens)
    return 1e6 * float(np.median(times)), compile_ms


def engine_table(work: Path, repeats: int) -> list[dict]:
    rows = []
    for vocab, path in vocabularies(work).items():
        for name, (schema, document) in SCHEMAS.items():
            tokens = forced_tokens(path, document)
            xg = xgrammar_mask_us(path, schema, tokens, repeats)
            llg_us, llg_ms = llguidance_mask_us(path, schema, tokens, repeats)
            rows.append({"vocab": vocab, "schema": name, "tokens": len(tokens),
                         "llguidance_mask_us": round(llg_us, 1), "llguidance_compile_ms": round(llg_ms, 2),
                         "xgrammar_mask_us": None if xg is None else round(xg[0], 1),
                         "xgrammar_compile_ms": None if xg is None else round(xg[1], 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds, 48 tokens per row")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "llmx-constraint-bench")
    ap.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/constraint_cost_<time>.json")
    args = ap.parse_args()
    rounds, tokens = (2, 48) if args.quick else (args.rounds, args.tokens)

    from llmx.runtime.engine import Engine

    engines = engine_table(args.work, 1 if args.quick else 3)
    engine = Engine.load(demo_artifact(args.work), threads=args.threads)
    decode = decode_table(engine, rounds, tokens)
    print(f"{'batch':>5} {'plain tok/s':>12} {'inline tok/s':>13} {'overlap tok/s':>14} {'slowdown':>16} {'mask us/token':>14}")
    for r in decode:
        print(f"{r['batch']:>5} {r['unconstrained_tok_s']:>12} {r['json_schema_inline_tok_s']:>13} "
              f"{r['json_schema_overlap_tok_s']:>14} {r['slowdown_inline_pct']:>6}% / {r['slowdown_overlap_pct']:>5}% "
              f"{r['mask_us_per_token']:>14}")
    print(f"\n{'vocab':<12} {'schema':<8} {'tokens':>6} {'mask us: llguidance':>20} {'xgrammar':>9} "
          f"{'compile ms: llguidance':>23} {'xgrammar':>9}")
    for r in engines:
        print(f"{r['vocab']:<12} {r['schema']:<8} {r['tokens']:>6} {r['llguidance_mask_us']:>20} {str(r['xgrammar_mask_us']):>9} "
              f"{r['llguidance_compile_ms']:>23} {str(r['xgrammar_compile_ms']):>9}")
    from importlib import metadata

    versions = {}
    for package in ("llguidance", "xgrammar"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    out = args.json or ROOT / "benchmarks" / "results" / f"constraint_cost_{dt.datetime.now(dt.timezone.utc):%Y-%m-%d_%H%M}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"decode": decode, "mask_engines": engines, "versions": versions, "threads": args.threads,
                               "quick": args.quick}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
