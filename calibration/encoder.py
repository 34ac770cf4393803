"""Calibrating encoder (embedding) artifacts: sentences in, the one ``embed`` graph, a cosine report.

An embedding model sees sentences, not running text, so each non-empty line of ``--data``
(each record of a JSONL file) is one input, tokenized and truncated as the Embedder does.
Calibration runs them one at a time (no padding enters the ranges); the last fifth is held
out. The quality report compares quantized with fp32 embeddings of held-out inputs: mean,
minimum and 5th-percentile cosine similarity, and each graph's size.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.calibration.data import HELD_OUT_FRACTION, Split, TextData, read_text_data, spread
from llmx.compare import cosine
from llmx.errors import InputError
from llmx.runtime.embed import Embedder


def sentence_inputs(tokenizer, data: TextData) -> list[list[int]]:
    lines = [line.strip() for doc in data.documents for line in doc.text.splitlines()]
    return [tokenizer.encode(line) for line in lines if line]


def split_sentences(inputs: list[list[int]], samples: int, eval_samples: int, eval_inputs: list[list[int]] | None,
                    source: str) -> Split:
    if samples < 1 or eval_samples < 1:
        raise InputError("--samples and --eval-samples must be at least 1")
    needed = 1 if eval_inputs is not None else 2
    if len(inputs) < needed:
        raise InputError(f"{source} gives {len(inputs)} sentence(s); need at least {needed} (one per non-empty line)")
    if eval_inputs is None:
        held = max(1, round(len(inputs) * HELD_OUT_FRACTION))
        inputs, eval_inputs = inputs[:-held], inputs[-held:]
    longest = max(len(t) for t in inputs)
    return Split(spread(inputs, samples), spread(eval_inputs, eval_samples), longest, len(inputs))


def load_sentences(source: Artifact, data, eval_data, options) -> tuple[Split, dict]:
    tokenizer = Embedder(source, threads=1).tokenizer  # truncates like the runtime does
    text = read_text_data(data)
    record = {"source": str(data), "sha256": text.sha256, "unit": "sentence"}
    held_out = None
    if eval_data is not None:
        eval_text = read_text_data(eval_data)
        held_out = sentence_inputs(tokenizer, eval_text)
        record.update(eval_source=str(eval_data), eval_sha256=eval_text.sha256)
    split = split_sentences(sentence_inputs(tokenizer, text), options.samples, options.eval_samples, held_out, str(data))
    record.update(sentences=len(split.calibration))
    return split, record


class EncoderFeeds:
    """Calibration inputs of the ``embed`` graph, one sentence per run."""

    def __init__(self, inputs: list[list[int]]):
        self.inputs = inputs

    def count(self, graph: str) -> int:
        return len(self.inputs)

    def __call__(self, graph: str) -> Iterator[dict[str, np.ndarray]]:
        for ids in self.inputs:
            batch = np.asarray([ids], dtype=np.int64)
            yield {"input_ids": batch, "attention_mask": np.ones_like(batch), "token_type_ids": np.zeros_like(batch)}


def measure_embeddings(reference: Artifact, candidate: Artifact, inputs: list[list[int]], threads: int | None = None,
                       progress: Callable[[int], None] = lambda n: None) -> dict:
    ref = Embedder(reference, threads=threads).embed_ids(inputs).vectors
    got = Embedder(candidate, threads=threads).embed_ids(inputs).vectors
    progress(len(inputs))
    cos = cosine(ref, got)
    return {
        "kind": "encoder",
        "fp32": {"graph_bytes": reference.graph_bytes()},
        "quantized": {"graph_bytes": candidate.graph_bytes()},
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "cosine_p5": float(np.percentile(cos, 5)),
        "inputs": len(inputs),
    }
