"""The gateway's locality index: an approximation, without a tokenizer, of what each replica
(engine endpoint) of a pool holds in its prefix cache, and the replica choice built on it
(D²LPM, Cao et al. 2025: the longest match unless that replica is loaded beyond a limit).

A prompt is cut into fixed-size byte blocks of its rendered text; block i is named by the
hash of every byte up to the end of block i (chained), so equal names mean equal prefixes, as
in vLLM's automatic prefix caching. Each replica keeps an LRU of block names sized to its KV
capacity in blocks (`replica_kv_tokens` / tokens per block, tokens per block from the
estimator's bytes per token). Routing a request to a replica touches its blocks there, the
first block last, so that eviction takes the tail of a prompt before its head (vLLM frees a
request's blocks in reverse order for the same reason).

What the index predicts is compared with what the engines report (`vllm:prefix_cache_hits_total`,
read by extproc.service.locality_feedback): `describe()` has both, per replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

from extproc.policy.model import Locality, Pool
from extproc.policy.runtime import Policy


def prefix_blocks(data: bytes, block_bytes: int) -> tuple[int, ...]:
    """The chained names of the full `block_bytes` blocks of `data` (a partial last block is
    not cached by an engine either)."""
    digest = blake2b(digest_size=8)
    view = memoryview(data)
    names: list[int] = []
    for end in range(block_bytes, len(data) + 1, block_bytes):
        digest.update(view[end - block_bytes : end])
        names.append(int.from_bytes(digest.copy().digest(), "little"))
    return tuple(names)


def render_prompt(texts: Sequence[str], tools_json: str = "") -> bytes:
    """The bytes the blocks are cut from: tools first (chat templates put them before the
    messages), then every text, each ended by a separator so that moving a boundary changes
    the names."""
    parts = [tools_json, *texts] if tools_json else list(texts)
    return "\x1e".join(parts).encode()


class ReplicaCache:
    """One replica's cached block names, least recently used first."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of `blocks` are cached here."""
        cached = self._blocks
        count = 0
        for name in blocks:
            if name not in cached:
                break
            count += 1
        return count

    def insert(self, blocks: Sequence[int]) -> None:
        cached = self._blocks
        for name in reversed(blocks):
            if name in cached:
                cached.move_to_end(name)
            else:
                cached[name] = None
        while len(cached) > self.capacity:
            cached.popitem(last=False)

    def resize(self, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class PoolLocality:
    """The replicas of one pool: their caches, the requests in flight on each, and what was
    predicted and reported about their hits."""

    def __init__(self, endpoints: Sequence[str], kv_tokens: int, tokens_per_block: float) -> None:
        self.endpoints = tuple(endpoints)
        self.kv_tokens = kv_tokens
        self.tokens_per_block = tokens_per_block
        self.caches = [ReplicaCache(self._capacity()) for _ in self.endpoints]
        self.inflight = [0] * len(self.endpoints)
        self.routed = [0] * len(self.endpoints)
        self.predicted_hit_tokens = [0.0] * len(self.endpoints)
        self.predicted_query_tokens = [0.0] * len(self.endpoints)
        self.engine_hit_tokens = [0.0] * len(self.endpoints)
        self.engine_query_tokens = [0.0] * len(self.endpoints)

    def _capacity(self) -> int:
        return int(self.kv_tokens / self.tokens_per_block)

    def set_tokens_per_block(self, tokens_per_block: float) -> None:
        self.tokens_per_block = tokens_per_block
        for cache in self.caches:
            cache.resize(self._capacity())

    def longest_match(self, blocks: Sequence[int]) -> int:
        """The most leading blocks any replica holds."""
        if not blocks:
            return 0
        return max(cache.match(blocks) for cache in self.caches)

    def choose(self, blocks: Sequence[int], load_slack: int) -> tuple[int, int]:
        """(replica, its matched blocks): the longest match (ties: fewer in flight, then fewer
        routed so far, then the first), unless it has `load_slack` or more requests in flight
        above the least-loaded replica: then the least-loaded."""
        inflight, routed = self.inflight, self.routed
        matches = [cache.match(blocks) for cache in self.caches]
        best = min(range(len(matches)), key=lambda r: (-matches[r], inflight[r], routed[r], r))
        least = min(range(len(inflight)), key=lambda r: (inflight[r], -matches[r], r))
        if inflight[best] >= inflight[least] + load_slack:
            best = least
        return best, matches[best]

    def route(self, blocks: Sequence[int], input_tokens: int, load_slack: int) -> int:
        """Choose the replica for an admitted request and note that it now holds its blocks."""
        replica, matched = self.choose(blocks, load_slack)
        self.caches[replica].insert(blocks)
        self.inflight[replica] += 1
        self.routed[replica] += 1
        self.predicted_hit_tokens[replica] += min(
            float(input_tokens), matched * self.tokens_per_block
        )
        self.predicted_query_tokens[replica] += float(input_tokens)
        return replica

    def finished(self, replica: int) -> None:
        if 0 <= replica < len(self.inflight) and self.inflight[replica] > 0:
            self.inflight[replica] -= 1

    def engine_reported(self, replica: int, query_tokens: float, hit_tokens: float) -> None:
        """Increments of the engine's prefix-cache counters (tokens) since its last report."""
        self.engine_query_tokens[replica] += max(0.0, query_tokens)
        self.engine_hit_tokens[replica] += max(0.0, hit_tokens)

    def describe(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for r, endpoint in enumerate(self.endpoints):
            predicted, reported = self.predicted_hit_tokens[r], self.engine_hit_tokens[r]
            rows.append(
                {
                    "endpoint": endpoint,
                    "inflight": self.inflight[r],
                    "routed": self.routed[r],
                    "cached_blocks": len(self.caches[r]),
                    "capacity_blocks": self.caches[r].capacity,
                    "predicted_hit_tokens": predicted,
                    "predicted_query_tokens": self.predicted_query_tokens[r],
                    "engine_hit_tokens": reported,
                    "engine_query_tokens": self.engine_query_tokens[r],
                    "predicted_over_reported": predicted / reported if reported > 0 else None,
                }
            )
        return rows


class LocalityIndex:
    """Every pool's replicas, for a policy whose fairness is `dlpm` (else empty)."""

    def __init__(self, policy: Policy) -> None:
        self.pools: dict[str, PoolLocality] = {}
        self.bytes_per_token = policy.source.estimation.default_bytes_per_token
        self.settings = policy.source.fairness.locality
        self.update(policy)

    @property
    def enabled(self) -> bool:
        return bool(self.pools)

    @property
    def tokens_per_block(self) -> float:
        return self.settings.block_bytes / self.bytes_per_token

    def update(self, policy: Policy) -> None:
        """Follow a (reloaded) policy: a pool keeps its caches while its endpoints stay."""
        fairness = policy.source.fairness
        self.settings = fairness.locality
        if fairness.policy != "dlpm":
            self.pools = {}
            return
        kept = self.pools
        self.pools = {}
        for name, spec in policy.pools.items():
            old = kept.get(name)
            if old is not None and old.endpoints == tuple(spec.endpoints):
                old.kv_tokens = spec.kv_tokens_per_replica
                old.set_tokens_per_block(self.tokens_per_block)
                self.pools[name] = old
            else:
                self.pools[name] = self._new(spec)

    def _new(self, spec: Pool) -> PoolLocality:
        return PoolLocality(spec.endpoints, spec.kv_tokens_per_replica, self.tokens_per_block)

    def set_bytes_per_token(self, value: float) -> None:
        """The estimator's current bytes per token (what a block is worth in tokens)."""
        if value <= 0 or value == self.bytes_per_token:
            return
        self.bytes_per_token = value
        for pool in self.pools.values():
            pool.set_tokens_per_block(self.tokens_per_block)

    def cached_tokens(self, pool: str, blocks: Sequence[int]) -> float:
        """The longest prefix of `blocks` a replica of `pool` holds, in (estimated) tokens."""
        found = self.pools.get(pool)
        if found is None or not blocks:
            return 0.0
        return found.longest_match(blocks) * found.tokens_per_block

    def route(self, pool: str, blocks: Sequence[int], input_tokens: int) -> int | None:
        """The replica (index into the pool's endpoints) an admitted request goes to; None
        when the pool has no index (Envoy balances) or a single replica."""
        found = self.pools.get(pool)
        if found is None:
            return None
        replica = found.route(blocks, input_tokens, self.settings.load_slack)
        return replica if len(found.endpoints) > 1 else None

    def finished(self, pool: str, replica: int | None) -> None:
        found = self.pools.get(pool)
        if found is not None:
            found.finished(0 if replica is None else replica)

    def describe(self) -> dict[str, Any]:
        return {
            "block_bytes": self.settings.block_bytes,
            "tokens_per_block": self.tokens_per_block,
            "load_slack": self.settings.load_slack,
            "pools": {name: pool.describe() for name, pool in self.pools.items()},
        }


__all__ = [
    "Locality",
    "LocalityIndex",
    "PoolLocality",
    "ReplicaCache",
    "prefix_blocks",
    "render_prompt",
]
