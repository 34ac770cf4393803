"""Sampling filters and penalties as pure functions, and sampling through the real engine."""

from __future__ import annotations

import numpy as np
import pytest

from llmx.errors import InputError
from llmx.runtime import sampling as S
from llmx.runtime.sampling import SamplingParams


def probs_of(logits):
    return S.softmax(logits)


def masked(logits, **filters):
    """The logits ``warp`` draws from at temperature 1 with ``filters``: filtered tokens -inf."""
    return S.warp(logits, SamplingParams(**filters))


def test_top_k_keeps_exactly_k_largest():
    logits = np.array([0.1, 3.0, -1.0, 2.0, 2.5, 0.0], np.float32)
    kept = np.isfinite(masked(logits, top_k=3))
    assert kept.tolist() == [False, True, False, True, True, False]
    assert np.isfinite(masked(logits, top_k=0)).all()


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_top_p_keeps_smallest_prefix_reaching_p(p):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=5000).astype(np.float32) * 3
    kept = np.isfinite(masked(logits, top_p=p))
    probs = probs_of(logits)
    order = np.argsort(-probs)
    n = int(np.searchsorted(np.cumsum(probs[order]), p)) + 1
    assert kept.sum() == n
    assert kept[order[:n]].all()
    assert probs[kept].sum() >= p - 1e-6


def test_min_p_drops_tokens_below_fraction_of_top():
    logits = np.log(np.array([0.5, 0.3, 0.12, 0.05, 0.03], np.float32))
    kept = np.isfinite(masked(logits, min_p=0.2))  # threshold 0.1
    assert kept.tolist() == [True, True, True, False, False]


def test_typical_keeps_tokens_nearest_the_entropy():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    kept = np.isfinite(masked(logits, typical_p=0.5))
    assert kept.sum() >= 1 and not kept.all()


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([2.0, -2.0, 1.0], np.float32)
    out = S.apply_penalties(logits.copy(), SamplingParams(repetition_penalty=2.0), np.array([0, 1]), {})
    assert out.tolist() == [1.0, -4.0, 1.0]
    again = S.apply_penalties(logits.copy(), SamplingParams(repetition_penalty=2.0), np.array([0, 1, 0, 0, 1]), {})
    assert again.tolist() == [1.0, -4.0, 1.0]  # a token seen three times is penalized once


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = np.zeros(4, np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = S.apply_penalties(logits, params, np.array([]), {1: 1, 3: 4})
    assert out.tolist() == [0.0, -0.75, 0.0, -1.5]


def test_sample_respects_masks_and_seed():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=5)
    allowed = set(np.argsort(-logits)[:5].tolist())
    draws = [S.sample(logits, params, np.random.default_rng(s)) for s in range(200)]
    assert set(draws) <= allowed and len(set(draws)) > 1
    again = [S.sample(logits, params, np.random.default_rng(s)) for s in range(200)]
    assert draws == again


def test_sample_frequencies_follow_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    rng = np.random.default_rng(0)
    draws = np.bincount([S.sample(np.log(probs), SamplingParams(), rng) for _ in range(6000)], minlength=3) / 6000
    np.testing.assert_allclose(draws, probs, atol=0.03)


class FixedUniform:
    """An rng whose draws are given: the uniform that decides an inverse-CDF draw."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def assert_drawn_where_the_uniform_falls(weights, u, index):
    """``index`` is the token whose slice of the running sum (float64) holds u * total, up to
    float32 rounding at the slice's ends; it has weight."""
    running = np.cumsum(weights, dtype=np.float64)
    target, slack = u * running[-1], 3e-5 * running[-1]
    assert weights[index] > 0
    assert (running[index - 1] if index else 0.0) - slack <= target <= running[index] + slack


@pytest.mark.parametrize("size", [7, 1000, 49152, 50_000])  # one cumsum; block sums, whole and ragged last block
def test_draw_is_the_inverse_cdf_in_id_order(size):
    rng = np.random.default_rng(size)
    weights = rng.exponential(size=size).astype(np.float32) ** 4
    weights[rng.random(size) < 0.3] = 0  # filtered tokens
    for u in np.r_[rng.random(300), 0.0, np.nextafter(1.0, 0.0)]:
        assert_drawn_where_the_uniform_falls(weights, u, S.draw(weights, FixedUniform(u)))


