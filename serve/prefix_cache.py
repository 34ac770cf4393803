"""Prefix caching: a request whose prompt begins with tokens whose KV the server still holds
(the same system prompt, the earlier turns of a chat) skips prefill for them.

    prompt:  | block 0 | block 1 | block 2 | rest |        blocks of BLOCK tokens
    key(i) = hash(key(i-1), tokens of block i)            a key names the whole prefix up to it

KV is kept per block of ``block`` tokens under a key that chains the block's tokens with its
predecessor's key (as vLLM's automatic prefix caching does), so a hit means the entire prefix
up to that block is the same. A lookup walks the prompt block by block until the first miss,
then takes the longest common start of the missed block among the cached blocks that follow the
same prefix (a block's first n slots depend only on the tokens up to them), always leaving at
least one prompt token to compute (its logits choose the first new token). Token-granular reuse
matters for chat: requests share the template and system prompt up to the user's text, which
rarely ends on a block boundary (SmolLM2's template: 16 of ~28 shared tokens by whole blocks),
and llama-server reuses a slot's cached prompt to the token.
The scheduler copies the blocks found into a fresh row and runs only the rest of the prompt
(``ChunkedPrefill`` continuing on the decode graph).

Blocks go in when a prompt's prefill completes and when a sequence leaves its batch row (its
generated tokens too: the next turn of a chat starts with them). Memory is bounded by
``max_bytes``; the least recently used blocks go first. Each use refreshes a chain from its
last block to its first, so a chain is evicted tail first and never keeps a tail it cannot
reach. Only the scheduler thread touches it.

Blocks live in slots of one array per cache buffer, ``max_bytes`` in all, which the server
reserves (allocates and touches) when its engine loads, as llama-server reserves its KV cache:
its memory after start-up is its memory under load, instead of growing as the cache fills (+11 %
after a 200-request burst on load_test.py's small model). An evicted block's slot takes the
next one; nothing is allocated per block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

BLOCK = 16
DEFAULT_CAP_BYTES = 256 << 20


class _Block(NamedTuple):
    parent: bytes  # the key of the prefix before this block (b"" for the first)
    tokens: np.ndarray  # its token ids, for partial matches
    slot: int  # where its KV is: one [kv_heads, block, head_dim] slot per cache buffer


def default_bytes(manifest, max_batch: int) -> int:
    """The default bound: the KV of ``max_batch`` full-context sequences (what the batch itself
    may hold), at most 256 MiB. It scales with the model, so a small model's cache no longer
    outweighs the model (the demo model: 25 MB, not 256), and a large one's stays bounded."""
    kv = manifest.kv
    per_token = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * np.dtype(kv.dtype).itemsize
    return min(DEFAULT_CAP_BYTES, max_batch * manifest.max_seq_len * per_token)


