"""Exported graphs on ONNX Runtime against transformers, for every supported family.

The reference is transformers' own model loaded from the same checkpoint directory: prefill
logits and 16 decode steps within 1e-4, greedy continuations identical to ``generate``, and
padded batches identical to prompts run alone.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from conftest import FAMILY_VARIANTS, VARIANTS
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams

TOL = 1e-4
PROMPTS = ["def fibonacci(n):\n    ", "import json", "class Wrapper(object):\n    def __init__(self, width"]


@pytest.fixture(scope="module")
def engines(store):
    cache = {}

    def get(variant: str) -> Engine:
        if variant not in cache:
            cache[variant] = Engine.load(store.artifact(variant), threads=1)
        return cache[variant]

    return get


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_16_decode_steps_match_transformers(variant, engines, reference):
    engine, model = engines(variant), reference(variant)
    prompt = engine.encode(PROMPTS[2])
    backend = engine.backend
    cache = backend.new_cache(1, len(prompt) + 16)
    ours = [backend.prefill(cache, [0], [prompt])[0].copy()]
    tokens = list(prompt)
    for _ in range(16):
        tokens.append(int(np.argmax(ours[-1])))
        ours.append(backend.decode(cache, np.array([[tokens[-1]]]))[0, 0].copy())
    ref = hf_logits(model, tokens)[len(prompt) - 1 :]
    diff = np.abs(np.stack(ours) - ref).max()
    assert diff <= TOL, f"{variant}: max |diff| {diff:.2e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_32_tokens_identical_to_transformers_generate(variant, engines, reference):
    engine, model = engines(variant), reference(variant)
    for text in PROMPTS[:2]:
        ids = engine.encode(text)
        ours = engine.generate([text], SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True))[0]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours.output_ids == ref[0, len(ids):].tolist()
        assert ours.finish_reason == "length"


@pytest.mark.parametrize("variant", ["llama", "mistral", "gpt2", *FAMILY_VARIANTS])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch_of_three_equals_each_prompt_alone(variant, padding, engines):
    engine = engines(variant)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    alone = [engine.generate([p], params)[0].output_ids for p in PROMPTS]
    batch = engine.generate(PROMPTS, params, padding=padding)
    assert [s.output_ids for s in batch] == alone
    assert len({len(engine.encode(p)) for p in PROMPTS}) == 3  # the batch really is padded


def test_multi_token_decode_matches_one_at_a_time(engines):
    """Decode with T=3 new tokens (speculative verification, chunked prefill) equals 3 single steps."""
    backend = engines("llama").backend
    prompt = engines("llama").encode(PROMPTS[0])
    extra = np.array([[5, 17, 42]])
    one = backend.new_cache(1, 64)
    backend.prefill(one, [0], [prompt])
    singles = [backend.decode(one, extra[:, i : i + 1])[0, 0].copy() for i in range(3)]
    many = backend.new_cache(1, 64)
    backend.prefill(many, [0], [prompt])
    together = backend.decode(many, extra)[0].copy()
    assert np.abs(np.stack(singles) - together).max() <= TOL
    for a, b in zip(one.buffers, many.buffers):
        np.testing.assert_allclose(a[0, :, : len(prompt) + 3], b[0, :, : len(prompt) + 3], atol=1e-5)


def test_an_ended_cache_is_freed_and_the_next_one_is_bound_afresh(engines):
    """The decode binding names its cache without keeping it alive: a finished batch's KV buffers
    are freed at once, and a new cache (likely at the freed addresses) gets its own binding."""
    engine = engines("llama")
    backend, prompt = engine.backend, engine.encode(PROMPTS[1])

    def greedy(cache) -> list[int]:
        tokens = [int(backend.prefill(cache, [0], [prompt])[0].argmax())]
        for _ in range(4):
            tokens.append(int(backend.decode(cache, np.array([[tokens[-1]]]))[0, 0].argmax()))
        return tokens

    first = backend.new_cache(1, 32)
    expected = greedy(first)
    buffer = weakref.ref(first.buffers[0])
    del first
    gc.collect()
    assert buffer() is None
    for _ in range(3):
        assert greedy(backend.new_cache(1, 32)) == expected


def test_sliding_window_is_active_in_mistral(engines, reference):
    """Past the window, Mistral's logits differ from full attention: the window is really applied."""
    engine, model = engines("mistral"), reference("mistral")
    assert engine.manifest.model.sliding_window == 16
    ids = engine.encode(PROMPTS[2] * 2)
    assert len(ids) > 16
    cache = engine.backend.new_cache(1, len(ids))
    ours = engine.backend.prefill(cache, [0], [ids])[0]
    np.testing.assert_allclose(ours, hf_logits(model, ids)[-1], atol=TOL)
    model.config.sliding_window = None
    try:
        full = hf_logits(model, ids)[-1]
    finally:
        model.config.sliding_window = 16
    assert np.abs(ours - full).max() > 1e-3