def test_draw_never_lands_on_a_filtered_tail():
    weights = np.zeros(5000, np.float32)
    weights[[3, 700, 1800]] = [1.0, 2.0, 1e-3]  # the last blocks all zero, as a grammar's mask leaves them
    for u in (1 - 1e-12, np.nextafter(1.0, 0.0)):  # the largest uniform numpy draws: u * total rounds to the total
        assert S.draw(weights, FixedUniform(u)) == 1800
    assert S.draw(weights, FixedUniform(0.0)) == 3


def test_a_uniform_past_a_blocks_own_running_sums_draws_its_last_token_with_weight():
    # The block totals (np.add.reduceat) and a block's own running sums (cumsum) round
    # differently: a uniform can land past the last running sum of the block it falls in.
    rng = np.random.default_rng(0)
    weights = rng.exponential(size=4096).astype(np.float32) ** 4
    weights[np.arange(4096) % 256 >= 250] = 0  # every block ends in tokens a filter removed
    starts = np.arange(0, weights.size, 256)
    totals = np.cumsum(np.add.reduceat(weights, starts))
    ends = [(float(totals[j - 1]) if j else 0.0) + np.cumsum(weights[s : s + 256])[-1] for j, s in enumerate(starts)]
    short = [j for j in range(len(starts)) if ends[j] < totals[j]]
    assert short, "no block whose running sums end short of its total: the case is not exercised"
    j = short[0]
    u = (float(ends[j]) + float(totals[j])) / 2 / float(totals[-1])
    assert S.draw(weights, FixedUniform(u)) == starts[j] + 249


@pytest.mark.parametrize("size", [10, 5000])
def test_draw_refuses_weights_with_nothing_to_draw(size):
    for weights in (np.zeros(size, np.float32), np.full(size, np.nan, np.float32)):
        with pytest.raises(ValueError, match="cannot sample"):
            S.draw(weights, FixedUniform(0.5))


def crafted_rows(size: int, rng) -> tuple[np.ndarray, list[float]]:
    """Rows of weights with filtered tokens and heavy tails, and uniforms that include both ends
    and one that lands past a block's own running sums (see the test above)."""
    weights = rng.exponential(size=(6, size)).astype(np.float32) ** 4
    weights[rng.random((6, size)) < 0.3] = 0
    weights[5, np.arange(size) % 256 >= 250] = 0
    uniforms = [0.0, np.nextafter(1.0, 0.0), *rng.random(3)]
    if size > 1024:
        starts = np.arange(0, size, 256)
        totals = np.cumsum(np.add.reduceat(weights[5], starts))
        ends = [(float(totals[j - 1]) if j else 0.0) + np.cumsum(weights[5, s : s + 256])[-1] for j, s in enumerate(starts)]
        short = [j for j in range(len(starts)) if ends[j] < totals[j]]
        uniforms.append((float(ends[short[0]]) + float(totals[short[0]])) / 2 / float(totals[-1]) if short else 0.5)
    else:
        uniforms.append(0.5)
    return weights, uniforms


@pytest.mark.parametrize("size", [7, 1000, 1025, 4096, 50_000])  # one cumsum; blocks, whole and ragged last block
def test_draw_rows_draws_what_draw_draws_row_by_row(size):
    rng = np.random.default_rng(size)
    for _ in range(20):
        weights, uniforms = crafted_rows(size, rng)
        alone = [S.draw(w, FixedUniform(u)) for w, u in zip(weights, uniforms)]
        assert S.draw_rows(weights, [FixedUniform(u) for u in uniforms]) == alone


