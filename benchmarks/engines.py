"""One benchmark engine in its own process, driven line by line over stdin/stdout.

    python benchmarks/engines.py ENGINE MODEL --prompt FILE [--threads N] [--no-spin] [--low-memory]

ENGINE is ``llmx`` (an llmx artifact, timed with the code ``llmx bench`` runs), ``genai``
(onnxruntime-genai), ``transformers`` (eager PyTorch) or ``llamacpp`` (llama-cpp-python).
The process loads its model, prints ``{"ready": ...}``, then answers one JSON line per command:

    run N       one greedy generation of N tokens: {"ttft_s", "steps_s", "token_ids"}
    sweep N R   per context prompt in FILE: a decode step's median time (ms) over N steps, R passes
    rss         peak resident memory of this process (MB)

Keeping every engine loaded and letting them take turns run by run means that the background
load of a shared machine falls on all of them alike. Every engine gets the same prompt token
ids, decodes greedily, ignores EOS and is timed the same way: TTFT = prompt in, first token
out; each later token is one step. The peers run under their own venv (onnxruntime-genai pins
its own onnxruntime, which must never meet llmx's).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np


class Llmx:
    def __init__(self, model: str, threads: int | None, spin: bool | None, low_memory: bool = False):
        from llmx.runtime.engine import Engine

        options = {} if spin is None else {"spin": spin}
        if low_memory:
            options["low_memory"] = True
        self.engine = Engine.load(model, threads=threads, **options)

    def describe(self) -> str | None:
        """The threads/spinning the backend chose (runtime/cpu_plan.py), for the report."""
        plan = getattr(self.engine.backend, "cpu_plan", None)
        return plan.describe() if plan else None

    def threads(self) -> int | None:
        """The thread count the backend chose (no flag given: decided at start-up)."""
        plan = getattr(self.engine.backend, "cpu_plan", None)
        return plan.threads if plan else None

    def generate(self, prompt: list[int], new_tokens: int):
        from llmx.runtime.bench import run_once

        times = run_once(self.engine.backend, self.engine.tokenizer, [prompt], new_tokens)
        return times.ttft_s, times.steps_s, times.token_ids


class GenAI:
    def __init__(self, model: str, threads: int | None, spin: bool | None):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model)
        if spin is not None:
            raise SystemExit("onnxruntime-genai's config has no spinning switch")
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)

    def generate(self, prompt: list[int], new_tokens: int):
        params = self.og.GeneratorParams(self.model)
        length = len(prompt) + new_tokens
        # min_length keeps EOS from ending the run early: every engine makes exactly the same count.
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=1)
        gen = self.og.Generator(self.model, params)
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
    def __init__(self, model: str, threads: int | None, spin: bool | None):
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
    def __init__(self, model: str, threads: int | None, spin: bool | None):
        import llama_cpp

        kwargs = {"n_threads": threads, "n_threads_batch": threads} if threads else {}
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=512, verbose=False, **kwargs)

    def generate(self, prompt: list[int], new_tokens: int):
        # reset() forgets the previous tokens: otherwise generate() reuses the cached prompt prefix.
        self.llm.reset()
        tokens, steps = [], []
        start = last = time.perf_counter()
        ttft = 0.0
        for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            now = time.perf_counter()
            if tokens:
                steps.append(now - last)
            else:
                ttft = now - start
            last = now
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return ttft, steps, tokens


ENGINES = {"llmx": Llmx, "genai": GenAI, "transformers": Transformers, "llamacpp": LlamaCpp}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pss_mb() -> float | None:
    """Proportional set size now: a file page mapped twice (llmx --low-memory maps weights.bin once
    per graph) or by several processes counts once, where RSS counts it per mapping. The same as
    llmx.runtime.bench.pss_mb, kept here because genai and llama.cpp run this file in the peers'
    venv, which has no llmx."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024
    except (OSError, StopIteration):
        return None


def serve(engine, prompts: dict) -> None:
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "run":
            ttft, steps, tokens = engine.generate(prompts["prompt"], int(rest[0]))
            reply = {"ttft_s": ttft, "steps_s": steps, "token_ids": tokens}
        elif cmd == "sweep":
            # Contexts take turns (R passes) so that a change in background load hits all of them.
            n, passes = int(rest[0]), int(rest[1])
            times: dict[str, list[float]] = {c: [] for c in prompts["context_prompts"]}
            for _ in range(passes):
                for c, p in prompts["context_prompts"].items():
                    times[c].append(float(np.median(engine.generate(p, n + 1)[1])) * 1e3)
            reply = {c: float(np.median(t)) for c, t in times.items()}
        elif cmd == "rss":
            reply = {"peak_rss_mb": peak_rss_mb(), "pss_mb": pss_mb()}
        else:
            reply = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(reply), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=sorted(ENGINES))
    ap.add_argument("model")
    ap.add_argument("--prompt", required=True, help="JSON: {'prompt': [...], 'context_prompts': {n: [...]}}")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--spin", dest="spin", action="store_true", default=None)
    ap.add_argument("--no-spin", dest="spin", action="store_false")
    ap.add_argument("--low-memory", action="store_true", help="llmx only: the backend's low_memory mode")
    args = ap.parse_args()
    prompts = json.load(open(args.prompt))
    t0 = time.perf_counter()
    extra = {"low_memory": True} if args.low_memory else {}
    if extra and args.engine != "llmx":
        sys.exit("--low-memory is an llmx option")
    engine = ENGINES[args.engine](args.model, args.threads, args.spin, **extra)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "rss_after_load_mb": peak_rss_mb(),
                      "plan": getattr(engine, "describe", lambda: None)(),
                      "threads": getattr(engine, "threads", lambda: args.threads)()}), flush=True)
    serve(engine, prompts)


if __name__ == "__main__":
    main()
