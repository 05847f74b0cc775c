"""vLLM's KV block pool with automatic prefix caching, as the emulated engine's pure model uses it.

Semantics follow vLLM V1 (`vllm/v1/core/block_pool.py`, `kv_cache_manager.py`,
`single_type_kv_cache_manager.py` for full attention):

- A full block is keyed by a chained hash: the hash of the previous block's key and the
  block's own tokens (`chain_block_hashes`), so equal keys mean equal prefixes.
- A request's full blocks get their key when the tokens that fill them are *scheduled*
  (vLLM caches in `allocate_slots`, before the step runs). A partial last block is never cached.
- A lookup walks the request's keys from the first and stops at the first miss; it never
  covers the last token (`max_cache_hit_length = num_tokens - 1`), so at least one token is
  prefilled and a hit is whole blocks only.
- A hit block is shared: its reference count counts the requests holding it. A block whose
  count drops to 0 stays cached but free; free cached blocks are evicted least-recently freed
  first, and only when no uncached free block is left (vLLM's free queue keeps uncached blocks
  at its head and appends freed cached blocks at its tail). A request frees its blocks last
  block first, so a prefix outlives its own tail.
- Touching a free cached block (a hit) takes it off the free list, so admission counts it as
  an allocation.

Simplifications (the figures they move are small): a block computed while another request
holds the same key stays uncached (vLLM caches both copies under the key); only
prompt blocks get keys (vLLM also keys blocks full of generated tokens), vLLM's null block is
not reserved, and hashes use Python's `hash` of int tuples (deterministic across processes)
instead of sha256.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = int
"""A block's key: the chained hash of every token up to and including the block."""

_ROOT = 0x5EED
"""The parent key of a prompt's first block (vLLM seeds the chain with NONE_HASH)."""


def chain_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The keys of the full blocks of `token_ids` (a partial last block gets none)."""
    keys: list[BlockHash] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        keys.append(parent)
    return keys


def rechunk_block_hashes(
    hash_ids: Sequence[int], hash_block_tokens: int, prompt_tokens: int, block_size: int
) -> list[BlockHash]:
    """Keys of the engine's full blocks from coarser precomputed block hashes.

    `hash_ids` name consecutive `hash_block_tokens`-token blocks of the prompt, equal ids for
    equal prefixes (Mooncake traces: 512-token blocks). Engine block j covers tokens
    [j*block_size, (j+1)*block_size): its key chains the ids of the hash blocks it overlaps
    and its offset in the first of them, so two prompts share an engine block exactly when
    they share the hash blocks it lies in.
    """
    if hash_block_tokens < 1 or block_size < 1:
        raise ValueError("block sizes must be >= 1")
    covered = min(prompt_tokens, len(hash_ids) * hash_block_tokens)
    keys: list[BlockHash] = []
    parent = _ROOT
    for start in range(0, covered - block_size + 1, block_size):
        first = start // hash_block_tokens
        last = (start + block_size - 1) // hash_block_tokens
        parent = hash((parent, tuple(hash_ids[first : last + 1]), start % hash_block_tokens))
        keys.append(parent)
    return keys


class BlockPool:
    """A fixed pool of KV blocks; with `caching`, full blocks are kept for reuse by key.

    Uncached blocks are counted, not named: only a cached block has an identity (its key)."""

    def __init__(self, num_blocks: int, caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.caching = caching
        self._free_uncached = num_blocks
        self._refs: dict[BlockHash, int] = {}
        """Every cached block's reference count (0 = free, still cached)."""
        self._free_cached: OrderedDict[BlockHash, None] = OrderedDict()
        """Free cached blocks, the next to evict first."""
        self.evictions_total = 0

    # -- state -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: uncached free ones and evictable cached ones."""
        return self._free_uncached + len(self._free_cached)

    @property
    def num_cached(self) -> int:
        return len(self._refs)

    @property
    def num_free_cached(self) -> int:
        return len(self._free_cached)

    def ref_count(self, key: BlockHash) -> int | None:
        """A cached block's reference count, or None if the key is not cached."""
        return self._refs.get(key)

    def eviction_order(self) -> list[BlockHash]:
        """The free cached blocks, the next to evict first."""
        return list(self._free_cached)

    # -- lookups and allocation --------------------------------------------------------------

    def longest_hit(self, keys: Sequence[BlockHash], num_tokens: int, block_size: int) -> int:
        """How many leading blocks of `keys` are cached, never covering the last token."""
        if not self.caching:
            return 0
        limit = min(len(keys), (num_tokens - 1) // block_size)
        refs = self._refs
        hit = 0
        while hit < limit and keys[hit] in refs:
            hit += 1
        return hit

    def blocks_to_allocate(self, hit_keys: Sequence[BlockHash], num_new: int) -> int:
        """Free blocks an admission takes: `num_new` fresh ones plus the hits now free."""
        refs = self._refs
        return num_new + sum(1 for key in hit_keys if refs[key] == 0)

    def touch(self, keys: Iterable[BlockHash]) -> None:
        """Take a reference on cached blocks (a hit); free ones leave the free list."""
        refs = self._refs
        free_cached = self._free_cached
        for key in keys:
            count = refs[key]
            if count == 0:
                del free_cached[key]
            refs[key] = count + 1

    def allocate(self, num_blocks: int) -> None:
        """Take `num_blocks` uncached blocks, evicting the least recently freed cached ones
        when no uncached free block is left. The caller checked `num_free`."""
        if num_blocks > self.num_free:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free} free")
        from_uncached = min(num_blocks, self._free_uncached)
        self._free_uncached -= from_uncached
        refs = self._refs
        free_cached = self._free_cached
        for _ in range(num_blocks - from_uncached):
            key, _none = free_cached.popitem(last=False)
            del refs[key]
            self.evictions_total += 1

    def cache(self, key: BlockHash) -> bool:
        """Give one of the caller's uncached blocks, just filled, the key `key`.

        If a free block already has the key (a prompt recomputing its last cached block),
        the caller's copy takes the key and the old copy becomes an uncached free block: vLLM
        keeps both copies under the key, and the key lives as long as the newer one.
        False (the block stays uncached) when a block in use has the key or caching is off."""
        if not self.caching:
            return False
        count = self._refs.get(key)
        if count is not None:
            if count > 0:
                return False
            del self._free_cached[key]
            self._free_uncached += 1
        self._refs[key] = 1
        return True

    def free(self, cached_keys: Sequence[BlockHash], num_uncached: int) -> None:
        """Release a request's blocks: its cached ones (in block order) and its uncached ones.

        As vLLM, the last block is released first, so it is evicted before its prefix."""
        self._free_uncached += num_uncached
        refs = self._refs
        free_cached = self._free_cached
        for key in reversed(cached_keys):
            count = refs[key] - 1
            refs[key] = count
            if count == 0:
                free_cached[key] = None
