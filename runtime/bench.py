"""Measuring generation speed: TTFT, per-token latency, throughput and memory (torch-free).

The measured loop is the runtime's own (``Batch.admit`` then ``Batch.step``: prefill, greedy
choice, detokenization), so the numbers are what ``llmx generate`` and the server get, not a
bare graph call. Prompts are fixed token ids of exactly ``prompt_len`` tokens; EOS is ignored
so every run makes exactly ``new_tokens`` tokens. After ``warmup`` untimed runs, ``repeat``
timed runs each give one value per metric and the report holds their medians.

    TTFT   prefill + first token chosen (what a user waits before the first text)
    TPOT   mean time of one decode step (a token for every row), with p50 and p90 over steps
    decode tokens/s = batch * (new_tokens - 1) / decode time;  prefill tokens/s = batch * prompt_len / TTFT
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from llmx.errors import InputError
from llmx.runtime.batch import Batch
from llmx.runtime.sampling import SamplingParams
from llmx.runtime.sequence import Sequence


@dataclass
class RunTimes:
    ttft_s: float
    steps_s: list[float]  # one entry per decode step after the first token
    token_ids: list[int]  # row 0's output


@dataclass
class BenchResult:
    prompt_len: int
    new_tokens: int
    batch: int
    repeat: int
    ttft_ms: float
    tpot_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_rss_mb: float
    pss_mb: float | None  # memory now, shared file pages counted once (Linux); see pss_mb()
    runs: list[dict]  # per timed run: ttft_ms, tpot_ms, decode_tokens_per_s
    token_ids: list[int]  # what row 0 generated in the last run (to compare engines' outputs)

    def to_dict(self) -> dict:
        return asdict(self)


def prompt_ids(length: int, vocab: int, row: int = 0, first: int = 8) -> list[int]:
    """A fixed, reproducible prompt of exactly ``length`` ids (skipping the low special ids)."""
    rng = np.random.default_rng(1234 + row)
    return rng.integers(first, max(first + 1, vocab), size=length).tolist()


def check_sizes(backend, prompt_len: int, new_tokens: int, batch: int) -> None:
    if prompt_len < 1 or new_tokens < 2 or batch < 1:
        raise InputError("need --prompt-len >= 1, --new-tokens >= 2 and --batch >= 1")
    if prompt_len + new_tokens > backend.max_seq_len:
        raise InputError(
            f"prompt of {prompt_len} + {new_tokens} new tokens exceeds the model's maximum length {backend.max_seq_len}"
        )


def run_once(backend, tokenizer, prompts: list[list[int]], new_tokens: int) -> RunTimes:
    """One greedy generation of ``new_tokens`` per prompt, timed step by step."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    capacity = max(len(p) for p in prompts) + new_tokens
    batch = Batch(backend, rows=len(prompts), capacity=capacity)
    seqs = [Sequence(p, params, tokenizer, backend.max_seq_len) for p in prompts]
    start = time.perf_counter()
    batch.admit(seqs)
    ttft = time.perf_counter() - start
    steps = []
    while batch.active:
        t0 = time.perf_counter()
        batch.step()
        steps.append(time.perf_counter() - t0)
    if any(len(s.output_ids) != new_tokens for s in seqs):
        raise RuntimeError("a benchmark sequence stopped early")  # cannot happen with ignore_eos
    return RunTimes(ttft, steps, seqs[0].output_ids)


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def pss_mb() -> float | None:
    """Proportional set size now (Linux, else None). RSS counts a file page once per mapping, so
    ``--low-memory``'s weights.bin, mapped by both graphs, shows twice in RSS and once here."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024
    except (OSError, StopIteration):
        return None


def bench(backend, tokenizer, prompt_len: int = 128, new_tokens: int = 128, batch: int = 1,
          repeat: int = 3, warmup: int = 1) -> BenchResult:
    """Warm up, then ``repeat`` timed runs; medians of each metric over the runs."""
    check_sizes(backend, prompt_len, new_tokens, batch)
    if repeat < 1 or warmup < 0:
        raise InputError("need --repeat >= 1 and --warmup >= 0")
    vocab = min(int(backend.vocab_size), tokenizer.vocab_size)
    prompts = [prompt_ids(prompt_len, vocab, row) for row in range(batch)]
    for _ in range(warmup):
        run_once(backend, tokenizer, prompts, new_tokens)
    runs = [run_once(backend, tokenizer, prompts, new_tokens) for _ in range(repeat)]
    per_run = [
        {
            "ttft_ms": r.ttft_s * 1e3,
            "tpot_ms": float(np.mean(r.steps_s)) * 1e3,
            "decode_tokens_per_s": batch * len(r.steps_s) / sum(r.steps_s),
        }
        for r in runs
    ]
    all_steps = np.concatenate([r.steps_s for r in runs]) * 1e3
    med = lambda key: float(np.median([r[key] for r in per_run]))  # noqa: E731
    ttft = med("ttft_ms")
    return BenchResult(
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        batch=batch,
        repeat=repeat,
        ttft_ms=round(ttft, 4),
        tpot_ms=round(med("tpot_ms"), 4),
        tpot_p50_ms=round(float(np.percentile(all_steps, 50)), 3),
        tpot_p90_ms=round(float(np.percentile(all_steps, 90)), 3),
        prefill_tokens_per_s=round(batch * prompt_len / (ttft / 1e3), 2),
        decode_tokens_per_s=round(med("decode_tokens_per_s"), 2),
        peak_rss_mb=round(peak_rss_mb(), 1),
        pss_mb=None if (pss := pss_mb()) is None else round(pss, 1),
        runs=[{k: round(v, 4) for k, v in r.items()} for r in per_run],
        token_ids=runs[-1].token_ids,
    )


def decode_step_ms(backend, tokenizer, context: int, steps: int = 16, batch: int = 1) -> float:
    """Median decode step (as in ``bench``: graph call, greedy choice, detokenization) at ``context`` cached tokens."""
    check_sizes(backend, context, steps + 1, batch)
    vocab = min(int(backend.vocab_size), tokenizer.vocab_size)
    prompts = [prompt_ids(context, vocab, row) for row in range(batch)]
    times = run_once(backend, tokenizer, prompts, steps + 1).steps_s
    return float(np.median(times)) * 1e3


def context_sweep(backend, tokenizer, contexts: list[int], steps: int = 16, batch: int = 1) -> dict[int, float]:
    """Decode step time (ms) at each context length; the first is measured twice (warm-up)."""
    if not contexts:
        raise InputError("the context sweep needs at least one context length")
    decode_step_ms(backend, tokenizer, contexts[0], steps, batch)
    return {c: round(decode_step_ms(backend, tokenizer, c, steps, batch), 4) for c in contexts}