class PrefixCache:
    def __init__(self, max_bytes: int, block: int = BLOCK):
        if block < 1:
            raise ValueError("block must be >= 1")
        self.max_bytes, self.block = max_bytes, block
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        # (a prefix's key, a first token) -> the cached blocks after that prefix starting with it:
        # a partial match needs the first token, and so a lookup scans only blocks that have it.
        self._children: dict[tuple[bytes, int], set[bytes]] = {}
        self._slots: list[np.ndarray] = []  # per cache buffer: [slots, kv_heads, block, head_dim]
        self._free: list[int] = []  # slots holding no block, the next one taken last
        self.block_bytes = 0
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self, tokens: list[int], blocks: int) -> list[bytes]:
        """Chained keys of the first ``blocks`` full blocks of ``tokens``."""
        keys, key = [], b""
        for i in range(blocks):
            chunk = np.asarray(tokens[i * self.block : (i + 1) * self.block], dtype=np.int64)
            key = hashlib.blake2b(key + chunk.tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def lookup(self, prompt: list[int]) -> tuple[int, list[np.ndarray]] | None:
        """(cached tokens, KV entries [kv_heads, cached, head_dim] per cache buffer) for the
        longest cached prefix of ``prompt`` short of its last token; None on a miss."""
        found = []
        for key in self.keys(prompt, (len(prompt) - 1) // self.block):
            if key not in self._blocks:
                break
            found.append(key)
        start = len(found) * self.block
        want = prompt[start : min(start + self.block, len(prompt) - 1)]
        part, partial = self._partial(found[-1] if found else b"", want)
        chain = found + ([part] if partial else [])
        if not chain:
            return None
        self._refresh(chain)
        parts = [self._entries(k) for k in found]
        if partial:
            parts.append([e[:, :partial] for e in self._entries(part)])
        entries = [np.concatenate([p[b] for p in parts], axis=1) for b in range(len(parts[0]))]
        return start + partial, entries

    def _partial(self, parent: bytes, want: list[int]) -> tuple[bytes | None, int]:
        """The cached block after ``parent`` whose tokens start like ``want`` the longest."""
        best, length = None, 0
        if not want:
            return best, length
        want_arr = np.asarray(want, dtype=np.int64)
        for key in self._children.get((parent, int(want_arr[0])), ()):
            # a cached block is full, so never shorter than ``want``
            differ = np.flatnonzero(self._blocks[key].tokens[: len(want_arr)] != want_arr)
            common = int(differ[0]) if differ.size else len(want_arr)
            if common > length:
                best, length = key, common
        return best, length

    def insert(self, tokens: list[int], cache, row: int) -> int:
        """Keep the KV of every full block of ``tokens`` (whose KV fills row ``row`` of
        ``cache`` from slot 0) that is not cached yet; returns how many blocks were added. A
        chain longer than the cache keeps its start (a tail without it is unreachable)."""
        keys = self.keys(tokens, min(len(tokens), int(cache.lengths[row])) // self.block)
        self._refresh(keys)  # the chain's cached blocks are evicted last, after every other chain's
        added, chain = 0, set(keys)
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            entries = cache.read(row, i * self.block, (i + 1) * self.block)
            slot = self._slot(entries, chain)
            if slot is None:
                break
            for array, value in zip(self._slots, entries):
                array[slot] = value
            parent = keys[i - 1] if i else b""
            chunk = np.asarray(tokens[i * self.block : (i + 1) * self.block], dtype=np.int64)
            self._blocks[key] = _Block(parent, chunk, slot)
            self._children.setdefault((parent, int(chunk[0])), set()).add(key)
            self.nbytes += self.block_bytes
            added += 1
        self._refresh(keys)
        return added

    def reserve(self, cache) -> int:
        """Allocate every slot and touch its pages now, for the layout of ``cache`` (an empty
        cache of the server's backend, a block long or more); returns the bytes reserved."""
        if not self._slots and not self._allocate(cache.read(0, 0, self.block)):
            return 0
        for array in self._slots:
            array.fill(0)
        return sum(array.nbytes for array in self._slots)

    def _allocate(self, entries: list[np.ndarray]) -> bool:
        """Slot arrays for blocks shaped like ``entries``; False if not one block fits."""
        self.block_bytes = sum(e.nbytes for e in entries)
        count = self.max_bytes // self.block_bytes
        if count:
            self._slots = [np.empty((count, *e.shape), e.dtype) for e in entries]
            self._free = list(range(count - 1, -1, -1))  # slot 0 first; an evicted slot is reused next
        return count > 0

    def _entries(self, key: bytes) -> list[np.ndarray]:
        slot = self._blocks[key].slot
        return [array[slot] for array in self._slots]

    def _slot(self, entries: list[np.ndarray], keep: set[bytes]) -> int | None:
        """A slot for a block of ``entries``: a free one, else the least recently used block's
        unless it is in ``keep``; None if there is none."""
        if not self._slots and not self._allocate(entries):
            return None
        if self._free:
            return self._free.pop()
        oldest = next(iter(self._blocks), None)
        if oldest is None or oldest in keep:
            return None
        self._evict(oldest)
        return self._free.pop()

    def _refresh(self, chain: list[bytes]) -> None:
        for key in reversed(chain):  # the first block ends most recent: evicted last
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _evict(self, key: bytes) -> None:
        block = self._blocks.pop(key)
        index = (block.parent, int(block.tokens[0]))
        self._children[index].discard(key)
        if not self._children[index]:
            del self._children[index]
        self._free.append(block.slot)
        self.nbytes -= self.block_bytes
        self.evictions += 1
