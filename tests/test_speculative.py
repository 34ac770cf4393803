"""Speculative decoding: greedy output token-identical to plain decoding (prompt lookup, a
smaller draft model, and the target as its own draft), the acceptance rate reported, and the
rejection rule leaving the sampled distribution unchanged (exactly computed vs empirical)."""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest

from checkpoints import make_checkpoint
from drafting import fixed_costs
from llmx.errors import InputError
from llmx.runtime.drafters import AutoDrafter, DraftModelDrafter, NgramDrafter, make_drafter
from llmx.runtime.engine import Engine
from llmx.runtime.generate import generate
from llmx.runtime.sampling import SamplingParams, softmax, warp
from llmx.runtime.sequence import Sequence
from llmx.runtime.speculative import Draft, judge

PROMPTS = {
    "code": "def fibonacci(n):\n    ",
    "short": "import json",
    # Code editing: the answer mostly repeats what the prompt already holds.
    "repetitive": "def area(w, h):\n    return w * h\n\n\ndef area(w, h):\n    return w * h\n\n\ndef area(",
}


@pytest.fixture(scope="module")
def target(llama_artifact):
    return Engine.load(llama_artifact, threads=1)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A 1-layer, 32-wide Llama with the same tokenizer (trained identically) and other weights."""
    from llmx.export import export_checkpoint

    root = tmp_path_factory.mktemp("draft")
    ckpt = make_checkpoint(root / "ckpt", "llama", seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=48,
                           num_attention_heads=2, num_key_value_heads=1)
    export_checkpoint(ckpt, root / "art")
    return root / "art"


@pytest.fixture(scope="module")
def noisy_draft(store, tmp_path_factory):
    """The target's weights plus noise: a draft whose distributions overlap the target's, so the
    rejection rule both accepts and rejects (a random small model agrees with nothing)."""
    import torch
    import transformers

    from llmx.export import export_checkpoint

    source, root = store.checkpoint("llama"), tmp_path_factory.mktemp("noisy")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=generator) * 0.5 * p.std())
    model.save_pretrained(root / "ckpt")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, root / "ckpt" / name)
    export_checkpoint(root / "ckpt", root / "art")
    return root / "art"


def drafter_for(kind: str, target, draft_artifact, k: int = 4):
    if kind == "ngram":
        return NgramDrafter(k)
    draft = target.artifact.root if kind == "self-draft" else draft_artifact
    return make_drafter("draft", target, k, str(draft), threads=1)


def run(engine, prompts: list[str], params: SamplingParams, drafter=None):
    return generate(engine.backend, engine.tokenizer, [engine.encode(p) for p in prompts], params, drafter=drafter)


@pytest.mark.parametrize("kind", ["ngram", "small-draft", "self-draft"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_token_identical(target, small_draft, kind, prompt):
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    plain = run(target, [PROMPTS[prompt]], params)[0]
    drafter = drafter_for(kind, target, small_draft)
    fast = run(target, [PROMPTS[prompt]], params, drafter)[0]
    assert fast.output_ids == plain.output_ids and fast.text == plain.text and fast.finish_reason == plain.finish_reason
    stats = drafter.stats
    assert stats.drafted > 0 and stats.emitted == len(plain.output_ids) - 1  # the first token comes from prefill
    assert stats.steps == stats.emitted - stats.accepted  # each call emits its accepted drafts plus one
    if kind == "self-draft":
        assert stats.acceptance_rate == 1.0 and stats.steps <= -(-39 // 5)  # k + 1 tokens per call
    if kind == "ngram" and prompt == "repetitive":
        assert stats.acceptance_rate > 0.5 and stats.emitted / stats.steps > 1.5


@pytest.mark.parametrize("method", ["ngram", "auto"])
def test_sampled_output_with_lookup_is_token_identical(demo_artifact, method):
    """Lookup drafts are verified by the row's own draw, one uniform per emitted token: the same
    seed gives the same tokens as plain sampling. (The demo model has real weights, so its
    sampled text repeats the prompt and drafts are kept.)"""
    demo = Engine.load(demo_artifact, threads=1)
    for seed in (1, 2):
        params = SamplingParams(max_new_tokens=40, temperature=0.3, top_p=0.95, seed=seed, ignore_eos=True)
        plain = run(demo, [PROMPTS["repetitive"]], params)[0]
        drafter = make_drafter(method, demo)
        if method == "auto":
            fixed_costs(drafter)
        fast = run(demo, [PROMPTS["repetitive"]], params, drafter)[0]
        assert fast.output_ids == plain.output_ids and drafter.stats.accepted > 0


def test_auto_sizes_drafts_by_acceptance_and_measured_cost():
    auto = AutoDrafter(8)
    assert auto.best_length(0.6, 8) > 0  # the prior drafts: untried widths are assumed cheap
    for width, seconds in ((1, 0.010), (2, 0.013), (3, 0.0135), (5, 0.0145), (9, 0.0195)):  # fp32 135M, measured shape
        auto.observe(1, width, 10 * seconds)  # a shape's first run allocates: not its cost
        auto.observe(1, width, seconds)
    auto.observe(4, 9, 1.0)  # a batch of 4 rows says nothing of one row's cost
    assert auto.cost(9) == pytest.approx(1.95)
    assert auto.cost(7) == pytest.approx(1.7)  # between measured widths 5 and 9
    assert auto.best_length(0.95, 8) >= 6 and 0 < auto.best_length(0.6, 8) < 6
    assert auto.best_length(0.2, 8) == 0  # too few kept to pay for the wider call
    for width in (2, 3, 5, 9):  # a backend whose wider calls cost as much as that many steps
        auto.observe(1, width, 0.010 * width)
        auto.seconds[width] = 0.010 * width
    assert auto.best_length(0.9, 8) == 0


def test_a_slow_first_run_at_a_new_width_does_not_price_it_out():
    """The first call of each width is not timed (ONNX Runtime allocates for a new shape): were it
    taken, one hiccup would stop drafting for the server's lifetime, since a width deemed too
    dear is never run again, so never re-measured."""
    auto = AutoDrafter(8)
    auto.observe(1, 1, 0.050)
    auto.observe(1, 1, 0.010)
    auto.observe(1, 3, 0.100)  # first 3-token call: ten plain steps
    assert auto.best_length(0.6, 8) > 0
    auto.observe(1, 3, 0.013)
    assert auto.cost(3) == pytest.approx(1.3) and auto.best_length(0.6, 8) > 0


def test_auto_stops_on_rejections_comes_back_and_never_drafts_for_a_crowd(target):
    auto = AutoDrafter(8)
    seq = Sequence(target.encode(PROMPTS["repetitive"]), SamplingParams(max_new_tokens=50), target.tokenizer, 256)
    assert auto.propose([seq], [8])[0].tokens  # text to copy, prior acceptance: a draft
    for _ in range(6):
        auto.verified(seq, 4, 0)
    assert not auto.propose([seq], [8])[0].tokens  # rejected again and again: off
    for _ in range(40):  # each step it does not draft, its estimate drifts back to the prior
        auto.propose([seq], [8])
    assert auto.propose([seq], [8])[0].tokens
    other = Sequence(target.encode(PROMPTS["repetitive"]), SamplingParams(max_new_tokens=50), target.tokenizer, 256)
    assert all(not d.tokens for d in auto.propose([seq, other], [8, 8]))


def test_auto_takes_two_token_matches_only_from_a_row_that_has_kept_a_draft(target):
    """In prose a 2-token match is mostly chance (plain chat's drafts were all rejected): a row
    drafts from a 3-token match until one of its drafts is kept, then from 2 as well."""
    auto = AutoDrafter(8)
    seq = Sequence([11, 12, 13, 14, 15, 19, 14, 15], SamplingParams(max_new_tokens=50), target.tokenizer, 256)
    assert NgramDrafter(4, max_ngram=3, min_ngram=2).propose([seq], [4])[0].tokens == [19, 14, 15, 19]
    assert not auto.propose([seq], [8])[0].tokens  # (14, 15) again, but (19, 14, 15) is new
    auto.verified(seq, 2, 0)
    assert not auto.propose([seq], [8])[0].tokens  # rejected drafts do not count
    auto.verified(seq, 3, 3)
    tokens = auto.propose([seq], [8])[0].tokens
    assert tokens and tokens == [19, 14, 15, 19][: len(tokens)]  # from the 2-token match
    copying = Sequence([11, 12, 13, 14, 12, 13, 14], SamplingParams(max_new_tokens=50), target.tokenizer, 256)
    assert AutoDrafter(8).propose([copying], [8])[0].tokens[:2] == [12, 13]  # a 3-token match drafts at once


class WidthVariantBackend:
    """The target's backend, except that a call of several tokens shifts the logits slightly (as
    quantized graphs do: 1-2 % of the range on a 135M w4 graph, runtime/drafters.py)."""

    def __init__(self, backend):
        self._b = backend

    def __getattr__(self, name):
        return getattr(self._b, name)

    def decode(self, cache, ids):
        logits = self._b.decode(cache, ids)
        return logits + (0.05 if ids.shape[1] > 1 else 0.0) * np.arange(logits.shape[-1], dtype=np.float32) / logits.shape[-1]


def test_auto_does_not_draft_where_a_wider_call_changes_the_logits(target):
    assert AutoDrafter(8, target.backend).width_invariant()  # fp32 kernels: the same logits at any width
    auto = AutoDrafter(8, WidthVariantBackend(target.backend))
    seq = Sequence(target.encode(PROMPTS["repetitive"]), SamplingParams(max_new_tokens=50), target.tokenizer, 256)
    assert not auto.width_invariant() and not auto.propose([seq], [8])[0].tokens
    assert NgramDrafter(4).propose([seq], [4])[0].tokens  # asked for by name, lookup still drafts


@pytest.mark.parametrize("kind", ["ngram", "small-draft"])
def test_batch_of_rows_with_ragged_drafts_equals_each_alone(target, small_draft, kind):
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    prompts = list(PROMPTS.values())
    alone = [run(target, [p], params)[0].output_ids for p in prompts]
    together = run(target, prompts, params, drafter_for(kind, target, small_draft))
    assert [s.output_ids for s in together] == alone


def test_penalties_logprobs_stops_and_lengths_are_honoured(target):
    """Verification goes through the Sequence: penalties, logprobs, end tokens, stop strings and
    max_new_tokens act on every accepted token exactly as in plain decoding."""
    for params in (
        SamplingParams(max_new_tokens=33, temperature=0, repetition_penalty=1.3, logprobs=3, ignore_eos=True),
        SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=60, temperature=0, stop=["w *"]),
    ):
        plain = run(target, [PROMPTS["repetitive"]], params)[0]
        fast = run(target, [PROMPTS["repetitive"]], params, NgramDrafter(6))[0]
        assert (fast.output_ids, fast.text, fast.finish_reason) == (plain.output_ids, plain.text, plain.finish_reason)
        assert [(lp.token_id, round(lp.logprob, 4)) for lp in fast.logprobs] == \
               [(lp.token_id, round(lp.logprob, 4)) for lp in plain.logprobs]
        assert len(fast.output_ids) <= params.max_new_tokens


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, quantile: float = 0.001) -> bool:
    """Counts drawn from ``probs``? Pearson's chi-square against its 0.1 % tail (scipy-free: a
    Wilson-Hilferty approximation of the chi-square quantile)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    expected = counts.sum() * probs[keep]
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = keep.sum() - 1
    z = 3.09  # one-sided 0.1 %
    limit = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    return stat < limit


