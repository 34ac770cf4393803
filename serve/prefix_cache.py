"""Prefix caching: a request whose prompt begins with tokens whose KV the server still holds
(the same system prompt, the earlier turns of a chat) skips prefill for them.

    prompt:  | block 0 | block 1 | block 2 | rest |        blocks of BLOCK tokens
    key(i) = hash(key(i-1), tokens of block i)            a key names the whole prefix up to it

KV is kept per block of ``block`` tokens under a key that chains the block's tokens with its
predecessor's key (as vLLM's automatic prefix caching does), so a hit means the entire prefix
up to that block is the same. A lookup walks the prompt block by block until the first miss,
always leaving at least one prompt token to compute (its logits choose the first new token).
The scheduler copies the blocks found into a fresh row and runs only the rest of the prompt
(``ChunkedPrefill`` continuing on the decode graph).

Blocks go in when a prompt's prefill completes and when a sequence leaves its batch row (its
generated tokens too: the next turn of a chat starts with them). Memory is bounded by
``max_bytes``; the least recently used blocks go first. Each use refreshes a chain from its
last block to its first, so a chain is evicted tail first and never keeps a tail it cannot
reach. Only the scheduler thread touches it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

BLOCK = 16
DEFAULT_CAP_BYTES = 256 << 20


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
        self._blocks: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()  # least recently used first
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
        if not found:
            return None
        self._refresh(found)
        parts = [self._blocks[k] for k in found]
        entries = [np.concatenate([p[b] for p in parts], axis=1) for b in range(len(parts[0]))]
        return len(found) * self.block, entries

    def insert(self, tokens: list[int], cache, row: int) -> int:
        """Keep the KV of every full block of ``tokens`` (whose KV fills row ``row`` of
        ``cache`` from slot 0) that is not cached yet; returns how many blocks were added."""
        keys = self.keys(tokens, min(len(tokens), int(cache.lengths[row])) // self.block)
        added = 0
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            entries = cache.read(row, i * self.block, (i + 1) * self.block)
            size = sum(e.nbytes for e in entries)
            if size > self.max_bytes:
                return added
            self._blocks[key] = entries
            self.nbytes += size
            added += 1
        self._refresh(keys)
        self._evict()
        return added

    def _refresh(self, chain: list[bytes]) -> None:
        for key in reversed(chain):  # the first block ends most recent: evicted last
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self._blocks:
            _, entries = self._blocks.popitem(last=False)
            self.nbytes -= sum(e.nbytes for e in entries)
            self.evictions += 1
