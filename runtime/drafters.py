"""Where speculative drafts come from: the text itself (prompt lookup) or a smaller model.

Both answer ``propose(seqs, limits)`` for the rows of a batch: up to ``limits[i]`` tokens that
sequence i may continue with. A draft model also keeps a KV cache whose rows follow the
batch's (``start`` when a sequence joins, ``move`` when compaction moves a row, ``sync``
after verification drops rejected tokens).

- ``NgramDrafter`` (prompt lookup, as transformers' ``prompt_lookup_num_tokens`` and vLLM's
  ``ngram``): find the most recent earlier occurrence of the context's last n tokens (n from
  ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it. No second model;
  it shines where output copies its input (code editing, quoting, templated text).
- ``AutoDrafter`` (the default of ``llmx generate`` and ``llmx serve``): prompt lookup that drafts
  only where it pays. It drafts for a batch of one row (on several rows a wider call costs about
  as much as that many plain steps: 1.9x for 2 tokens on 2 rows of the 135M fp32 here), sizes each draft to the
  row's measured acceptance against this machine's measured cost of a wider call, and stops while
  acceptance is too low to pay, coming back as its estimate drifts back. It never refuses a request.
- ``DraftModelDrafter``: a smaller artifact with the same tokenizer runs ``k`` cheap decode
  steps; for sampled sequences it also returns its distributions q, which the rejection rule needs.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.errors import InputError
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import draw, softmax, warp
from llmx.runtime.sequence import Sequence
from llmx.runtime.speculative import Draft, SpecStats, check_num_draft_tokens, ragged_decode


log = logging.getLogger(__name__)
_WIDTH_INVARIANT: "weakref.WeakKeyDictionary[object, bool]" = weakref.WeakKeyDictionary()


def context_ids(seq: Sequence) -> list[int]:
    """Prompt and output so far; the last output token is sampled but not yet in the KV cache."""
    return seq.prompt_ids + seq.output_ids


class FixedDrafter:
    """What a batch asks of every drafter; these draft whenever they can and learn nothing."""

    optional = False  # an explicit choice: refusals (LongRoPE crossings) are the user's to see

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows`` rows fed ``width`` tokens each took ``seconds``."""

    def verified(self, seq: Sequence, drafted: int, kept: int) -> None:
        """``seq``'s draft of ``drafted`` tokens kept ``kept``."""