@pytest.mark.parametrize("proposal", ["draft-model", "lookup"])
def test_rejection_rule_emits_tokens_distributed_as_the_target(target, proposal):
    """``judge`` with drafts from q (or a fixed lookup token) emits tokens distributed as p."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.9, top_k=6)
    p_logits = rng.normal(size=16).astype(np.float32) * 2
    q = softmax(warp(rng.normal(size=16).astype(np.float32) * 2, params))  # a different distribution
    seq = Sequence([1, 2, 3], params, target.tokenizer, 256)
    seq.rng = np.random.default_rng(1)
    p = seq.probs(p_logits)
    counts, accepted = np.zeros(16), 0
    for _ in range(20000):
        if proposal == "draft-model":
            d = int(rng.choice(16, p=q))
            token, ok = judge(seq, p_logits, d, q)
        else:
            d = int(np.argsort(-p)[2])  # a fixed, fairly unlikely guess
            token, ok = judge(seq, p_logits, d, None)
        counts[token] += 1
        accepted += ok
    assert chi_square_ok(counts, p)
    assert 0.05 < accepted / 20000 < 0.95  # both branches of the rule ran


def exact_distribution(engine, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple, float]:
    """P(first ``depth`` tokens) of plain sampling, from the target's own filtered distributions."""
    out = {}
    seq = Sequence(prompt, params, engine.tokenizer, engine.max_seq_len)

    def walk(prefix: tuple, prob: float):
        if len(prefix) == depth:
            out[prefix] = prob
            return
        cache = engine.backend.new_cache(1, len(prompt) + depth)
        logits = engine.backend.prefill(cache, [0], [prompt + list(prefix)])[0]
        probs = seq.probs(logits)
        for token in np.flatnonzero(probs > 0):
            walk(prefix + (int(token),), prob * float(probs[token]))

    walk((), 1.0)
    return out


