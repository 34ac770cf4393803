"""One benchmark peer in its own process: load it, generate greedily, print one JSON report.

    python benchmarks/engines.py ENGINE MODEL --prompt FILE --new-tokens 128 --repeat 3 [--contexts 64,...]

ENGINE is ``genai`` (onnxruntime-genai), ``transformers`` (eager PyTorch) or ``llamacpp``
(llama-cpp-python). Every engine gets the same prompt token ids (from FILE), decodes greedily
and ignores EOS, and is timed the way ``llmx bench`` times llmx: TTFT = prompt in, first token
out; each later token is one step. Runs under whichever venv has the engine installed (the
peers live in their own venv so that onnxruntime-genai's pinned onnxruntime never meets llmx's).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np


class GenAI:
    def __init__(self, model: str, threads: int | None):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model)
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)

    def _generator(self, length: int):
        params = self.og.GeneratorParams(self.model)
        # min_length keeps EOS from ending the run early: every engine makes exactly the same count.
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=1)
        return self.og.Generator(self.model, params)

    def generate(self, prompt: list[int], new_tokens: int):
        gen = self._generator(len(prompt) + new_tokens)
        start = time.perf_counter()
        gen.append_tokens(np.asarray([prompt], dtype=np.int32))
        gen.generate_next_token()
        ttft = time.perf_counter() - start
        steps = []
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            gen.generate_next_token()
            steps.append(time.perf_counter() - t0)
        return ttft, steps, [int(t) for t in gen.get_sequence(0)[len(prompt):]]


class Transformers:
    def __init__(self, model: str, threads: int | None):
        import torch
        import transformers

        self.torch = torch
        if threads:
            torch.set_num_threads(threads)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager").eval()

    def generate(self, prompt: list[int], new_tokens: int):
        torch = self.torch
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            token = int(out.logits[0, -1].argmax())
            ttft = time.perf_counter() - start
            tokens, steps, past = [token], [], out.past_key_values
            for _ in range(new_tokens - 1):
                t0 = time.perf_counter()
                out = self.model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                token, past = int(out.logits[0, -1].argmax()), out.past_key_values
                steps.append(time.perf_counter() - t0)
                tokens.append(token)
        return ttft, steps, tokens


class LlamaCpp:
    def __init__(self, model: str, threads: int | None):
        import llama_cpp

        kwargs = {"n_threads": threads, "n_threads_batch": threads} if threads else {}
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=512, verbose=False, **kwargs)

    def generate(self, prompt: list[int], new_tokens: int):
        self.llm.reset()
        tokens, steps = [], []
        start = last = time.perf_counter()
        ttft = 0.0
        for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            now = time.perf_counter()
            if not tokens:
                ttft = now - start
            else:
                steps.append(now - last)
            last = now
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return ttft, steps, tokens


ENGINES = {"genai": GenAI, "transformers": Transformers, "llamacpp": LlamaCpp}


def summarize(runs: list[tuple[float, list[float], list[int]]], prompt_len: int) -> dict:
    per_run = [{"ttft_ms": t * 1e3, "tpot_ms": float(np.mean(s)) * 1e3, "decode_tokens_per_s": len(s) / sum(s)} for t, s, _ in runs]
    steps = np.concatenate([s for _, s, _ in runs]) * 1e3
    med = {k: float(np.median([r[k] for r in per_run])) for k in per_run[0]}
    return {
        **{k: round(v, 4) for k, v in med.items()},
        "tpot_p50_ms": round(float(np.percentile(steps, 50)), 4),
        "tpot_p90_ms": round(float(np.percentile(steps, 90)), 4),
        "prefill_tokens_per_s": round(prompt_len / (med["ttft_ms"] / 1e3), 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "runs": per_run,
        "token_ids": runs[0][2],
    }


def step_ms_at(engine, context_prompt: list[int], steps: int = 16) -> float:
    """Median decode step with ``len(context_prompt)`` tokens already in the cache."""
    _, times, _ = engine.generate(context_prompt, steps + 1)
    return round(float(np.median(times[1:])) * 1e3, 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=sorted(ENGINES))
    ap.add_argument("model")
    ap.add_argument("--prompt", required=True, help="JSON file: {'prompt': [...], 'context_prompts': {n: [...]}}")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--contexts", action="store_true", help="also time a decode step at each context prompt")
    args = ap.parse_args()
    prompts = json.load(open(args.prompt))
    t0 = time.perf_counter()
    engine = ENGINES[args.engine](args.model, args.threads)
    load_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        engine.generate(prompts["prompt"], args.new_tokens)
    runs = [engine.generate(prompts["prompt"], args.new_tokens) for _ in range(args.repeat)]
    result = {"engine": args.engine, "threads": args.threads, "load_s": round(load_s, 3),
              **summarize(runs, len(prompts["prompt"]))}
    if args.contexts:
        result["decode_step_ms_by_context"] = {c: step_ms_at(engine, p) for c, p in prompts["context_prompts"].items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