class NgramDrafter(FixedDrafter):
    name = "ngram"

    def __init__(self, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise InputError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.stats = SpecStats()

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        return [Draft(self.lookup(np.asarray(context_ids(s), dtype=np.int64), k) if k > 0 else []) for s, k in zip(seqs, limits)]

    def lookup(self, ids: np.ndarray, k: int, shortest: int | None = None) -> list[int]:
        """The ``k`` tokens after the latest earlier match of the longest matching suffix.

        A match ``p`` tokens back says the text repeats with period ``p``; when the tokens after
        the match run out (they reach the end of the context), the draft keeps repeating them,
        so a loop or a repeated line is drafted ``k`` tokens at a time, not one."""
        last = len(ids) - 1
        longest, shortest = min(self.max_ngram, last), shortest or self.min_ngram
        if longest < shortest:
            return []
        # ends[n - 1][j]: ids[j - n + 1 .. j] equals the suffix's last n tokens (j < last, so
        # never the suffix itself). Each length extends the shorter one by one comparison: this
        # runs before every decode step, where sliding windows cost 0.2 ms a step in Python.
        ends = [ids[:last] == ids[last]]
        for n in range(2, longest + 1):
            ends.append(ends[-1][1:] & (ids[: last - n + 1] == ids[last - n + 1]))
        for n in range(longest, shortest - 1, -1):
            hits = np.flatnonzero(ends[n - 1])
            if len(hits):
                follow = ids[int(hits[-1]) + n :]  # starts after the match's end (mask index + n - 1)
                return np.resize(follow, k).tolist() if len(follow) < k else follow[:k].tolist()
        return []

    # A lookup drafter has no per-row state.
    def reset(self, rows: int) -> None:
        pass

    def start(self, rows: list[int], seqs: list[Sequence]) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def sync(self, row: int, length: int) -> None:
        pass


class AutoDrafter(NgramDrafter):
    """Prompt lookup sized by expected gain: with a row's acceptance estimate ``a`` (each drafted
    token kept with probability a, independently), a draft of k tokens emits on average
    (1 - a^(k+1)) / (1 - a) tokens in a call that costs cost(1 + k) / cost(1) plain steps; the k
    with the best ratio wins, and none is drafted unless that ratio beats a plain step by
    ``MARGIN``. Costs are measured step times of a one-row batch (past the widest measured width,
    ``PRIOR_SLOPE`` per token, and at most ``REACH`` tokens further); ``a`` follows the row's
    outcomes and, while it does not draft, drifts back to ``PRIOR`` so a row that starts copying
    again is tried again."""

    name = "auto"
    optional = True
    PRIOR, LEARN, DRIFT, MARGIN = 0.6, 0.3, 0.02, 1.05
    # Past the widest measured width a call costs 0.25 plain steps per extra token (135M on this
    # CPU: fp32 0.12-0.29, w4 0.34-0.47), and a draft may reach at most REACH tokens past it, so
    # wide calls are tried only after narrower ones paid off, and measured before they are trusted.
    PRIOR_SLOPE, REACH = 0.25, 2
    MAX_ROWS = 1

    def __init__(self, num_tokens: int = 8, backend=None):
        # A 1-token match is mostly chance in prose, a 2-token one too until the row copies (propose).
        super().__init__(num_tokens, max_ngram=3, min_ngram=2)
        self.seconds: dict[int, float] = {}  # one-row step time per width, a moving average
        self._warmed: set[int] = set()  # widths run once (their first run is not timed)
        self.acceptance: dict[int, float] = {}  # per sequence id
        self.copying: set[int] = set()  # sequence ids that have kept a drafted token
        self._backend = backend
        self.identical: bool | None = None if backend is not None else True  # probed on first use

    def width_invariant(self) -> bool:
        """Whether a call of several tokens gives the first token the logits a one-token call
        gives (within 1e-4 of their range). Quantized graphs may not: ONNX Runtime's attention
        kernel differs in the last bits between one and several query tokens (3e-8 at the first
        layer of a 135M model), which fp32 carries to the logits as 3e-5 of their range, but
        MatMulNBits rounds its activations to int8 and a last-bit change flips a rounding, so it
        grows to 2 % of the range on the 135M w4 graph; a near tie could go the other way and
        output would differ from plain decoding. The default must not change output, so there it
        does not draft."""
        if self.identical is None:
            known = _WIDTH_INVARIANT.get(self._backend)
            room = self._backend.max_seq_len - 2
            # Two shapes: kernels pick their paths by shape. Once per backend (a server's lifetime).
            self.identical = known if known is not None else all(self._same_logits(min(n, room)) for n in (4, 24))
            _WIDTH_INVARIANT[self._backend] = self.identical
            if not self.identical and known is None:
                log.info("speculative auto: this artifact's kernels round a several-token call differently from a "
                         "one-token one, so auto does not draft (output stays that of plain decoding); "
                         "--speculative ngram drafts anyway")
        return self.identical

    def observe(self, rows: int, width: int, seconds: float) -> None:
        if rows != 1:
            return
        if width not in self._warmed:
            # ONNX Runtime's first run at a new shape allocates its buffers (several times a
            # step's cost on a busy box): taken as the width's cost, it would price that width
            # out for good, since a width deemed too dear is never run, so never re-measured.
            self._warmed.add(width)
            return
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else old + self.LEARN * (seconds - old)

    def verified(self, seq: Sequence, drafted: int, kept: int) -> None:
        if kept:
            self.copying.add(seq.id)
        a = self.acceptance.get(seq.id, self.PRIOR)
        for outcome in [1.0] * kept + ([0.0] if kept < drafted else []):
            a += self.LEARN * (outcome - a)
        self.acceptance[seq.id] = a

    def cost(self, width: int) -> float:
        """A one-row call of ``width`` tokens, in plain steps: measured, interpolated between
        measured widths, or past the widest measured one at the optimistic prior slope."""
        base = self.seconds.get(1)
        if not base:
            return 1 + self.PRIOR_SLOPE * (width - 1)
        known = sorted(self.seconds)
        below = max(w for w in known if w <= width)
        above = [w for w in known if w >= width]
        if not above:
            return self.seconds[below] / base + self.PRIOR_SLOPE * (width - below)
        hi = above[0]
        if hi == below:
            return self.seconds[hi] / base
        t = (width - below) / (hi - below)
        return (self.seconds[below] + t * (self.seconds[hi] - self.seconds[below])) / base

    def best_length(self, a: float, limit: int) -> int:
        limit = min(limit, max(self.seconds, default=1) - 1 + self.REACH)
        gains = [(1 - a ** (k + 1)) / (1 - a) / self.cost(k + 1) if a < 1 else (k + 1) / self.cost(k + 1)
                 for k in range(limit + 1)]
        k = max(range(limit + 1), key=gains.__getitem__)
        return k if gains[k] > self.MARGIN else 0

    def _same_logits(self, context: int) -> bool:
        backend = self._backend
        vocab = min(getattr(backend, "vocab_size", 1000), 32000)
        ids = [(7919 * i) % vocab for i in range(1, context + 3)]  # spread over the vocabulary, fixed
        cache = backend.new_cache(1, context + 2)
        backend.prefill(cache, [0], [ids[:context]])
        one = backend.decode(cache, np.array([ids[context:context + 1]], dtype=np.int64))[0, 0].copy()
        cache.lengths[0] = context
        two = backend.decode(cache, np.array([ids[context:context + 2]], dtype=np.int64))[0, 0]
        return bool(np.abs(one - two).max() <= 1e-4 * max(1.0, float(one.max() - one.min())))

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        if len(seqs) > self.MAX_ROWS or not self.width_invariant():
            return [Draft([]) for _ in seqs]
        self.acceptance = {s.id: self.acceptance.get(s.id, self.PRIOR) for s in seqs}  # forget rows that left
        self.copying &= self.acceptance.keys()
        drafts = []
        for seq, limit in zip(seqs, limits):
            a = self.acceptance[seq.id]
            # Most plain-chat steps have no match: look first, size the draft only for a match
            # (a lookup of `limit` tokens cut to k is the lookup of k tokens). Two-token matches
            # are common in prose by chance: they count once the row has kept a draft.
            shortest = self.min_ngram if seq.id in self.copying else self.max_ngram
            tokens = self.lookup(np.asarray(context_ids(seq), dtype=np.int64), limit, shortest) if limit else []
            tokens = tokens[: self.best_length(a, limit)] if tokens else []
            if not tokens:
                self.acceptance[seq.id] = a + self.DRIFT * (self.PRIOR - a)
            drafts.append(Draft(tokens))
        return drafts


def check_same_tokenizer(target, draft) -> None:
    """A draft model must spell every token id the same way as the target, or its drafts are noise."""
    if target.vocab() != draft.vocab():
        raise InputError("the draft model's tokenizer differs from the target's (different vocabulary); "
                         "speculative decoding needs a draft with the same tokenizer")
    if sorted(target.eos_token_ids) != sorted(draft.eos_token_ids):
        raise InputError(f"the draft model's end tokens {draft.eos_token_ids} differ from the target's {target.eos_token_ids}")


class DraftModelDrafter(FixedDrafter):
    name = "draft"

    def __init__(self, draft_engine, target_vocab: int, num_tokens: int = 4):
        self.backend, self.num_tokens, self.vocab = draft_engine.backend, num_tokens, target_vocab
        self.cache = None
        self.stats = SpecStats()

    def reset(self, rows: int) -> None:
        """A fresh KV cache with one row per row of the batch being drafted for."""
        self.cache = self.backend.new_cache(rows, min(256, self.backend.max_seq_len))

    def start(self, rows: list[int], seqs: list[Sequence]) -> None:
        """Prefill the draft model with new sequences' prompts (their first token is caught up later)."""
        fits = [(r, s) for r, s in zip(rows, seqs) if len(s.prompt_ids) < self.backend.max_seq_len]
        if fits:
            self.backend.prefill(self.cache, [r for r, _ in fits], [s.prompt_ids for _, s in fits])

    def move(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        self.cache.lengths[src] = 0

    def sync(self, row: int, length: int) -> None:
        """The target kept ``length`` tokens of this row: drop the draft's rejected ones."""
        self.cache.lengths[row] = min(int(self.cache.lengths[row]), length)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        n, k = len(seqs), max(limits, default=0)
        catch_up = [context_ids(s)[int(self.cache.lengths[i]):] for i, s in enumerate(seqs)]
        room = self.backend.max_seq_len - max(int(self.cache.lengths[i]) + len(c) for i, c in enumerate(catch_up))
        k = min(k, room + 1)  # the last draft token is sampled, never fed
        if k <= 0 or any(not c for c in catch_up):
            return [Draft([]) for _ in seqs]
        logits = np.stack([rows[-1] for rows in ragged_decode(self.backend, self.cache, catch_up)])
        drafts = [Draft([], None if s.params.greedy else []) for s in seqs]
        for step in range(k):
            if step:
                fed = np.array([[d.tokens[-1]] for d in drafts], dtype=np.int64)
                logits = self.backend.decode(self.cache, fed)[:, 0]
            for seq, draft, row in zip(seqs, drafts, self._target_vocab(logits)):
                self._pick(seq, draft, row)
        return [Draft(d.tokens[:lim], None if d.probs is None else d.probs[:lim]) for d, lim in zip(drafts, limits[:n])]

    def _target_vocab(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits over the target's token ids (models of one tokenizer may pad their vocabularies differently)."""
        if logits.shape[-1] >= self.vocab:
            return logits[:, : self.vocab]
        pad = np.full((logits.shape[0], self.vocab - logits.shape[-1]), -np.inf, np.float32)
        return np.concatenate([logits, pad], axis=1)

    def _pick(self, seq: Sequence, draft: Draft, logits: np.ndarray) -> None:
        if draft.probs is None:
            draft.tokens.append(int(np.argmax(logits)))
            return
        q = softmax(warp(logits.astype(np.float32), seq.params))
        draft.tokens.append(draw(q, seq.rng))
        draft.probs.append(q)



METHODS = ("auto", "ngram", "draft", "off")
EXPLICIT = ("ngram", "draft")  # asked for by name: they draft for every request; auto and off ask nothing of one
DEFAULT_DRAFT_TOKENS = {"auto": 8, "ngram": 4, "draft": 4}  # auto's is a cap: its drafts are sized as they go


def check_speculative(method: str, draft: str | None, num_tokens: int | None) -> None:
    if method not in METHODS:
        raise InputError(f"speculative method must be one of {', '.join(METHODS)}, got {method!r}")
    if num_tokens is not None:
        check_num_draft_tokens(num_tokens)
    if method != "draft" and draft is not None:
        raise InputError(f"--draft is for --speculative draft; {method} needs no draft model")
    if method == "draft":
        if draft is None:
            raise InputError("--speculative draft needs --draft ARTIFACT (a smaller model with the same tokenizer)")
        Artifact.of(draft)  # a wrong path fails now, with the artifact error


def make_drafter(method: str, target, num_tokens: int | None = None, draft: str | None = None, **load_options):
    """The drafter ``llmx generate --speculative`` and ``llmx serve --speculative`` ask for
    (None for off)."""
    check_speculative(method, draft, num_tokens)
    if method == "off":
        return None
    num_tokens = num_tokens or DEFAULT_DRAFT_TOKENS[method]
    if method == "auto":
        return AutoDrafter(num_tokens, target.backend)
    if method == "ngram":
        return NgramDrafter(num_tokens)
    engine = Engine.load(draft, **load_options)
    check_same_tokenizer(target.tokenizer, engine.tokenizer)
    return DraftModelDrafter(engine, target.manifest.model.vocab_size, num_tokens)
