"""Incremental detokenization (UTF-8 safe streaming) and stop strings."""

from __future__ import annotations

import pytest

from llmx.runtime.sampling import SamplingParams
from llmx.runtime.sequence import StopStrings
from llmx.runtime.tokenizer import IncrementalDetokenizer

TRICKY = "naïve café → 😀 世界 def f(x):\n\treturn x  # done"


def test_streamed_deltas_are_valid_text_and_add_up(llama_engine):
    tok = llama_engine.tokenizer
    ids = tok.encode(TRICKY, add_special_tokens=False)
    assert len(ids) > len(TRICKY.encode()) // 4  # multi-byte characters are split across tokens
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TRICKY == tok.decode(ids)


def test_streaming_after_a_prompt_keeps_spaces(llama_engine):
    tok = llama_engine.tokenizer
    prompt, rest = tok.encode("x = 1"), tok.encode(" and more words here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.push(i) for i in rest) + detok.flush() == " and more words here"


@pytest.mark.parametrize(
    "chunks, stops, shown, hit",
    [
        (["hello wor", "ld STOP more"], ["STOP"], "hello world ", True),
        (["abc S", "T", "OP"], ["STOP"], "abc ", True),
        (["abc S", "T", "x"], ["STOP"], "abc STx", False),
        (["a\n\n", "b"], ["\n\n", "b"], "a", True),
        (["xyz"], [], "xyz", False),
    ],
)
def test_stop_strings_cut_exactly_and_hold_back_partial_matches(chunks, stops, shown, hit):
    s = StopStrings(stops)
    out, stopped = "", False
    for c in chunks:
        text, stopped = s.feed(c)
        out += text
        if stopped:
            break
    if not stopped:
        out += s.flush()
    assert (out, stopped) == (shown, hit)


def test_stop_string_cuts_generated_text_exactly(llama_engine):
    params = dict(max_new_tokens=40, temperature=0, ignore_eos=True)
    full = llama_engine.generate(["def"], SamplingParams(**params))[0].text
    stop = full[10:14]
    assert stop and stop in full
    streamed = []
    seq = llama_engine.generate(["def"], SamplingParams(stop=[stop], **params), on_event=lambda e: streamed.append(e[1]))[0]
    assert seq.text == full[: full.index(stop)]
    assert "".join(streamed) == seq.text
    assert seq.finish_reason == "stop"


def test_eos_stops_generation_and_is_not_shown(llama_engine):
    greedy = llama_engine.generate(["def"], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))[0]
    # Make the 5th greedy token the stop token: generation ends right there, its text unseen.
    stop_id = greedy.output_ids[4]
    seq = llama_engine.generate(["def"], SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop_id]))[0]
    first = greedy.output_ids.index(stop_id)
    assert seq.output_ids == greedy.output_ids[: first + 1]
    assert seq.finish_reason == "stop"
    assert seq.text == llama_engine.tokenizer.decode(greedy.output_ids[:first])


def test_chat_template_renders_messages(llama_engine):
    from llmx.runtime.chat import render_chat

    text = render_chat(llama_engine.tokenizer, [{"role": "user", "content": "hi"}])
    assert text == "<|user|>hi</s><|assistant|>"
