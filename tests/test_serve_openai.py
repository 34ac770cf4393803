"""The real server on a loopback port, driven by the official ``openai`` client.

Tables of requests, as llama.cpp's server tests have: every answer must equal what the plain
generation loop (and ``llmx generate``) gives for the same settings, streamed or not, alone
or sharing the batch with other requests.
"""

from __future__ import annotations

import json
import threading

import openai
import pytest
import requests

from live_server import LiveServer, slow_engine
from llmx.runtime.chat import render_chat
from llmx.runtime.generate import generate
from llmx.runtime.sampling import SamplingParams

EXTENSIONS = ("top_k", "min_p", "typical_p", "repetition_penalty", "ignore_eos")


@pytest.fixture(scope="module")
def server(llama_artifact):
    with LiveServer(artifact=llama_artifact, threads=1, max_batch=4, max_queue=16) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.client(max_retries=0, timeout=60)


def reference(engine, prompt: str, chat: bool = False, **params):
    """What the generation loop alone makes of this prompt (chat: one user message)."""
    text = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt
    ids = engine.tokenizer.encode(text, add_special_tokens=not chat)
    return generate(engine.backend, engine.tokenizer, [ids], SamplingParams(**params))[0]


def request_args(params: dict) -> dict:
    """SamplingParams fields as openai-client arguments (llmx's extensions go in extra_body)."""
    args = {"max_tokens": params["max_new_tokens"]}
    extra = {k: v for k, v in params.items() if k in EXTENSIONS}
    args.update({k: v for k, v in params.items() if k not in EXTENSIONS and k != "max_new_tokens"})
    return {**args, "extra_body": extra} if extra else args


CASES = {
    "greedy": dict(max_new_tokens=16, temperature=0),
    "seeded-top-p": dict(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7),
    "top-k-min-p-penalties": dict(max_new_tokens=20, temperature=1.0, top_k=20, min_p=0.05, seed=3,
                                  presence_penalty=0.5, frequency_penalty=0.3),
    "repetition-penalty": dict(max_new_tokens=20, temperature=0.7, seed=11, repetition_penalty=1.3),
    "until-eos-or-length": dict(max_new_tokens=64, temperature=1.0, seed=5),
}


def stream_text(chunks, chat: bool) -> tuple[str, str | None, list]:
    text, finish, seen = "", None, []
    for chunk in chunks:
        seen.append(chunk)
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            finish = c.finish_reason or finish
    return text, finish, seen


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_equals_generate(client, llama_engine, case, stream):
    params, prompt = CASES[case], "def fibonacci(n):"
    ref = reference(llama_engine, prompt, **params)
    if stream:
        chunks = client.completions.create(model="llama", prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **request_args(params))
        text, finish, seen = stream_text(chunks, chat=False)
        usage = seen[-1].usage
    else:
        out = client.completions.create(model="llama", prompt=prompt, **request_args(params))
        text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert (text, finish) == (ref.text, ref.finish_reason)
    assert usage.completion_tokens == len(ref.output_ids)
    assert usage.prompt_tokens == len(llama_engine.encode(prompt))