@pytest.mark.parametrize("size", [50, 4096, 49_153])
def test_sample_rows_is_sample_row_by_row_with_each_rows_generator(size):
    # A batch draws its temperature-only rows at once (runtime/batch.py): a seeded sequence must
    # get the tokens it gets alone, and leave its generator where ``sample`` leaves it.
    rng = np.random.default_rng(size)
    for trial in range(25):
        n = int(rng.integers(1, 9))
        logits = (rng.standard_normal((n, size)) * rng.choice([0.1, 2.0, 30.0])).astype(np.float32)
        logits[rng.random((n, size)) < 0.05] = -np.inf  # banned by a grammar or a bias
        temperatures = [float(t) for t in rng.choice([1e-3, 0.3, 0.8, 1.0, 1.7], n)]
        seeds = rng.integers(0, 2**31, n)
        mine = [np.random.default_rng(s) for s in seeds]
        theirs = [np.random.default_rng(s) for s in seeds]
        alone = [S.sample(row, SamplingParams(temperature=t), g) for row, t, g in zip(logits, temperatures, theirs)]
        assert S.sample_rows(logits, temperatures, mine) == alone
        assert [g.random() for g in mine] == [g.random() for g in theirs]


def test_sample_rows_refuses_a_row_with_nothing_to_draw():
    logits = np.zeros((3, 3000), np.float32)
    for bad in (np.nan, -np.inf):
        logits[1] = bad
        with pytest.raises(ValueError, match="cannot sample"):
            S.sample_rows(logits, [0.8, 0.8, 0.8], [np.random.default_rng(i) for i in range(3)])


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=5)])
def test_sampling_nan_or_fully_masked_logits_is_one_clear_error(params):
    for logits in (np.full(3000, np.nan, np.float32), np.full(3000, -np.inf, np.float32)):
        with pytest.raises(ValueError, match="cannot sample"):
            S.sample(logits, SamplingParams(**params), np.random.default_rng(0))


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=50),
                                    dict(temperature=0.7, top_k=50, top_p=0.9), dict(temperature=1.2, min_p=0.05),
                                    dict(temperature=1.0, top_p=0.95, min_p=0.02, typical_p=0.9)])
def test_sample_draws_from_warps_distribution(params):
    # sample runs each filter on the survivors of the one before; warp masks the whole
    # vocabulary: for the same uniform both are the same token.
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(8000) * 2.5).astype(np.float32)
    logits[rng.random(8000) < 0.1] = -np.inf  # banned by a grammar
    p = SamplingParams(**params)
    warped = S.softmax(S.warp(logits, p))
    assert 0 < np.isfinite(S.warp(logits, p)).sum()
    for u in rng.random(200):
        assert_drawn_where_the_uniform_falls(warped, u, S.sample(logits, p, FixedUniform(u)))


def test_top_p_keeps_what_a_full_stable_sort_keeps():
    # top_p_keep sorts only the tokens above a floor when they hold p, and sums as far as needed;
    # the reference sorts every id by probability (ties: lowest id first) and sums them all.
    def reference(logits, p):
        w = np.exp(logits - logits.max())
        order = np.argsort(-w, kind="stable")
        n = min(int(np.searchsorted(np.cumsum(w[order] / w.sum()), p)) + 1, w.size)
        return np.sort(order[:n])

    rng = np.random.default_rng(7)
    for _ in range(300):
        size = int(rng.choice([50, 700, 5000]))
        logits = (rng.standard_normal(size) * rng.uniform(0.3, 8)).astype(np.float32)
        if rng.random() < 0.3:
            logits[rng.random(size) < 0.2] = -np.inf  # a grammar's mask
        if rng.random() < 0.3:
            logits = np.round(logits)  # ties at the edge
        p = float(rng.choice([0.05, 0.5, 0.9, 0.95, 0.99, 0.999]))
        np.testing.assert_array_equal(S.top_p_keep(logits, p), reference(logits, p))


def test_top_p_keeps_the_lowest_ids_of_equal_probabilities_at_the_edge():
    logits = np.log(np.array([0.1, 0.2, 0.4, 0.2, 0.1], np.float32))
    assert np.isfinite(masked(logits, top_p=0.5)).tolist() == [False, True, True, False, False]
    assert S.top_p_keep(logits, 0.5).tolist() == [1, 2]


