"""One set of rules for ``llmx generate`` and the server: the same ranges, the same words, the
same context rule; and exit codes that say whether the command line or the work failed."""

from __future__ import annotations

import re

import pytest

from live_server import slow_engine
from test_cli import run
from llmx.serve import create_app


def last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


@pytest.fixture(scope="module")
def api(llama_artifact):
    app = create_app(engine=slow_engine(llama_artifact, 0))
    service = app.extensions["llmx"]
    assert service.scheduler.ready.wait(60)
    yield app.test_client()
    service.scheduler.stop()


def post(api, **body):
    return api.post("/v1/completions", json={"prompt": "def", "max_tokens": 2, **body})


@pytest.mark.parametrize("cli, field, value, words", [
    (["--temperature", "5"], "temperature", 5, "'temperature' must be a number in [0, 2]"),
    (["--top-p", "0"], "top_p", 0, "'top_p' must be a number in (0, 1]"),
    (["--top-k", "-2"], "top_k", -2, "'top_k' must be an integer >= -1"),
    (["--min-p", "2"], "min_p", 2, "'min_p' must be a number in [0, 1]"),
    (["--presence-penalty", "3"], "presence_penalty", 3, "'presence_penalty' must be a number in [-2, 2]"),
    (["--repetition-penalty", "0"], "repetition_penalty", 0, "'repetition_penalty' must be a number in (0, 10]"),
    (["--logprobs", "21"], "logprobs", 21, "'logprobs' must be an integer in [0, 20]"),
    (["--stop", "z" * 5000], "stop", "z" * 5000, "'stop' must be a string or a list of at most 4 strings, each 1 to 4096"),
    (["--seed", "-1"], "seed", -1, "'seed' must be an integer in [0, 9223372036854775807]"),
])
def test_cli_and_server_refuse_the_same_values_in_the_same_words(llama_artifact, api, capsys, cli, field, value, words):
    code, out, err = run(["generate", str(llama_artifact), "def", *cli], capsys)
    assert code == 2 and out == "" and last_line(err).startswith(f"error: {words}"), err
    answer = post(api, **{field: value})
    assert answer.status_code == 400 and answer.get_json()["error"]["message"].startswith(words)
    assert answer.get_json()["error"]["param"] == field


def test_beam_search_takes_temperature_0_and_refuses_sampling_in_both(llama_artifact, api, capsys):
    args = ["generate", str(llama_artifact), "def", "--num-beams", "2", "--max-new-tokens", "3"]
    code, out, err = run([*args, "--temperature", "0"], capsys)
    assert code == 0 and out.strip(), err
    greedy = post(api, use_beam_search=True, n=2, temperature=0)
    assert greedy.status_code == 200, greedy.get_json()
    words = "'temperature' is not supported with beam search"
    code, _, err = run([*args, "--temperature", "0.5"], capsys)
    assert code == 2 and last_line(err).startswith(f"error: {words}")
    refused = post(api, use_beam_search=True, n=2, temperature=0.5)
    assert refused.status_code == 400 and refused.get_json()["error"]["message"].startswith(words)


def test_a_prompt_must_leave_room_for_one_new_token(llama_artifact, llama_engine, api, capsys):
    limit = llama_engine.max_seq_len
    tok = llama_engine.tokenizer
    text = next(" a" * k for k in range(limit - 8, limit + 8) if len(tok.encode(" a" * k)) == limit)
    words = f"the prompt has {limit} tokens, but this model's maximum context length is {limit} tokens and it must " \
            f"leave room for at least one new token: shorten it to at most {limit - 1} tokens"
    code, _, err = run(["generate", str(llama_artifact), text], capsys)
    assert code == 2 and last_line(err) == f"error: {words}"
    full = api.post("/v1/completions", json={"prompt": [5] * limit})
    assert full.status_code == 400 and full.get_json()["error"]["message"] == words
    assert full.get_json()["error"]["code"] == "context_length_exceeded"
    one_short = api.post("/v1/completions", json={"prompt": [5] * (limit - 1), "max_tokens": 1, "ignore_eos": True})
    assert one_short.status_code == 200 and one_short.get_json()["usage"]["completion_tokens"] == 1


def test_inspect_takes_the_manifest_path(llama_artifact, capsys):
    code, by_dir, _ = run(["inspect", str(llama_artifact)], capsys)
    assert code == 0
    code, by_manifest, err = run(["inspect", str(llama_artifact / "llmx.json")], capsys)
    assert code == 0 and by_manifest == by_dir, err


@pytest.mark.parametrize("args, code", [
    (["generate", "{art}", "def", "--temperature", "5"], 2),  # a value out of range
    (["generate", "{art}", "def", "--no-such-option"], 2),  # click's usage error
    (["generate", "{art}", "def", "--max-new-tokens", "0"], 2),
    (["generate", "{art}", "def", "--num-beams", "0"], 2),
    (["generate", "{art}", "x = 1\n" * 300], 2),  # a prompt the model cannot take
    (["serve", "{art}", "--max-batch", "0"], 2),
    (["generate", "{missing}", "def"], 1),  # the work cannot be done: no artifact there
    (["inspect", "{tmp}"], 1),  # a directory that is not an artifact
])
def test_exit_codes_say_usage_error_2_or_failure_1(llama_artifact, tmp_path, capsys, args, code):
    argv = [a.format(art=llama_artifact, missing=tmp_path / "nope", tmp=tmp_path) for a in args]
    got, _, err = run(argv, capsys)
    assert got == code, err
    assert last_line(err).lower().startswith("error"), err


def test_export_progress_stamps_each_phase_and_speaks_up_in_long_silences(monkeypatch, tmp_path, capsys):
    import time

    import llmx.commands.export as export_command
    import llmx.export

    def slow_export(checkpoint, output, log, **options):  # stands in for tracing a real model's graphs
        log("exporting prefill and decode graphs")
        time.sleep(0.5)
        log("verifying ONNX Runtime against PyTorch")
        model = type("ModelSpec", (), {"family": "llama"})()
        return type("Manifest", (), {"model": model, "graphs": {"prefill": 0, "decode": 0}})()

    monkeypatch.setattr(export_command, "HEARTBEAT_S", 0.15)
    monkeypatch.setattr(llmx.export, "export_checkpoint", slow_export)
    code, _, err = run(["export", str(tmp_path), "-o", str(tmp_path / "art")], capsys)
    lines = err.splitlines()
    assert code == 0 and all(re.match(r"\[ +\d+\.\d s\] ", line) for line in lines), err
    assert lines[0].endswith("] exporting prefill and decode graphs")
    assert any(line.endswith("] ... still exporting prefill and decode graphs") for line in lines[1:-2]), err
    assert lines[-1].endswith(f"] wrote {tmp_path / 'art'} (llama, 2 graphs)")