@pytest.mark.parametrize("kind", ["ngram", "noisy-draft"])
def test_sampled_sequences_keep_the_plain_distribution(target, noisy_draft, kind):
    """The first three sampled tokens, drawn 1500 times with speculation: their joint
    frequencies match the exact joint distribution of plain sampling (27 outcomes)."""
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    prompt = target.encode("def area(w, h):\n    return w * h\n\ndef")
    exact = exact_distribution(target, prompt, params, 3)
    outcomes = sorted(exact)
    counts = np.zeros(len(outcomes))
    drafter = drafter_for(kind, target, noisy_draft, k=3)
    for seed in range(1500):
        seq = generate(target.backend, target.tokenizer, [prompt], SamplingParams(**{**vars(params), "seed": seed}),
                       drafter=drafter)[0]
        counts[outcomes.index(tuple(seq.output_ids[:3]))] += 1
    assert chi_square_ok(counts, np.array([exact[o] for o in outcomes]))
    stats = drafter.stats
    assert 0 < stats.accepted < stats.drafted  # drafts were both accepted and rejected


@pytest.fixture(scope="module")
def other_tokenizer(llama_artifact, tmp_path_factory):
    """The target artifact with two token ids swapped: same size, a different tokenizer."""
    other = tmp_path_factory.mktemp("other") / "art"
    shutil.copytree(llama_artifact, other)
    path = other / "tokenizer" / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(itertools.islice((k for k in vocab if len(k) > 1 and vocab[k] > 10), 2))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(spec))
    return other


