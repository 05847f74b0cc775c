"""The locality index: chained block names, per-replica LRU, the D²LPM replica choice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_support import make_policy

from extproc.scheduler.locality import (
    LocalityIndex,
    PoolLocality,
    ReplicaCache,
    prefix_blocks,
    render_prompt,
)


def test_block_names_are_chained_over_full_blocks() -> None:
    a = prefix_blocks(b"x" * 64 + b"y" * 64 + b"z" * 10, 64)
    b = prefix_blocks(b"w" * 64 + b"y" * 64, 64)
    assert len(a) == 2  # the partial last block has no name
    assert a[0] != b[0]
    assert a[1] != b[1]  # the same second block after another first one
    assert prefix_blocks(b"x" * 64 + b"y" * 64, 64) == a
    assert prefix_blocks(b"short", 64) == ()


@given(
    shared=st.binary(min_size=0, max_size=600),
    left=st.binary(min_size=1, max_size=300),
    right=st.binary(min_size=1, max_size=300),
    block=st.sampled_from([16, 32, 100]),
)
def test_equal_names_exactly_up_to_the_shared_prefix(
    shared: bytes, left: bytes, right: bytes, block: int
) -> None:
    one, two = prefix_blocks(shared + left, block), prefix_blocks(shared + right, block)
    common = 0
    while common < min(len(one), len(two)) and one[common] == two[common]:
        common += 1
    a, b = shared + left, shared + right
    byte_common = 0
    while byte_common < min(len(a), len(b)) and a[byte_common] == b[byte_common]:
        byte_common += 1
    assert common == min(byte_common // block, len(one), len(two))


def test_render_separates_texts_so_boundaries_count() -> None:
    assert render_prompt(["ab", "c"]) != render_prompt(["a", "bc"])
    assert render_prompt(["a"], tools_json="[]").startswith(b"[]")


def test_lru_evicts_the_tail_of_a_prompt_before_its_head() -> None:
    cache = ReplicaCache(capacity_blocks=4)
    cache.insert([1, 2, 3])
    cache.insert([7, 8])  # one over capacity: the oldest is block 3, the tail of the first
    assert cache.match([1, 2, 3]) == 2
    assert len(cache) == 4
    cache.insert([1, 2])  # touched: now the newest
    cache.insert([9, 10])
    assert cache.match([1, 2]) == 2
    assert cache.match([7, 8]) == 0


@settings(max_examples=150)
@given(
    prompts=st.lists(
        st.lists(st.integers(0, 30), min_size=1, max_size=8, unique=True), max_size=40
    ),
    capacity=st.integers(1, 20),
)
def test_lru_never_exceeds_capacity_and_keeps_the_newest_prompt_head_first(
    prompts: list[list[int]], capacity: int
) -> None:
    cache = ReplicaCache(capacity)
    for blocks in prompts:
        cache.insert(blocks)
        assert len(cache) <= capacity
        assert cache.match(blocks) == min(len(blocks), capacity)


def test_choice_is_the_longest_match_unless_it_is_loaded_beyond_the_slack() -> None:
    pool = PoolLocality(["a:1", "b:1"], kv_tokens=1000, tokens_per_block=10.0)
    conversation = [11, 12, 13]
    assert pool.route(conversation, 30, load_slack=2) == 0  # a tie: the first
    assert pool.route([21, 22], 20, load_slack=2) == 1  # a tie on no match: fewer in flight
    assert pool.route([*conversation, 14], 40, load_slack=2) == 0  # holds the prefix
    assert pool.predicted_hit_tokens[0] == 30.0  # three blocks of ten tokens
    assert pool.inflight == [2, 1]
    pool.route([31], 10, load_slack=2)  # no match anywhere: the less loaded, replica 1
    assert pool.inflight == [2, 2]
    pool.route(conversation, 30, load_slack=2)
    pool.route(conversation, 30, load_slack=2)
    assert pool.inflight == [4, 2]
    # replica 0 is now two above replica 1, at the slack: the least loaded
    assert pool.route(conversation, 30, load_slack=2) == 1
    pool.finished(0)
    assert pool.inflight == [3, 3]


def test_index_follows_the_policy_and_keeps_caches_of_unchanged_pools() -> None:
    pools = {
        "p": {
            "endpoints": ['"127.0.0.1:1"', '"127.0.0.1:2"'],
            "max_inflight": 4,
            "max_inflight_tokens": 64_000,
        }
    }
    policy = make_policy({"a": {"tier": "gold"}}, fairness="dlpm", pools=pools)
    index = LocalityIndex(policy)
    assert index.enabled
    replica = index.route("p", [1, 2, 3], 200)
    assert replica is not None
    assert index.cached_tokens("p", [1, 2, 9]) == 2 * index.tokens_per_block
    # 64k tokens over 2 replicas at 256 bytes / 4 bytes per token = 64 tokens a block
    assert index.pools["p"].caches[0].capacity == 32_000 // 64
    index.update(policy)
    assert index.cached_tokens("p", [1, 2]) > 0
    index.set_bytes_per_token(2.0)
    assert index.tokens_per_block == 128.0
    assert index.pools["p"].caches[0].capacity == 32_000 // 128
    drr = make_policy({"a": {"tier": "gold"}}, fairness="drr", pools=pools)
    index.update(drr)
    assert not index.enabled
    assert index.route("p", [1], 10) is None


def test_a_single_replica_pool_is_indexed_but_not_routed() -> None:
    policy = make_policy({"a": {"tier": "gold"}}, fairness="dlpm")
    index = LocalityIndex(policy)
    [pool] = index.pools
    assert index.route(pool, [5, 6], 100) is None  # Envoy's single endpoint
    assert index.cached_tokens(pool, [5, 6]) == 2 * index.tokens_per_block
    index.finished(pool, None)
    assert index.pools[pool].inflight == [0]
