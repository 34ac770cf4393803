"""Which decoding features one request may combine: the rules ``llmx generate`` and the server share.

    request = DecodingRequest(constraints=["--regex"], logit_bias=True, beams=False, speculative=False)
    request.check(words)                                   # refuses what does not combine
    bias, constraint = for_model(spec, raw_bias, engine.tokenizer, vocab_size)   # SamplingParams' fields

A request names at most one constraint (a JSON schema, regex or grammar) and may add
``logit_bias``, ask for beam search, or (on the command line) for speculative decoding. Beam
search is deterministic and scores with the model's own log-probabilities, so it takes no
constraint, no bias and no sampling filter (runtime/params.py's table), and is never
speculative when asked to be (``--speculative auto``, the default, simply does not draft for
it). Speculative drafts are verified against the row's own masked, biased distribution, so they
combine with constraints and bias (runtime/speculative.py). (A server's own ``--speculative``
is not the request's: its beam searches run unspeculated beside the batch.) The rules and their order live here; each
front end words a refusal in the names its user typed (flags, or JSON fields) through a
``Wording``, so the CLI's ``error:`` line and the server's 400 keep saying what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from llmx.runtime.constraints import CompiledConstraint, ConstraintSpec, compile_constraint
from llmx.runtime.params import check_beam_compatible, logit_bias as logit_bias_checker

BEAM_OPTIONS = ("length_penalty", "early_stopping")  # beam search's own settings: meaningless without it


class Wording(Protocol):
    """How one front end refuses each rule, in its own names; every method raises."""

    def several_constraints(self, names: list[str]) -> NoReturn: ...

    def not_combined(self, feature: str, mode: str) -> NoReturn:
        """``feature`` (a constraint's name, "logit_bias" or "beams") with ``mode`` ("beams" or "speculative")."""

    def beam_option_alone(self, name: str) -> NoReturn: ...


@dataclass
class DecodingRequest:
    constraints: list[str] = field(default_factory=list)  # the constraints given, by the names the user gave them
    logit_bias: bool = False  # a non-empty bias was given
    beams: bool = False
    speculative: bool = False  # this request asks for it by name (ngram or draft; auto asks nothing)
    beam_options: list[str] = field(default_factory=list)  # BEAM_OPTIONS that were set
    sampling: dict[str, Any] = field(default_factory=dict)  # the sampling fields, for beam search's table

    def check(self, words: Wording) -> None:
        """Raise (through ``words``, or ParamError from beam search's table) on the first rule broken."""
        if len(self.constraints) > 1:
            words.several_constraints(self.constraints)
        biased = ["logit_bias"] if self.logit_bias else []
        for feature in self.constraints[:1] + biased:
            if self.beams:
                words.not_combined(feature, "beams")
        if not self.beams:
            for name in self.beam_options:
                words.beam_option_alone(name)
            return
        if self.speculative:
            words.not_combined("beams", "speculative")
        check_beam_compatible(self.sampling)


def for_model(spec: ConstraintSpec | None, bias: Any, tokenizer,
              vocab_size: int) -> tuple[dict[int, float] | None, CompiledConstraint | None]:
    """``logit_bias`` checked against the model's vocabulary (ParamError) and the constraint compiled
    and tried now (ConstraintError; LlmxError without llguidance): a refusal before any work."""
    checked = logit_bias_checker(vocab_size)(bias, "logit_bias") if bias is not None else None
    return checked or None, compile_constraint(spec, tokenizer, vocab_size) if spec is not None else None