def test_draft_with_another_tokenizer_is_refused(target, other_tokenizer):
    with pytest.raises(InputError, match="tokenizer differs"):
        make_drafter("draft", target, 4, str(other_tokenizer), threads=1)


def test_draft_vocabularies_of_other_sizes_are_aligned(target, small_draft):
    drafter = make_drafter("draft", target, 4, str(small_draft), threads=1)
    assert isinstance(drafter, DraftModelDrafter)
    wide = np.zeros((2, drafter.vocab + 8), np.float32)
    narrow = np.zeros((2, drafter.vocab - 8), np.float32)
    assert drafter._target_vocab(wide).shape == drafter._target_vocab(narrow).shape == (2, drafter.vocab)
    assert np.isneginf(drafter._target_vocab(narrow)[:, -8:]).all()


def test_ngram_lookup_takes_the_latest_longest_match():
    lookup = NgramDrafter(3, max_ngram=3, min_ngram=1).lookup
    assert lookup(np.array([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 6, 7]), 3) == [9, 2, 6]  # 2-gram (6, 7), latest
    assert lookup(np.array([1, 2, 3, 4]), 3) == []
    assert lookup(np.array([4, 1, 2, 4]), 5) == [1, 2, 4, 1, 2]  # past the context's end: the period repeats
    assert lookup(np.array([3, 7, 7, 7]), 4) == [7, 7, 7, 7]


def test_ngram_lookup_agrees_with_a_plain_search_on_random_contexts():
    def search(ids: list[int], k: int, longest: int, shortest: int) -> list[int]:
        for n in range(min(longest, len(ids) - 1), shortest - 1, -1):
            for start in range(len(ids) - 1 - n, -1, -1):  # latest first, never the suffix itself
                if ids[start : start + n] == ids[-n:]:
                    follow = ids[start + n :]
                    return (follow * k)[:k]
        return []

    rng = np.random.default_rng(0)
    for _ in range(3000):
        ids = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        longest = int(rng.integers(1, 5))
        shortest = int(rng.integers(1, longest + 1))
        k = int(rng.integers(1, 9))
        got = NgramDrafter(k, max_ngram=longest, min_ngram=shortest).lookup(np.array(ids, dtype=np.int64), k)
        assert got == search(ids, k, longest, shortest), (ids, k, longest, shortest)


