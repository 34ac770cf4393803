"""Beam search against transformers' own ``generate(num_beams=...)``: the same hypotheses in the
same order with the same ``sequences_scores``, for length penalties of both signs, every
``early_stopping`` mode, and hypotheses that end on an end token (the finished-pool and
early-stop logic), on two families; plus the KV forks copying far less than a gather would."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmx.errors import InputError
from llmx.runtime.beam import BeamParams, BeamSearch
from llmx.runtime.engine import Engine

PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def models(store):
    import transformers

    cache = {}

    def get(variant: str):
        if variant not in cache:
            engine = Engine.load(store.artifact(variant), threads=1)
            hf = transformers.AutoModelForCausalLM.from_pretrained(store.checkpoint(variant)).eval()
            cache[variant] = engine, hf
        return cache[variant]

    return get


def frequent_token(engine) -> int:
    """The token plain beams use most: made an extra end token, so hypotheses finish early."""
    plain = BeamSearch(engine.backend, engine.encode(PROMPT), BeamParams(max_new_tokens=12), []).run()
    tokens, counts = np.unique(np.concatenate([h.token_ids for h in plain]), return_counts=True)
    return int(tokens[np.argmax(counts)])


def transformers_beams(hf, ids: list[int], params: BeamParams, end_ids: list[int]) -> list[tuple[list[int], float]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, num_beams=params.num_beams,
                          num_return_sequences=params.num_beams, length_penalty=params.length_penalty,
                          early_stopping=params.early_stopping, max_new_tokens=params.max_new_tokens,
                          eos_token_id=end_ids, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    beams = []
    for i in range(params.num_beams):
        n = int((out.beam_indices[i] >= 0).sum())  # generated length (the rest is padding)
        beams.append((out.sequences[i, len(ids) : len(ids) + n].tolist(), float(out.sequences_scores[i])))
    return beams


CASES = {
    "4-beams": dict(num_beams=4, length_penalty=1.0, early_stopping=False),
    "3-beams-long-early": dict(num_beams=3, length_penalty=2.0, early_stopping=True),
    "4-beams-short-never": dict(num_beams=4, length_penalty=-0.5, early_stopping="never"),
    "4-beams-ending": dict(num_beams=4, length_penalty=1.0, early_stopping=False, end="wins"),
    "5-beams-ending-early": dict(num_beams=5, length_penalty=0.5, early_stopping=True, end="wins"),
    # Finished hypotheses enter the pool, but a strong length bonus lets longer beams beat them.
    "3-beams-ending-never": dict(num_beams=3, length_penalty=1.5, early_stopping="never", end="offered"),
}


@pytest.mark.parametrize("variant", ["llama", "gpt2"])
@pytest.mark.parametrize("case", CASES)
def test_beams_and_scores_equal_transformers(models, variant, case):
    engine, hf = models(variant)
    options = dict(CASES[case])
    end = options.pop("end", None)
    extra = [frequent_token(engine)] if end else []
    params = BeamParams(max_new_tokens=12, stop_token_ids=extra, **options)
    ids = engine.encode(PROMPT)
    search = BeamSearch(engine.backend, ids, params, engine.tokenizer.eos_token_ids)
    ours = search.run()
    ref = transformers_beams(hf, ids, params, engine.tokenizer.eos_token_ids + extra)
    assert [h.token_ids for h in ours] == [tokens for tokens, _ in ref]
    np.testing.assert_allclose([h.score for h in ours], [score for _, score in ref], rtol=1e-5, atol=1e-5)
    for h in ours:
        assert h.score == pytest.approx(h.logprob / len(h.token_ids) ** params.length_penalty)
        assert h.finish_reason == ("stop" if h.token_ids[-1] in extra else "length")
    if end == "wins":
        assert any(h.finish_reason == "stop" for h in ours)  # the case really exercises finished beams


def test_forks_copy_only_where_beams_differ(models):
    engine, _ = models("llama")
    ids = engine.encode(PROMPT * 3)
    search = BeamSearch(engine.backend, ids, BeamParams(num_beams=4, max_new_tokens=24), engine.tokenizer.eos_token_ids)
    search.run()
    assert search.generated == 24
    # After the first step (which fills rows 1..3 with the prompt) only diverging suffixes move.
    prompt_copies = 3 * len(ids)
    assert search.copied_slots - prompt_copies < 0.1 * (search.gather_slots - 4 * len(ids))


def test_rows_after_forks_hold_each_beams_own_kv(models):
    """Every running beam's row equals a fresh prefill of prompt + that beam's tokens."""
    engine, _ = models("llama")
    backend, ids = engine.backend, engine.encode(PROMPT)
    search = BeamSearch(backend, ids, BeamParams(num_beams=3, max_new_tokens=40, ignore_eos=True), [])
    for _ in range(10):
        search.step()
    for beam in search.beams:
        held = ids + beam.tokens[:-1]  # the last token is fed at the next step
        fresh = backend.new_cache(1, len(held))
        backend.prefill(fresh, [0], [held])
        assert search.cache.lengths[beam.row] == len(held)
        for mine, ref in zip(search.cache.read(beam.row), fresh.read(0)):
            np.testing.assert_allclose(mine, ref, atol=1e-4)


def test_num_return_sequences_keeps_the_best(models):
    engine, _ = models("llama")
    ids = engine.encode(PROMPT)
    every = BeamSearch(engine.backend, ids, BeamParams(num_beams=4, max_new_tokens=8), [2]).run()
    best = BeamSearch(engine.backend, ids, BeamParams(num_beams=4, max_new_tokens=8, num_return_sequences=2), [2]).run()
    assert [h.token_ids for h in best] == [h.token_ids for h in every[:2]]


@pytest.mark.parametrize("bad, message", [
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=65), "num_beams"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
])
def test_bad_beam_parameters_are_refused(bad, message):
    with pytest.raises(InputError, match=message):
        BeamParams(**bad).validate()


def test_cli_generate_with_beams(llama_artifact, models, capsys):
    from llmx.cli import main

    engine, hf = models("llama")
    main(["generate", str(llama_artifact), PROMPT, "--num-beams", "3", "--length-penalty", "0.5", "--early-stopping",
          "--max-new-tokens", "10", "--threads", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    ref = transformers_beams(hf, engine.encode(PROMPT), BeamParams(num_beams=3, length_penalty=0.5, early_stopping=True,
                                                                    max_new_tokens=10), engine.tokenizer.eos_token_ids)
    assert [b["token_ids"] for b in out["beams"]] == [tokens for tokens, _ in ref]
    assert out["token_ids"] == ref[0][0] and out["text"] == engine.tokenizer.decode(ref[0][0])
    assert out["beams"][0]["score"] == pytest.approx(ref[0][1], abs=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--num-beams", "2", "--top-k", "5"], "beam search"),
    (["--num-beams", "2", "--stop", "x"], "'stop' is not supported with beam search"),
    (["--num-beams", "2", "--speculative", "ngram"], "speculative"),
    (["--num-beams", "0"], "num_beams"),
    (["--length-penalty", "2"], "--num-beams"),
    (["--speculative", "draft"], "needs --draft"),
    (["--speculative", "ngram", "--draft", "x"], "--draft is for --speculative draft"),
    (["--draft", "x"], "--draft is for --speculative draft; auto needs no draft model"),
    (["--speculative", "off", "--num-draft-tokens", "3"], "which --speculative off turns off"),
    (["--speculative", "ngram", "--num-draft-tokens", "0"], "draft tokens"),
    (["--speculative", "draft", "--draft", "/nonexistent"], "does not exist"),
])
def test_cli_refuses_decoding_options_it_cannot_honour(llama_artifact, capsys, args, message):
    """Beam search and speculative decoding options: one error line, non-zero exit."""
    from llmx.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", str(llama_artifact), "x", "--threads", "1", *args])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_device_cache_copy_span_moves_only_the_span():
    from fake_gpu import HostDevice

    from llmx.runtime.device_cache import DeviceKVCache

    device = HostDevice()
    cache = DeviceKVCache(device, num_layers=1, kv_heads=2, head_dim=4, rows=2, capacity=8, max_capacity=64)
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=(2, 6, 4)).astype(np.float32) for _ in range(2))
    cache.write(0, [a, a + 1])
    cache.write(1, [b, b + 1])
    cache.copy_span(0, 1, 2, 6)
    got = cache.read(1)
    np.testing.assert_array_equal(got[0][:, :2], b[:, :2])
    np.testing.assert_array_equal(got[0][:, 2:], a[:, 2:])
    np.testing.assert_array_equal(got[1][:, 2:], a[:, 2:] + 1)
    assert cache.lengths[1] == 6


def test_server_beam_search_equals_transformers(llama_artifact, models):
    """vLLM's fields: use_beam_search with best_of beams, the best n returned as choices."""
    from live_server import LiveServer

    engine, hf = models("llama")
    ref = transformers_beams(hf, engine.encode(PROMPT), BeamParams(num_beams=4, length_penalty=0.7, max_new_tokens=10),
                             engine.tokenizer.eos_token_ids)
    with LiveServer(artifact=llama_artifact, threads=1, max_batch=4) as live:
        client = live.client(max_retries=0, timeout=60)
        out = client.completions.create(model="llama", prompt=PROMPT, max_tokens=10, n=2, best_of=4,
                                        extra_body={"use_beam_search": True, "length_penalty": 0.7})
        assert [c.text for c in out.choices] == [engine.tokenizer.decode(t) for t, _ in ref[:2]]
        assert out.usage.completion_tokens == sum(len(t) for t, _ in ref[:2])
        stream = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                                n=3, stream=True, extra_body={"use_beam_search": True})
        texts, finished = ["", "", ""], set()
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finished.add(c.index)
        assert finished == {0, 1, 2} and len(set(texts)) == 3  # three distinct beams
        for body, message in [({"best_of": 2, "n": 1}, "best_of"),  # without use_beam_search
                              ({"use_beam_search": True, "top_k": 5}, "top_k"),
                              ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
                              ({"use_beam_search": True, "n": 5}, "max-batch"),
                              ({"use_beam_search": True, "n": 3, "best_of": 2}, "at least n"),
                              ({"length_penalty": 2.0}, "use_beam_search"),
                              ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping")]:
            with pytest.raises(Exception) as info:
                client.completions.create(model="llama", prompt="x", max_tokens=4, extra_body=body)
            assert info.value.status_code == 400 and message in str(info.value)
