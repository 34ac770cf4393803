"""The generation loop: prefill a batch of prompts, then decode until every sequence stops.

    prompts -> Sequences -> Batch.admit (prefill, first token) -> Batch.step ... -> results

``on_event`` sees each (sequence, visible text) as it is produced, which is how the CLI
streams. Each sequence samples with its own seeded generator, so results do not depend on
which other prompts share the batch.
"""

from __future__ import annotations

from typing import Callable

from llmx.errors import InputError
from llmx.runtime.batch import Batch, Event
from llmx.runtime.params import prompt_room
from llmx.runtime.sampling import SamplingParams
from llmx.runtime.sequence import Sequence
from llmx.runtime.speculative import SpeculativeBatch


def check_prompt(n_tokens: int, max_len: int) -> None:
    prompt_room(n_tokens, max_len)


def generate(
    backend,
    tokenizer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    padding: str = "right",
    on_event: Callable[[Event], None] | None = None,
    drafter=None,
) -> list[Sequence]:
    """Generate for a batch of tokenized prompts; returns the finished Sequences in order.

    With a ``drafter`` (runtime/drafters.py) each step verifies drafted tokens (speculative
    decoding): greedy output is identical, sampled output has the same distribution."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise InputError("need one SamplingParams per prompt")
    max_len = backend.max_seq_len
    for prompt, p in zip(prompts, params):
        p.validate()
        check_prompt(len(prompt), max_len)
    capacity = min(max_len, max(len(pr) + p.max_new_tokens for pr, p in zip(prompts, params)))
    if drafter is None:
        batch = Batch(backend, rows=len(prompts), capacity=capacity)
    else:
        batch = SpeculativeBatch(backend, rows=len(prompts), capacity=capacity, drafter=drafter)
    seqs = [Sequence(pr, p, tokenizer, max_len) for pr, p in zip(prompts, params)]
    emit = on_event or (lambda event: None)
    for event in batch.admit(seqs, padding):
        emit(event)
    while batch.active:
        for event in batch.step():
            emit(event)
    return seqs