def test_greedy_is_argmax():
    logits = np.array([0.1, 5.0, 4.9], np.float32)
    assert S.sample(logits, SamplingParams(temperature=0), np.random.default_rng()) == 1


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("temperature", 5.0),
     ("max_new_tokens", 0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("temperature", float("nan")),
     ("logprobs", 50), ("stop", [""])],
)
def test_bad_sampling_values_are_rejected(field, value):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value}).validate()


# -- through the engine -------------------------------------------------------------------


def test_same_seed_same_text_different_seed_differs(llama_engine):
    p = dict(max_new_tokens=24, temperature=1.0, top_p=0.95)
    a = llama_engine.generate(["def"], SamplingParams(seed=7, **p))[0].output_ids
    b = llama_engine.generate(["def"], SamplingParams(seed=7, **p))[0].output_ids
    c = llama_engine.generate(["def"], SamplingParams(seed=8, **p))[0].output_ids
    assert a == b and a != c


def test_seeded_sequence_does_not_depend_on_batch_mates(llama_engine):
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3)
    alone = llama_engine.generate(["import os"], params)[0].output_ids
    batch = llama_engine.generate(["import os", "x = 1"], [params, SamplingParams(max_new_tokens=16, seed=4)])
    assert batch[0].output_ids == alone


def test_logprobs_are_log_probabilities_of_the_chosen_tokens(llama_engine):
    seq = llama_engine.generate(["def"], SamplingParams(max_new_tokens=8, temperature=0, logprobs=5, ignore_eos=True))[0]
    assert len(seq.logprobs) == 8
    for tok, lp in zip(seq.output_ids, seq.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        values = [v for _, _, v in lp.top]
        assert values == sorted(values, reverse=True) and len(values) == 5
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert np.exp(values).sum() <= 1 + 1e-5


@pytest.mark.parametrize("params", [dict(temperature=0.8, top_p=0.9), dict(temperature=0, logprobs=3),
                                    dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5),
                                    dict(temperature=0.7, logit_bias={5: -100, 9: 3.0})])
def test_choosing_leaves_the_batchs_logits_untouched(llama_engine, params):
    # A row's logits are a view of the batch's output buffer: a plain row is read in place, a
    # penalized one copied first.
    from llmx.runtime.sequence import Sequence

    seq = Sequence(llama_engine.encode("def f(x):"), SamplingParams(**params), llama_engine.tokenizer, 64)
    seq.output_ids, seq.counts = [5, 7], {5: 1, 7: 1}
    logits = np.random.default_rng(0).standard_normal((2, 320)).astype(np.float32)
    before = logits.copy()
    seq.choose(logits[1])
    if not seq.params.greedy:  # speculative sampling's full distribution (greedy rows never ask)
        seq.probs(logits[1])
    np.testing.assert_array_equal(logits, before)


def test_repetition_penalty_changes_greedy_output(llama_engine):
    base = llama_engine.generate(["x"], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))[0]
    pen = llama_engine.generate(["x"], SamplingParams(max_new_tokens=30, temperature=0, repetition_penalty=5.0, ignore_eos=True))[0]
    assert len(set(pen.output_ids)) >= len(set(base.output_ids))
    assert pen.output_ids != base.output_ids


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_equals_transformers_typical_logits_warper(mass):
    import torch
    from transformers.generation.logits_process import TypicalLogitsWarper

    rng = np.random.default_rng(int(mass * 100))
    cases = [rng.normal(size=320).astype(np.float32) * 3,
             masked(rng.normal(size=320).astype(np.float32), top_k=40),  # -inf entries, as after top-k
             np.repeat(rng.normal(size=40).astype(np.float32), 8)]  # ties at the cut
    for logits in cases:
        ref = TypicalLogitsWarper(mass=mass)(None, torch.from_numpy(logits)[None])[0].numpy()
        ours = masked(logits, typical_p=mass)
        assert np.array_equal(np.isfinite(ours), np.isfinite(ref))
        np.testing.assert_array_equal(ours[np.isfinite(ours)], logits[np.isfinite(ours)])
