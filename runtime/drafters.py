"""Where speculative drafts come from: the text itself (prompt lookup) or a smaller model.

Both answer ``propose(seqs, limits)`` for the rows of a batch: up to ``limits[i]`` tokens that
sequence i may continue with. A draft model also keeps a KV cache whose rows follow the
batch's (``start`` when a sequence joins, ``move`` when compaction moves a row, ``sync``
after verification drops rejected tokens).

- ``NgramDrafter`` (prompt lookup, as transformers' ``prompt_lookup_num_tokens`` and vLLM's
  ``ngram``): find the most recent earlier occurrence of the context's last n tokens (n from
  ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it. No second model;
  it shines where output copies its input (code editing, quoting, templated text).
- ``DraftModelDrafter``: a smaller artifact with the same tokenizer runs ``k`` cheap decode
  steps; for sampled sequences it also returns its distributions q, which the rejection rule needs.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from llmx.artifact.handle import Artifact
from llmx.errors import InputError
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import softmax, warp
from llmx.runtime.sequence import Sequence
from llmx.runtime.speculative import Draft, SpecStats, check_num_draft_tokens, draw, ragged_decode


def context_ids(seq: Sequence) -> list[int]:
    """Prompt and output so far; the last output token is sampled but not yet in the KV cache."""
    return seq.prompt_ids + seq.output_ids


class NgramDrafter:
    name = "ngram"

    def __init__(self, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise InputError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.stats = SpecStats()

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        return [Draft(self.lookup(np.asarray(context_ids(s), dtype=np.int64), k) if k > 0 else []) for s, k in zip(seqs, limits)]

    def lookup(self, ids: np.ndarray, k: int) -> list[int]:
        """The ``k`` tokens after the latest earlier match of the longest matching suffix.

        A match ``p`` tokens back says the text repeats with period ``p``; when the tokens after
        the match run out (they reach the end of the context), the draft keeps repeating them,
        so a loop or a repeated line is drafted ``k`` tokens at a time, not one."""
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(ids[:-1], n)  # every n-gram but the suffix itself
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                follow = ids[int(hits[-1]) + n :]  # non-empty: the match ends before the suffix
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


def check_same_tokenizer(target, draft) -> None:
    """A draft model must spell every token id the same way as the target, or its drafts are noise."""
    if target.vocab() != draft.vocab():
        raise InputError("the draft model's tokenizer differs from the target's (different vocabulary); "
                         "speculative decoding needs a draft with the same tokenizer")
    if sorted(target.eos_token_ids) != sorted(draft.eos_token_ids):
        raise InputError(f"the draft model's end tokens {draft.eos_token_ids} differ from the target's {target.eos_token_ids}")


class DraftModelDrafter:
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



def check_speculative(method: str, draft: str | None, num_tokens: int) -> None:
    check_num_draft_tokens(num_tokens)
    if method not in ("ngram", "draft"):
        raise InputError(f"speculative method must be ngram or draft, got {method!r}")
    if method == "ngram" and draft is not None:
        raise InputError("--draft is for --speculative draft; prompt lookup (ngram) needs no draft model")
    if method == "draft":
        if draft is None:
            raise InputError("--speculative draft needs --draft ARTIFACT (a smaller model with the same tokenizer)")
        Artifact.of(draft)  # a wrong path fails now, with the artifact error


def make_drafter(method: str, target, num_tokens: int = 4, draft: str | None = None, **load_options):
    """The drafter ``llmx generate --speculative`` and ``llmx serve --speculative`` ask for."""
    check_speculative(method, draft, num_tokens)
    if method == "ngram":
        return NgramDrafter(num_tokens)
    engine = Engine.load(draft, **load_options)
    check_same_tokenizer(target.tokenizer, engine.tokenizer)
    return DraftModelDrafter(engine, target.manifest.model.vocab_size, num_tokens)