def test_cli_reports_acceptance_and_matches_plain_greedy(llama_artifact, capsys):
    from llmx.cli import main

    args = ["generate", str(llama_artifact), PROMPTS["repetitive"], "--temperature", "0", "--max-new-tokens", "24",
            "--threads", "1", "--json"]
    main(args + ["--speculative", "off"])
    plain = json.loads(capsys.readouterr().out)
    main(args + ["--speculative", "ngram", "--num-draft-tokens", "5"])
    fast = json.loads(capsys.readouterr().out)
    assert fast["token_ids"] == plain["token_ids"] and "speculative" not in plain
    spec = fast["speculative"]
    assert spec["method"] == "ngram" and spec["num_draft_tokens"] == 5
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"], abs=1e-4)
    assert spec["tokens_per_step"] > 1
    main(args)  # the default: auto, which drafts on this repetitive text
    auto = json.loads(capsys.readouterr().out)
    assert auto["token_ids"] == plain["token_ids"]
    assert auto["speculative"]["method"] == "auto" and auto["speculative"]["accepted"] > 0


def test_judge_greedy_accepts_only_the_argmax(target):
    seq = Sequence([1, 2], SamplingParams(temperature=0), target.tokenizer, 256)
    logits = np.array([0.0, 3.0, 1.0], np.float32)
    assert judge(seq, logits, 1, None) == (1, True)
    assert judge(seq, logits, 2, None) == (1, False)
    assert Draft([1]).probs is None


@pytest.mark.parametrize("kind", ["ngram", "small-draft"])
def test_server_with_speculation_answers_as_plain_greedy(llama_artifact, target, small_draft, kind):
    from live_server import LiveServer

    options = dict(speculative="ngram") if kind == "ngram" else dict(speculative="draft", draft=str(small_draft))
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    refs = [run(target, [p], params)[0] for p in PROMPTS.values()]
    with LiveServer(artifact=llama_artifact, threads=1, max_batch=3, num_draft_tokens=3, **options) as live:
        client = live.client(max_retries=0, timeout=60)
        out = client.completions.create(model="llama", prompt=list(PROMPTS.values()), max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [r.text for r in refs]
        assert out.usage.completion_tokens == sum(len(r.output_ids) for r in refs)
        drafted, accepted = live.metric("llmx_speculative_draft_tokens_total"), live.metric("llmx_speculative_accepted_tokens_total")
        assert drafted > 0 and 0 <= accepted <= drafted
        assert live.metric("llmx_generation_tokens_total") == sum(len(r.output_ids) for r in refs)


@pytest.mark.parametrize("draft, error", [("gpt2", None), ("other", "tokenizer differs"), (None, "needs --draft")])
def test_server_checks_the_draft_at_start(llama_artifact, store, other_tokenizer, draft, error):
    """Another family with the same tokenizer drafts fine; another tokenizer fails the load
    (/ready says why); no draft at all is refused before anything starts."""
    from llmx.serve.service import build_service

    path = {"gpt2": store.artifact("gpt2"), "other": other_tokenizer, None: None}[draft]
    if path is None:
        with pytest.raises(InputError, match=error):
            build_service(llama_artifact, speculative="draft")
        return
    service = build_service(llama_artifact, threads=1, speculative="draft", draft=str(path), prefix_cache_mb=0)
    try:
        assert service.scheduler.settled.wait(60)
        assert service.scheduler.load_error is None if error is None else error in service.scheduler.load_error
    finally:
        service.scheduler.stop()


@pytest.fixture(scope="module")
def fused(store):
    """The tiny Llama after ``llmx optimize``: GroupQueryAttention takes T > 1 tokens one row at a time."""
    return Engine.load(store.optimized("llama"), threads=1)


def test_fused_graphs_verify_drafts_and_fork_beams_as_the_exported_ones(target, fused):
    from llmx.runtime.beam import BeamParams, BeamSearch

    assert fused.manifest.graphs["decode"].ops == "onnxruntime"
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    prompts = list(PROMPTS.values())
    plain = [s.output_ids for s in run(fused, prompts, params)]
    assert [s.output_ids for s in run(fused, prompts, params, NgramDrafter(4))] == plain
    assert plain == [s.output_ids for s in run(target, prompts, params)]
    ids = target.encode(PROMPTS["code"])
    beams = [BeamSearch(e.backend, ids, BeamParams(num_beams=3, max_new_tokens=10), [2]).run() for e in (target, fused)]
    assert [h.token_ids for h in beams[0]] == [h.token_ids for h in beams[1]]
