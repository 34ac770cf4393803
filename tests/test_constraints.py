"""Constrained decoding in the runtime (runtime/constraints.py) on the built-in demo model: what
the grammar allows is all that comes out, EOS only where it accepts, bad grammars are refused up
front with one line, rows without a constraint decode exactly as before, and logit_bias."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest

from drafting import fixed_costs
from llmx.errors import InputError, MissingDependencyError
from llmx.runtime.constraints import ConstraintError, ConstraintSpec, compile_constraint
from llmx.runtime.generate import generate
from llmx.runtime.json_numbers import EXPONENT_DIGITS, FRACTION_DIGITS, INT_DIGITS
from llmx.runtime.params import ParamError, logit_bias
from llmx.runtime.sampling import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(demo_artifact):
    from llmx.runtime.engine import Engine

    return Engine.load(demo_artifact, threads=1)


def compiled(engine, spec):
    return compile_constraint(spec, engine.tokenizer, engine.manifest.model.vocab_size)


def run(engine, prompts, params):
    ids = [engine.tokenizer.encode(p) for p in prompts]
    return generate(engine.backend, engine.tokenizer, ids, params)


@pytest.mark.parametrize("spec, words", [
    (ConstraintSpec("json_schema", '{"type": "strin"}'), "invalid JSON schema: Invalid type: strin"),
    (ConstraintSpec.json_schema({"not": {"type": "string"}}), 'Unimplemented keys: ["not"]'),
    (ConstraintSpec.json_schema({"type": "string", "pattern": "(?=a)"}), "look-around"),
    (ConstraintSpec.json_schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), "Unsatisfiable schema"),
    (ConstraintSpec.regex("a(b"), "unclosed group"),
    (ConstraintSpec.lark('start: "a" b'), "unknown name"),
    (ConstraintSpec.lark('start: x\nx: x "a"'), "grammar cannot match any text"),
])
def test_unusable_constraints_are_refused_with_one_line(engine, spec, words):
    with pytest.raises(ConstraintError) as exc:
        compiled(engine, spec)
    assert words in str(exc.value) and "\n" not in str(exc.value)
    assert isinstance(exc.value, InputError)  # CLI exit 2, HTTP 400


def test_spec_checks_its_own_shape():
    with pytest.raises(ConstraintError, match="kind must be one of"):
        ConstraintSpec("yaml", "x")
    with pytest.raises(ConstraintError, match="not valid JSON"):
        ConstraintSpec.json_schema("{nope")
    assert ConstraintSpec.json_schema('{"b": 1, "a": 2}') == ConstraintSpec.json_schema({"b": 1, "a": 2})


def test_missing_llguidance_is_one_line(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(MissingDependencyError, match="needs llguidance, which is not installed"):
        ConstraintSpec.regex("[0-9]+").grammar()


def test_eos_is_allowed_only_where_the_grammar_accepts(engine):
    m = compiled(engine, ConstraintSpec.regex("ab?")).matcher()
    eos = engine.tokenizer.eos_token_ids[0]
    assert not m.mask()[eos] and not m.accepting
    a = engine.tokenizer.encode("a", add_special_tokens=False)
    assert len(a) == 1 and m.mask()[a[0]]
    m.advance(a[0])
    assert m.accepting and m.mask()[eos] and not m.finished


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_matches_regex_and_stops_when_done(engine, temperature):
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=3,
                            constraint=compiled(engine, ConstraintSpec.regex(r"[0-9]{3}-[a-z]{2,4}")))
    seq = run(engine, ["def fibonacci(n):"], params)[0]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", seq.text), seq.text
    assert seq.finish_reason == "stop"


def test_generation_follows_a_json_schema(engine):
    params = [SamplingParams(max_new_tokens=60, temperature=t, seed=s, constraint=compiled(engine, ConstraintSpec.json_schema(PERSON)))
              for t, s in ((0.0, None), (0.8, 1), (0.8, 2))]
    for seq in run(engine, ["import os\n"] * 3, params):
        value = json.loads(seq.text)
        assert set(value) == {"name", "age", "role"} and 0 <= value["age"] <= 150 and value["role"] in ("admin", "user")
        assert seq.finish_reason == "stop"


def test_lark_grammar_with_embedded_json(engine):
    # %json blocks allow free whitespace unless the schema's x-guidance says otherwise (JSON_DEFAULTS
    # applies to json_schema specs only): a noisy model would pad with newlines.
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "x-guidance": {"whitespace_flexible": False}}
    grammar = f'start: "<tool_call>" %json{json.dumps(schema)} "</tool_call>"'
    seq = run(engine, ["x = "], SamplingParams(max_new_tokens=40, temperature=0, constraint=compiled(engine, ConstraintSpec.lark(grammar))))[0]
    body = re.fullmatch(r"<tool_call>(.*)</tool_call>", seq.text)
    assert body and isinstance(json.loads(body.group(1))["x"], int)


def _digit_tokens(engine):
    """Tokens of digits that do not start with 0 (JSON ends a number's integer part at a leading 0)."""
    return {t: 100.0 for t in range(engine.tokenizer.vocab_size)
            if (text := engine.tokenizer.decode([t])).isdigit() and not text.startswith("0")}


@pytest.mark.parametrize("kind", ["integer", "number"])
def test_json_numbers_close_even_when_digits_are_forced(engine, kind):
    # Every digit token boosted by +100: without the bound the model writes digits until max_tokens.
    schema = {"type": "object", "properties": {"n": {"type": kind}}, "required": ["n"]}
    params = SamplingParams(max_new_tokens=120, temperature=0, logit_bias=_digit_tokens(engine),
                            constraint=compiled(engine, ConstraintSpec.json_schema(schema)))
    seq = run(engine, ["x = "], params)[0]
    assert seq.finish_reason == "stop", seq.text
    text = re.fullmatch(r'\{"n": (.*)\}', seq.text).group(1)
    integer, fraction, exponent = re.fullmatch(r"-?([0-9]+)(?:\.([0-9]+))?(?:[eE][+-]?([0-9]+))?", text).groups()
    assert len(integer) == INT_DIGITS  # digits run to the bound, then the number closes
    assert len(fraction or "") <= FRACTION_DIGITS and len(exponent or "") <= EXPONENT_DIGITS
    value = json.loads(seq.text)["n"]
    assert math.isfinite(value) and (kind == "number" or -2**63 <= value < 2**63)


def test_json_number_bound_spares_strings_and_schemas_that_need_more_digits(engine):
    digits = _digit_tokens(engine)
    one = next(t for t in digits if engine.tokenizer.decode([t]) == "1")
    m = compiled(engine, ConstraintSpec.json_object()).matcher()
    for token in engine.tokenizer.encode('{"a": "', add_special_tokens=False) + [one] * 30:
        assert m.mask()[token] and m.advance(token)  # digits in a string are text, never bounded
    big = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**18, "maximum": 2 * 10**18}},
           "required": ["n"], "additionalProperties": False}  # digit-biased keys after n would run to max_tokens
    seq = run(engine, ["x = "], SamplingParams(max_new_tokens=60, temperature=0, logit_bias=digits,
                                             constraint=compiled(engine, ConstraintSpec.json_schema(big))))[0]
    assert json.loads(seq.text)["n"] >= 10**18  # the schema's own 19 digits win over the bound


