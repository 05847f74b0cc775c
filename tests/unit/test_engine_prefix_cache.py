"""Automatic prefix caching in the engine model: hits, keys, LRU eviction, ref counts,
preemption, the prefix-cache counters and their invariants (vLLM V1's semantics)."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gateway_lab.engine.block_cache import BlockPool, chain_block_hashes, rechunk_block_hashes
from gateway_lab.engine.cli import add_arguments, build_server
from gateway_lab.engine.metrics import EngineMetrics
from gateway_lab.engine.model import EngineCore, StepResult
from gateway_lab.engine.profiles import EngineProfile
from gateway_lab.engine.tokens import chat_prompt_token_ids, completion_prompt_token_ids

# Block size 4, prefill 1 ms/token, context 0: a step's duration tells its prefill tokens.
TINY = EngineProfile(
    name="tiny",
    step_base_s=0.01,
    step_per_decode_s=0.0,
    step_per_prefill_token_s=0.001,
    step_per_context_token_s=0.0,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    kv_blocks=64,
    block_size=4,
    max_model_len=64,
)


def tiny(**changes: object) -> EngineProfile:
    return TINY.with_overrides(changes)


def run(core: EngineCore, now: float = 0.0) -> list[StepResult]:
    steps: list[StepResult] = []
    while core.has_work:
        result = core.step(now)
        steps.append(result)
        now = result.end
        assert len(steps) < 10_000
    return steps


def prefill_of(core: EngineCore, req_id: str, tokens: list[int], max_tokens: int = 1) -> int:
    """Serve one request alone; the prompt tokens it prefilled."""
    core.add_request(req_id, len(tokens), max_tokens, token_ids=tokens)
    return sum(step.num_prefill_tokens for step in run(core))


def test_a_repeated_prompt_prefills_only_after_its_cached_blocks() -> None:
    core = EngineCore(TINY)
    prompt = list(range(10))  # two full blocks and a partial one
    assert prefill_of(core, "a", prompt) == 10
    core.add_request("b", 10, 1, token_ids=prompt)
    (step,) = run(core)
    assert step.num_prefill_tokens == 2 and step.num_context_tokens == 10
    (finished,) = step.finished
    assert finished.cached_tokens == 8 and finished.prompt_tokens == 10
    assert step.duration == pytest.approx(0.01 + 0.002)
    assert (core.prefix_cache_queries_total, core.prefix_cache_hits_total) == (20, 8)


def test_a_lookup_without_admission_changes_nothing() -> None:
    core = EngineCore(TINY)
    prompt = list(range(10))
    keys = chain_block_hashes(prompt, 4)
    assert core.cached_prefix_tokens(10, keys) == 0
    prefill_of(core, "a", prompt)
    order = core.block_pool.eviction_order()
    assert core.cached_prefix_tokens(10, keys) == 8
    assert core.cached_prefix_tokens(8, keys) == 4  # the last token is never a hit
    assert core.block_pool.eviction_order() == order and core.prefix_cache_queries_total == 10


def test_the_last_token_is_never_served_from_the_cache() -> None:
    core = EngineCore(TINY)
    prompt = list(range(8))  # exactly two blocks: the second is recomputed for its last token
    prefill_of(core, "a", prompt)
    assert prefill_of(core, "b", prompt) == 4
    assert core.prefix_cache_hits_total == 4


def test_a_partial_last_block_is_not_cached() -> None:
    core = EngineCore(TINY)
    prefill_of(core, "a", [1, 2, 3, 4, 5, 6])
    assert core.block_pool.num_cached == 1
    # Shares a's six tokens, but only a's full block can hit.
    assert prefill_of(core, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 6


def test_keys_chain_the_prefix_so_a_different_first_block_never_hits() -> None:
    core = EngineCore(TINY)
    prefill_of(core, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert prefill_of(core, "b", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 9
    assert prefill_of(core, "c", [1, 2, 3, 4, 0, 6, 7, 8, 9]) == 5  # first block only
    second_block = chain_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1]
    assert chain_block_hashes([5, 6, 7, 8], 4) != [second_block]


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(6, caching=True)
    pool.allocate(2)
    assert pool.cache(10) and pool.cache(11)
    pool.free([10, 11], 0)  # the tail is released first, so it is evicted first
    pool.allocate(2)
    assert pool.cache(20) and pool.cache(21)
    pool.free([20, 21], 0)
    assert pool.eviction_order() == [11, 10, 21, 20]
    pool.allocate(2)  # two uncached blocks are still free: nothing is evicted
    assert pool.num_cached == 4 and pool.evictions_total == 0
    pool.allocate(3)
    assert pool.eviction_order() == [20] and pool.evictions_total == 3
    assert pool.ref_count(10) is None and pool.ref_count(20) == 0


def test_a_hit_refreshes_recency() -> None:
    pool = BlockPool(4, caching=True)
    pool.allocate(2)
    pool.cache(1)
    pool.cache(2)
    pool.free([1, 2], 0)
    pool.touch([1])
    pool.free([1], 0)
    assert pool.eviction_order() == [2, 1]


def test_blocks_in_use_are_never_evicted() -> None:
    pool = BlockPool(3, caching=True)
    pool.allocate(1)
    pool.cache(7)
    pool.free([7], 0)
    pool.touch([7])  # a second request holds it now
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="cannot allocate 3 blocks"):
        pool.allocate(3)
    pool.allocate(2)
    assert pool.ref_count(7) == 1 and pool.num_free == 0


def test_an_engine_evicts_the_oldest_prefix_and_keeps_the_newer_one() -> None:
    # 16 blocks of 4 tokens: two 6-block prompts fit cached; a third one evicts the first's.
    core = EngineCore(tiny(kv_blocks=16))
    a = list(range(100, 124))
    b = list(range(200, 224))
    prefill_of(core, "a", a)
    prefill_of(core, "b", b)
    prefill_of(core, "c", list(range(300, 324)))
    # c evicted a's two last blocks (a request frees its tail first, so it goes first).
    assert prefill_of(core, "b2", b) == 4  # b's blocks survived; b2 recomputes b's last one
    # With no uncached block free, b2's new block evicted a's next block.
    assert prefill_of(core, "a2", a) == 12


def test_a_shared_block_held_by_a_running_request_survives_pressure() -> None:
    core = EngineCore(tiny(kv_blocks=16))
    shared = list(range(12))
    other = list(range(600, 620))
    prefill_of(core, "warm", [*shared, 99])  # 3 cached blocks
    prefill_of(core, "other", other)  # 5 cached blocks; 8 uncached free
    core.add_request("holder", 13, 2, token_ids=[*shared, 98])  # hits the 3, takes 1
    core.add_request("big", 40, 1, token_ids=list(range(500, 540)))  # 10: 7 + 3 evicted
    first = core.step(0.0)
    assert set(first.first_token) == {"holder", "big"}
    assert core.block_pool.evictions_total == 3
    assert all(core.block_pool.ref_count(k) == 1 for k in chain_block_hashes(shared, 4))
    run(core, first.end)
    assert prefill_of(core, "again", [*shared, 97]) == 1
    assert prefill_of(core, "other2", other) == 20 - 8  # its 3 tail blocks were evicted


def test_preemption_frees_into_the_cache_and_the_readmission_hits() -> None:
    # Two 6-block prompts decode until 16 blocks run out: y (admitted last) is preempted.
    core = EngineCore(tiny(kv_blocks=16, max_model_len=64))
    core.add_request("x", 24, 20, token_ids=list(range(24)))
    core.add_request("y", 24, 20, token_ids=list(range(50, 74)))
    steps = run(core)
    (preempted,) = (s for s in steps if s.preempted)
    assert preempted.preempted == ("y",) and core.preemptions_total == 1
    made = sum(1 for s in steps[: steps.index(preempted)] if "y" in s.output)
    (readmitted,) = (s for s in steps[steps.index(preempted) :] if s.num_prefill_tokens)
    # x, growing to 11 blocks, evicted y's last prompt block only (tail first): y's
    # readmission hits its first 5 blocks and recomputes the rest of prompt + output.
    assert made == 9
    assert readmitted.num_prefill_tokens == 24 + made - 20
    # Only the two first admissions count, as in vLLM (preempted lookups are kept apart).
    assert core.prefix_cache_queries_total == 48 and core.prefix_cache_hits_total == 0
    assert core.free_blocks == 16


def test_recomputing_a_free_cached_block_moves_its_key_to_the_new_copy() -> None:
    pool = BlockPool(4, caching=True)
    pool.allocate(2)
    pool.cache(1)
    pool.cache(2)
    pool.free([1, 2], 0)
    pool.allocate(1)  # an uncached block is free: nothing evicted
    assert pool.cache(2)  # the old free copy of key 2 becomes uncached and free
    assert pool.eviction_order() == [1] and pool.ref_count(2) == 1 and pool.num_free == 3
    pool.touch([1])
    pool.allocate(1)
    assert not pool.cache(1)  # a block in use has the key: the new one stays uncached


def test_prefix_caching_off_never_hits_and_counts_nothing() -> None:
    core = EngineCore(tiny(enable_prefix_caching=False))
    prompt = list(range(10))
    prefill_of(core, "a", prompt)
    assert prefill_of(core, "b", prompt) == 10
    assert (core.prefix_cache_queries_total, core.prefix_cache_hits_total) == (0, 0)
    assert core.block_pool.num_cached == 0


def test_a_request_without_token_identity_is_queried_but_never_hits() -> None:
    core = EngineCore(TINY)
    core.add_request("a", 10, 1)
    core.add_request("b", 10, 1)
    run(core)
    assert (core.prefix_cache_queries_total, core.prefix_cache_hits_total) == (20, 0)


def test_bad_token_identity_is_refused() -> None:
    core = EngineCore(TINY)
    with pytest.raises(ValueError, match="3 token ids for a prompt of 4 tokens"):
        core.add_request("a", 4, 1, token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="3 block hashes for 2 full blocks"):
        core.add_request("a", 9, 1, block_hashes=[1, 2, 3])
    with pytest.raises(ValueError, match="not both"):
        core.add_request("a", 4, 1, token_ids=[1, 2, 3, 4], block_hashes=[1])


def test_coarse_precomputed_hashes_map_onto_engine_blocks() -> None:
    # Mooncake-style ids of 8-token blocks onto 4-token engine blocks.
    a = rechunk_block_hashes([7, 8, 9], 8, 24, 4)
    b = rechunk_block_hashes([7, 8, 5], 8, 20, 4)
    assert len(a) == 6 and len(b) == 5
    assert a[:4] == b[:4] and a[4] != b[4]
    # Engine blocks larger than the hash blocks chain every id they cover.
    assert rechunk_block_hashes([7, 8], 4, 8, 8) != rechunk_block_hashes([7, 9], 4, 8, 8)
    core = EngineCore(TINY)
    core.add_request("a", 24, 1, block_hashes=a)
    run(core)
    core.add_request("b", 20, 1, block_hashes=b)
    assert sum(s.num_prefill_tokens for s in run(core)) == 4


def test_metrics_publish_vllm_prefix_cache_counters() -> None:
    core = EngineCore(TINY)
    prefill_of(core, "a", list(range(10)))
    prefill_of(core, "b", list(range(10)))
    text = EngineMetrics(core, "m").render().decode()
    labels = '{engine="0",model_name="m"}'
    assert f"vllm:prefix_cache_queries_total{labels} 20.0" in text
    assert f"vllm:prefix_cache_hits_total{labels} 8.0" in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert "# TYPE vllm:prefix_cache_queries_total counter" in text


def test_engine_flags_match_vllm() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    on = build_server(parser.parse_args(["--profile", "fast"]))
    off = build_server(parser.parse_args(["--profile", "fast", "--no-enable-prefix-caching"]))
    again = build_server(parser.parse_args(["--profile", "fast", "--enable-prefix-caching"]))
    assert on.profile.enable_prefix_caching and again.profile.enable_prefix_caching
    assert not off.profile.enable_prefix_caching


def test_a_resent_conversation_shares_its_token_prefix() -> None:
    turn = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "hi"}]
    longer = [*turn, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    first = chat_prompt_token_ids(turn)
    second = chat_prompt_token_ids(longer)
    assert second[: len(first)] == first
    assert chat_prompt_token_ids([{"role": "user", "content": "hi"}]) != chat_prompt_token_ids(
        [{"role": "system", "content": "hi"}]
    )
    assert completion_prompt_token_ids([5, 6, 7]) == [5, 6, 7]
    assert completion_prompt_token_ids("abcdefgh") == completion_prompt_token_ids("abcdefgh")


# -- properties ------------------------------------------------------------------------------

_PREFIXES = [list(range(k * 1000, k * 1000 + 20)) for k in range(3)]


@st.composite
def workloads(draw: st.DrawFn) -> list[tuple[list[int], int, int]]:
    """Requests built on a few shared prefixes: (token ids, max_tokens, arrival step)."""
    out: list[tuple[list[int], int, int]] = []
    for _ in range(draw(st.integers(1, 12))):
        prefix = _PREFIXES[draw(st.integers(0, 2))][: draw(st.integers(0, 20))]
        tail = draw(st.lists(st.integers(0, 5), min_size=0, max_size=10))
        tokens = prefix + tail or [1]
        out.append((tokens, draw(st.integers(1, 12)), draw(st.integers(0, 6))))
    return out


@settings(max_examples=150, deadline=None)
@given(workloads(), st.integers(12, 40), st.booleans())
def test_cache_invariants(
    workload: list[tuple[list[int], int, int]], kv_blocks: int, fcfs: bool
) -> None:
    profile = tiny(kv_blocks=kv_blocks, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=44)
    if not fcfs:
        profile = profile.with_overrides({"scheduling_policy": "priority"})
    core = EngineCore(profile)
    pool = core.block_pool
    now, step_no = 0.0, 0
    pending = sorted(enumerate(workload), key=lambda item: item[1][2])
    finished = 0
    while pending or core.has_work:
        while pending and pending[0][1][2] <= step_no:
            i, (tokens, max_tokens, _) = pending.pop(0)
            core.add_request(f"r{i}", len(tokens), max_tokens, now, i % 3, token_ids=tokens)
        queries, hits = core.prefix_cache_queries_total, core.prefix_cache_hits_total
        seen = {r for r, s in core._seqs.items() if s.scheduled_time >= 0}
        result = core.step(now)
        firsts = {r for r, s in core._seqs.items() if s.scheduled_time == now} | {
            f.req_id for f in result.finished if f.scheduled_time == now
        }
        # Each first admission queries its prompt and hits at most all of it but one token.
        new_queries = core.prefix_cache_queries_total - queries
        new_hits = core.prefix_cache_hits_total - hits
        assert new_hits <= new_queries - len(firsts - seen)
        now = result.end
        step_no += 1
        # Blocks held by requests (a shared block once) plus free blocks are the pool.
        own = sum(s.num_blocks - len(s.cached) for s in core._running)
        held = own + sum(1 for count in pool._refs.values() if count > 0)
        assert held + pool.num_free == kv_blocks
        # A cached block's reference count is the number of running requests holding it.
        for key in list(pool._refs):
            holders = sum(key in s.cached for s in core._running)
            assert pool.ref_count(key) == holders
        assert pool.num_free_cached == sum(1 for k in pool._refs if pool._refs[k] == 0)
        for s in core._running:
            # A hit or an own block is never a partial block, and never covers the last token.
            assert len(s.cached) <= s.num_keyed <= (s.prompt_tokens) // profile.block_size
        finished += len(result.finished)
        assert step_no < 20_000
    assert finished == len(workload)
    total_prompt = sum(len(t) for t, _, _ in workload)
    assert core.prefix_cache_queries_total == total_prompt
    # Every request prefilled at least its last token.
    assert core.prefix_cache_hits_total <= total_prompt - len(workload)
    assert pool.num_free == kv_blocks and core.used_blocks == 0


class _VllmFreeQueue:
    """vLLM's block pool as written (block_pool.py): named blocks, one free queue that takes
    from its head, freed uncached blocks prepended, freed cached blocks appended."""

    def __init__(self, num_blocks: int) -> None:
        self.queue: list[int] = list(range(num_blocks))
        self.key: dict[int, int] = {}  # block -> key
        self.block: dict[int, int] = {}  # key -> block
        self.refs = [0] * num_blocks

    def allocate(self, n: int) -> list[int]:
        taken, self.queue = self.queue[:n], self.queue[n:]
        for b in taken:
            if b in self.key:
                del self.block[self.key.pop(b)]
            self.refs[b] = 1
        return taken

    def touch(self, keys: list[int]) -> list[int]:
        blocks = [self.block[k] for k in keys]
        for b in blocks:
            if self.refs[b] == 0:
                self.queue.remove(b)
            self.refs[b] += 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        first: list[int] = []
        last: list[int] = []
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                (last if b in self.key else first).append(b)
        self.queue = first + self.queue + last

    def eviction_order(self) -> list[int]:
        return [self.key[b] for b in self.queue if b in self.key]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 7)), max_size=80))
def test_block_pool_evicts_exactly_as_vllms_free_queue(ops: list[tuple[int, int, int]]) -> None:
    # Requests allocate, key their blocks in order, hit cached keys and finish; the counted
    # pool and vLLM's named free queue agree on free blocks, cached keys and eviction order.
    pool = BlockPool(10, caching=True)
    ref = _VllmFreeQueue(10)
    live: list[tuple[list[int], list[int], list[int]]] = []  # (blocks, keys, own uncached)
    next_key = 100
    evictions = 0
    for kind, a, b in ops:
        if kind == 0:  # admission: hit `a` cached keys (if any), allocate `b` blocks
            hits = (
                ref.eviction_order()[:a]
                + [ref.key[blk] for blk in ref.key if ref.refs[blk] > 0][
                    : max(0, a - len(ref.eviction_order()))
                ]
            )
            if pool.blocks_to_allocate(hits, b) > pool.num_free:
                continue
            pool.touch(hits)
            pool.allocate(b)
            blocks = ref.touch(hits) + ref.allocate(b)
            live.append((blocks, list(hits), blocks[len(hits) :]))
        elif kind == 1 and live:  # the request keys its next `b` uncached blocks
            blocks, keys, own = live[a % len(live)]
            for _ in range(min(b, len(own))):
                assert pool.cache(next_key)
                ref.key[own[0]] = next_key
                ref.block[next_key] = own.pop(0)
                keys.append(next_key)
                next_key += 1
        elif kind == 2 and live:  # the request finishes (or is preempted)
            blocks, keys, own = live.pop(a % len(live))
            pool.free(keys, len(own))
            ref.free(blocks)
        assert pool.num_free == len(ref.queue)
        assert pool.eviction_order() == ref.eviction_order()
        assert {k: pool.ref_count(k) for k in ref.block} == {
            k: ref.refs[blk] for k, blk in ref.block.items()
        }
        assert pool.num_cached == len(ref.block)
        evictions = pool.evictions_total
    event("evicted" if evictions else "no eviction")