@pytest.mark.parametrize("case", ["greedy", "seeded-top-p"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_generate_with_chat_template(client, llama_engine, case, stream):
    params = CASES[case]
    ref = reference(llama_engine, "hello there", chat=True, **params)
    messages = [{"role": "user", "content": "hello there"}]
    if stream:
        chunks = client.chat.completions.create(model="llama", messages=messages, stream=True, **request_args(params))
        text, finish, seen = stream_text(chunks, chat=True)
        assert seen[0].choices[0].delta.role == "assistant"
    else:
        out = client.chat.completions.create(model="llama", messages=messages, **request_args(params))
        text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert out.choices[0].message.role == "assistant"
    assert (text, finish) == (ref.text, ref.finish_reason)


def test_answers_equal_the_llmx_generate_command(client, llama_artifact, capsys):
    from llmx.cli import main

    main(["generate", str(llama_artifact), "import json", "--max-new-tokens", "20", "--temperature", "0.9",
          "--top-p", "0.95", "--seed", "42", "--threads", "1", "--json"])
    cli = json.loads(capsys.readouterr().out)
    out = client.completions.create(model="llama", prompt="import json", max_tokens=20, temperature=0.9, top_p=0.95, seed=42)
    assert out.choices[0].text == cli["text"] and out.choices[0].finish_reason == cli["finish_reason"]
    assert out.usage.completion_tokens == cli["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_cuts_the_text_and_says_stop(client, llama_engine, stream):
    full = reference(llama_engine, "def", max_new_tokens=40, temperature=0, ignore_eos=True).text
    stop = full[10:14]
    args = dict(model="llama", prompt="def", max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    if stream:
        text, finish, _ = stream_text(client.completions.create(stream=True, **args), chat=False)
    else:
        out = client.completions.create(**args)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert (text, finish) == (full[: full.index(stop)], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_choices_use_seed_plus_index(client, llama_engine, stream):
    params = dict(max_new_tokens=12, temperature=1.0, seed=100)
    refs = [reference(llama_engine, "x =", **{**params, "seed": 100 + j}) for j in range(3)]
    args = dict(model="llama", prompt="x =", n=3, **request_args(params))
    if stream:
        texts = ["", "", ""]
        for chunk in client.completions.create(stream=True, **args):
            for c in chunk.choices:
                texts[c.index] += c.text
    else:
        out = client.completions.create(**args)
        texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
        assert out.usage.completion_tokens == sum(len(r.output_ids) for r in refs)
    assert texts == [r.text for r in refs]
    assert len(set(texts)) > 1  # different seeds really drew different samples


def test_prompt_list_gives_one_choice_per_prompt(client, llama_engine):
    prompts = ["def", "import os", "class"]
    out = client.completions.create(model="llama", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in out.choices] == [reference(llama_engine, p, max_new_tokens=8, temperature=0).text for p in prompts]
    tokens = client.completions.create(model="llama", prompt=llama_engine.encode("def"), max_tokens=8, temperature=0)
    assert tokens.choices[0].text == out.choices[0].text  # a prompt given as token ids


def test_completion_logprobs_equal_generate(client, llama_engine):
    params = dict(max_new_tokens=10, temperature=0.8, seed=9, logprobs=3)
    ref = reference(llama_engine, "def", **params)
    out = client.completions.create(model="llama", prompt="def", max_tokens=10, temperature=0.8, seed=9, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.tokens == [t.text for t in ref.logprobs]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-5)
    # OpenAI's shape is {token text: logprob}: tokens with the same text (byte pieces) share a key.
    assert lp.top_logprobs == [pytest.approx({text: v for _, text, v in t.top}, abs=1e-5) for t in ref.logprobs]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_equal_generate(client, llama_engine, stream):
    ref = reference(llama_engine, "hi", chat=True, max_new_tokens=8, temperature=0, logprobs=2)
    args = dict(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
                logprobs=True, top_logprobs=2)
    if stream:
        content = [e for chunk in client.chat.completions.create(stream=True, **args)
                   for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    else:
        content = client.chat.completions.create(**args).choices[0].logprobs.content
    assert [e.token for e in content] == [t.text for t in ref.logprobs]
    assert [e.logprob for e in content] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)


def test_stream_chunks_share_id_and_end_with_finish_usage_and_done(server):
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    raw = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in raw.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and raw.text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({(c["id"], c["created"], c["object"]) for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


def test_concurrent_requests_each_equal_their_solo_result(server, client, llama_engine):
    jobs = [(p, dict(max_new_tokens=24 + 4 * i, temperature=0.9, seed=i, ignore_eos=True))
            for i, p in enumerate(["def", "import", "class A", "x = 1", "for i in", "while"])]
    before = server.metric("llmx_decode_batch_size_count"), server.metric("llmx_decode_batch_size_bucket", 'le="1.0"')
    results: dict[int, str] = {}

    def ask(i):
        prompt, params = jobs[i]
        stream = client.completions.create(model="llama", prompt=prompt, stream=True, **request_args(params))
        results[i] = stream_text(stream, chat=False)[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results.get(i) for i in range(len(jobs))] == [reference(llama_engine, p, **kw).text for p, kw in jobs]
    steps = server.metric("llmx_decode_batch_size_count") - before[0]
    solo = server.metric("llmx_decode_batch_size_bucket", 'le="1.0"') - before[1]
    assert solo < steps, "the concurrent requests never shared a decode step"


def test_models_health_ready_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["llama"]
    assert requests.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    ready = requests.get(server.url + "/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    text = requests.get(server.url + "/metrics", timeout=10).text
    for name in ("llmx_requests_total", "llmx_queue_depth", "llmx_running_sequences", "llmx_time_to_first_token_seconds_bucket",
                 "llmx_inter_token_latency_seconds_bucket", "llmx_prompt_tokens_total", "llmx_generation_tokens_total"):
        assert name in text, name
    assert server.metric("llmx_requests_total", 'endpoint="/v1/completions",status="200"') > 0


@pytest.mark.parametrize(
    "args, error, message",
    [
        (dict(prompt="def " * 300, max_tokens=4), openai.BadRequestError, "maximum context length is 256"),
        (dict(prompt="def", max_tokens=1000), openai.BadRequestError, "maximum context length is 256"),
        (dict(prompt="def", temperature=5), openai.BadRequestError, "'temperature' must be a number in [0, 2]"),
        (dict(prompt="def", extra_body={"top_k": "many"}), openai.BadRequestError, "'top_k' must be an integer"),
        (dict(prompt="def", extra_body={"bogus": 1}), openai.BadRequestError, "Unrecognized request argument supplied: bogus"),
        (dict(prompt="def", model="gpt-4"), openai.NotFoundError, "does not exist"),
        (dict(prompt=[1, 2, 10**6]), openai.BadRequestError, "token ids in [0, "),
        (dict(prompt="def", echo=True), openai.BadRequestError, "'echo' is not supported"),
    ],
    ids=["prompt-too-long", "max-tokens-too-large", "temperature-range", "wrong-type", "unknown-field", "wrong-model",
         "token-out-of-vocab", "unsupported-echo"],
)
def test_bad_requests_get_openai_errors(client, args, error, message):
    with pytest.raises(error) as info:
        client.completions.create(**{"model": "llama", **args})
    assert message in info.value.body["message"] and set(info.value.body) == {"message", "type", "param", "code"}


def test_chat_without_template_is_a_clear_400(llama_artifact):
    engine = slow_engine(llama_artifact, 0)
    engine.tokenizer.chat_template = None
    with LiveServer(engine=engine) as live:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            live.client(max_retries=0).chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}])


def test_api_key_is_enforced_on_the_api_only(llama_artifact):
    with LiveServer(engine=slow_engine(llama_artifact, 0), api_key="sekret") as live:
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong", max_retries=0).models.list()
        no_key = requests.post(live.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
        out = live.client(api_key="sekret").completions.create(model="llama", prompt="def", max_tokens=3)
        assert out.usage.completion_tokens <= 3
        assert requests.get(live.url + "/health", timeout=10).status_code == 200


def test_overload_answers_429_with_retry_after_which_the_client_honours(llama_artifact):
    with LiveServer(engine=slow_engine(llama_artifact, 0.01), max_batch=1, max_queue=0) as live:
        long = live.client(max_retries=0).completions.create(model="llama", prompt="def", max_tokens=150, stream=True,
                                                            extra_body={"ignore_eos": True})
        next(iter(long))  # holds the only row for ~1.5 s
        raw = requests.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert raw.status_code == 429 and raw.headers["Retry-After"] == "1"
        assert raw.json()["error"]["type"] == "rate_limit_error"
        patient = live.client(max_retries=4)  # waits Retry-After between tries
        out = patient.completions.create(model="llama", prompt="x", max_tokens=2, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")
        assert live.metric("llmx_requests_total", 'endpoint="/v1/completions",status="429"') >= 2
        long.close()


def test_null_means_default_as_in_openai(server):
    nulls = dict.fromkeys(["temperature", "top_p", "stop", "seed", "n", "stream", "logprobs", "stream_options",
                           "presence_penalty", "frequency_penalty", "logit_bias", "echo", "top_k", "min_p"])
    body = {"model": "llama", "prompt": "def", "max_tokens": 3, "user": "someone", **nulls}
    out = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] <= 3 and len(out.json()["choices"]) == 1