def test_rows_without_a_constraint_decode_exactly_as_before(engine):
    alone = run(engine, ["def main():"], SamplingParams(max_new_tokens=24, temperature=0))[0].output_ids
    plain = SamplingParams(max_new_tokens=24, temperature=0)
    bound = SamplingParams(max_new_tokens=24, temperature=0, constraint=compiled(engine, ConstraintSpec.json_object()))
    mixed = run(engine, ["import sys\n", "def main():", "class A:"], [bound, plain, bound])
    assert mixed[1].output_ids == alone
    assert mixed[1].constraint is None and mixed[0].constraint is not None


def test_logit_bias_bans_and_boosts(engine):
    greedy = run(engine, ["def main():"], SamplingParams(max_new_tokens=8, temperature=0))[0].output_ids
    banned = run(engine, ["def main():"], SamplingParams(max_new_tokens=8, temperature=0, logit_bias={greedy[0]: -100}))[0]
    assert banned.output_ids[0] != greedy[0]
    target = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    boosted = run(engine, ["def main():"], SamplingParams(max_new_tokens=4, temperature=0, logit_bias={target: 100}))[0]
    assert boosted.output_ids == [target] * 4


def test_logit_bias_rule_shared_by_cli_and_server():
    check = logit_bias(4096)
    assert check({"5": 1, 7: -100}, "logit_bias") == {5: 1.0, 7: -100.0}
    for bad, words in (({"4096": 1}, r"token id in \[0, 4096\)"), ({"-1": 1}, "token id"), ({"5": 101}, r"\[-100, 100\]"),
                       ([1], "an object mapping"), ({"x": 1}, "token id")):
        with pytest.raises(ParamError, match=words):
            check(bad, "logit_bias")


