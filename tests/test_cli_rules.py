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


class Recorded(Exception):
    """Which rule runtime/decoding_request.py chose, whatever a front end would call it."""


class Recorder:
    def several_constraints(self, names):
        raise Recorded("several_constraints", *names)

    def not_combined(self, feature, mode):
        raise Recorded("not_combined", feature, mode)

    def beam_option_alone(self, name):
        raise Recorded("beam_option_alone", name)


@pytest.mark.parametrize("rule, request_, cli, body, cli_words, http", [
    (("not_combined", "constraint", "beams"), dict(constraints=["constraint"], beams=True),
     ["--regex", "[a-z]", "--num-beams", "2"], {"structured_outputs": {"regex": "[a-z]"}, "use_beam_search": True, "n": 2},
     "a constraint (--json-schema/--regex/--grammar) does not combine with --num-beams",
     ("'structured_outputs' is not supported with beam search", "structured_outputs")),
    (("not_combined", "logit_bias", "beams"), dict(logit_bias=True, beams=True),
     ["--logit-bias", "5=1", "--num-beams", "2"], {"logit_bias": {"5": 1}, "use_beam_search": True, "n": 2},
     "--logit-bias does not combine with --num-beams", ("'logit_bias' is not supported with beam search", "logit_bias")),
    (("beam_option_alone", "length_penalty"), dict(beam_options=["length_penalty"]),
     ["--length-penalty", "2"], {"length_penalty": 2},
     "--length-penalty applies to beam search", ("'length_penalty' applies to beam search", "length_penalty")),
    (("several_constraints", "one", "two"), dict(constraints=["one", "two"], beams=True),
     ["--regex", "a", "--json-schema", "{schema}", "--num-beams", "2"],
     {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}, "use_beam_search": True, "n": 2},
     "--json-schema and --regex do not combine",
     ("'response_format' and 'structured_outputs' do not combine", "structured_outputs")),
], ids=["constraint-beams", "bias-beams", "beam-option-alone", "two-constraints-first"])
def test_one_rule_refuses_decoding_combinations_in_the_cli_and_the_server(llama_artifact, api, capsys, tmp_path, rule,
                                                                          request_, cli, body, cli_words, http):
    from llmx.runtime.decoding_request import DecodingRequest

    with pytest.raises(Recorded) as chosen:
        DecodingRequest(**request_).check(Recorder())
    assert chosen.value.args == rule
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    code, out, err = run(["generate", str(llama_artifact), "def", *(a.format(schema=schema) for a in cli)], capsys)
    assert code == 2 and out == "" and last_line(err).startswith(f"error: {cli_words}"), err
    answer = post(api, **body)
    error = answer.get_json()["error"]
    assert answer.status_code == 400 and error["message"].startswith(http[0]) and error["param"] == http[1], error


def test_a_constraint_with_logit_bias_is_accepted_by_both(llama_artifact, api, capsys):
    code, out, err = run(["generate", str(llama_artifact), "def", "--regex", "[a-z]{2}", "--logit-bias", "5=-100",
                          "--temperature", "0", "--max-new-tokens", "4"], capsys)
    answer = post(api, structured_outputs={"regex": "[a-z]{2}"}, logit_bias={"5": -100}, temperature=0, max_tokens=4)
    assert code == 0, err
    assert answer.status_code == 200 and answer.get_json()["choices"][0]["text"] == out.strip()
