"""/v1/embeddings through a real socket and the official openai client; endpoint/kind mismatches."""

from __future__ import annotations

import base64
import threading
import time

import numpy as np
import pytest
import requests

from live_server import LiveServer
from llmx.runtime.embed import Embedder
from sentences import SENTENCES

TEXTS = SENTENCES[:12]


@pytest.fixture(scope="module")
def emb_server(minilm_artifact):
    with LiveServer(artifact=str(minilm_artifact), threads=1) as server:
        yield server


@pytest.fixture(scope="module")
def local_vectors(minilm_artifact):
    return Embedder.load(minilm_artifact, threads=1).embed([t for t in TEXTS if t])


def test_openai_client_embeddings_equal_llmx_embed(emb_server, local_vectors):
    texts = [t for t in TEXTS if t]
    client = emb_server.client()
    as_float = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    default = client.embeddings.create(model="minilm", input=texts)  # the client asks for base64 and decodes it
    for result in (as_float, default):
        got = np.array([d.embedding for d in sorted(result.data, key=lambda d: d.index)], np.float32)
        np.testing.assert_allclose(got, local_vectors.vectors, atol=1e-6)
        assert result.usage.prompt_tokens == sum(local_vectors.token_counts) == result.usage.total_tokens
    one = client.embeddings.create(model="minilm", input=texts[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, local_vectors.vectors[0], atol=1e-6)


def test_base64_is_little_endian_float32(emb_server, local_vectors):
    body = requests.post(emb_server.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}, timeout=30).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, local_vectors.vectors[0], atol=1e-6)


def test_token_id_inputs(emb_server, local_vectors, minilm_artifact):
    ids = Embedder.load(minilm_artifact, threads=1).tokenizer.encode(TEXTS[1])
    body = requests.post(emb_server.url + "/v1/embeddings", json={"input": [ids]}, timeout=30).json()
    np.testing.assert_allclose(body["data"][0]["embedding"], local_vectors.vectors[1], atol=1e-6)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [[1, 2], "mixed"]}, "input"),
        ({"input": [10**9]}, "input"),
        ({}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 128}, "dimensions"),
        ({"input": "x", "temperature": 0.5}, "temperature"),
        ({"input": ["x"] * 3000}, "input"),
    ],
)
def test_bad_embedding_requests_get_openai_400s(emb_server, body, param):
    r = requests.post(emb_server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_model_is_404(emb_server):
    r = requests.post(emb_server.url + "/v1/embeddings", json={"input": "x", "model": "other"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_encoder_refuses_completions_and_decoder_refuses_embeddings(emb_server, llama_artifact):
    r = requests.post(emb_server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    r = requests.post(emb_server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_endpoint"
    with LiveServer(artifact=str(llama_artifact), threads=1) as decoder:
        r = requests.post(decoder.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]


def test_concurrent_requests_share_forward_passes(minilm_artifact):
    """While one batch runs, waiting requests pile up and go through together."""
    with LiveServer(artifact=str(minilm_artifact), threads=1) as server:
        embedder = server.service.batcher.embedder
        real = embedder.embed_ids

        def slow(ids):
            time.sleep(0.3)
            return real(ids)

        embedder.embed_ids = slow
        results = [None] * 8

        def call(i):
            results[i] = requests.post(server.url + "/v1/embeddings", json={"input": TEXTS[i]}, timeout=60).status_code

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
            time.sleep(0.02)
        for t in threads:
            t.join()
        assert results == [200] * 8
        passes = server.metric("llmx_embedding_batch_size_count")
        assert 1 <= passes < 8  # fewer forward passes than requests
        assert server.metric("llmx_embedding_batch_size_sum") == 8


def test_full_queue_answers_429_with_retry_after(minilm_artifact):
    with LiveServer(artifact=str(minilm_artifact), threads=1, max_queue=1) as server:
        embedder = server.service.batcher.embedder
        gate = threading.Event()
        real = embedder.embed_ids
        embedder.embed_ids = lambda ids: (gate.wait(30), real(ids))[1]
        statuses = []

        def call():
            statuses.append(requests.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=60))

        first = threading.Thread(target=call)
        first.start()
        time.sleep(0.3)  # the worker holds the first request
        second = threading.Thread(target=call)
        second.start()
        time.sleep(0.3)  # the second waits in the queue (size 1)
        third = requests.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
        gate.set()
        first.join()
        second.join()
        assert third.status_code == 429 and third.headers["Retry-After"] == "1"
        assert [r.status_code for r in statuses] == [200, 200]