@pytest.mark.parametrize("method", ["ngram", "auto"])
def test_speculation_keeps_constrained_and_biased_output_identical(engine, method):
    """Drafts are verified by each row's own choice (mask, bias, one uniform per token), so a
    constrained, biased, sampled row writes exactly what plain decoding writes."""
    from llmx.runtime.drafters import make_drafter

    schema = {"type": "array", "items": {"type": "string", "enum": ["alpha beta gamma", "delta"]}, "minItems": 6, "maxItems": 6}
    prompt = [engine.tokenizer.encode('["alpha beta gamma", "alpha beta gamma", "delta", "alpha beta gamma"]\n')]
    for temperature, seed in ((0.0, None), (0.9, 4)):
        params = SamplingParams(max_new_tokens=60, temperature=temperature, seed=seed, logit_bias={5: -2.0},
                                constraint=compiled(engine, ConstraintSpec.json_schema(schema)))
        plain = generate(engine.backend, engine.tokenizer, prompt, params)[0]
        drafter = make_drafter(method, engine)
        if method == "auto":
            fixed_costs(drafter)
        fast = generate(engine.backend, engine.tokenizer, prompt, params, drafter=drafter)[0]
        assert fast.output_ids == plain.output_ids and len(json.loads(fast.text)) == 6
        assert drafter.stats.accepted > 0


def test_masks_prefetched_during_the_model_step_equal_computed_ones(engine):
    from llmx.runtime.constraints import prefetch_masks

    c = compiled(engine, ConstraintSpec.json_schema(PERSON))
    a, b = c.matcher(), c.matcher()
    for token in engine.tokenizer.encode('{"name": "x', add_special_tokens=False):
        assert a.advance(token) and b.advance(token)
    prefetch_masks([a]).result()
    assert np.array_equal(a.mask(), b.mask()) and a.mask().sum() > 1


# -- llmx generate --json-schema / --regex / --grammar / --logit-bias ---------------------------

def cli(args, capsys):
    from test_cli import error_line, run

    code, out, err = run(["generate", *map(str, args), "--threads", "1"], capsys)
    return code, out, (error_line(err) if code else err)


def test_generate_cli_constraints(demo_artifact, tmp_path, capsys):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    code, out, _ = cli([demo_artifact, "user = ", "--json-schema", schema, "--temperature", "0", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and set(json.loads(result["text"])) == {"name", "age", "role"} and result["finish_reason"] == "stop"
    code, out, _ = cli([demo_artifact, "x = ", "--regex", "[0-9]{3}", "--temperature", "1", "--seed", "4"], capsys)
    assert code == 0 and re.fullmatch(r"[0-9]{3}\n", out)
    grammar = tmp_path / "yesno.lark"
    grammar.write_text('start: "yes" | "no"\n')
    code, out, _ = cli([demo_artifact, "x = ", "--grammar", grammar], capsys)
    assert code == 0 and out in ("yes\n", "no\n")


def test_generate_cli_logit_bias(demo_artifact, capsys):
    _, plain, _ = cli([demo_artifact, "def main():", "--temperature", "0", "--max-new-tokens", "3", "--json"], capsys)
    first = json.loads(plain)["token_ids"][0]
    _, banned, _ = cli([demo_artifact, "def main():", "--temperature", "0", "--max-new-tokens", "3", "--json",
                        "--logit-bias", f"{first}=-100"], capsys)
    assert json.loads(banned)["token_ids"][0] != first


@pytest.mark.parametrize("args, words", [
    (["--regex", "a(b"], "error: invalid regex"),
    (["--regex", "a", "--regex", "b"], None),  # the last one wins, as click does
    (["--regex", "a", "--num-beams", "2"], "does not combine with --num-beams"),
    (["--regex", "a", "--speculative", "ngram"], None),  # drafts are verified under the constraint
    (["--logit-bias", "4096=1"], "token id in [0, 4096)"),
    (["--logit-bias", "7"], "--logit-bias must be ID=BIAS"),
])
def test_generate_cli_refuses_bad_constraints_in_one_line(demo_artifact, capsys, args, words):
    code, _, err = cli([demo_artifact, "x", "--max-new-tokens", "2", *args], capsys)
    if words is None:
        assert code == 0
    else:
        assert code == 2 and words in err, err


def test_generate_cli_refuses_two_constraints(demo_artifact, tmp_path, capsys):
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "a"')
    code, _, err = cli([demo_artifact, "x", "--regex", "a", "--grammar", grammar], capsys)
    assert code == 2 and "--regex and --grammar do not combine" in err


def test_masks_computed_beside_the_model_step_give_the_same_output(engine, monkeypatch):
    from llmx.runtime import batch

    def schema_run():
        c = compiled(engine, ConstraintSpec.json_schema(PERSON))
        return [s.output_ids for s in run(engine, ["a = ", "b = "], [SamplingParams(max_new_tokens=40, temperature=0, constraint=c)] * 2)]

    inline = schema_run()
    monkeypatch.setattr(batch, "OVERLAP_MIN_STEP_S", 0.0)
    assert schema_run() == inline
