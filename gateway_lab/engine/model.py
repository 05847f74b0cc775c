"""The pure core of an emulated vLLM engine: a continuous-batching scheduler.

No asyncio, no I/O and no clock: the caller passes the time in and decides what a step's
duration means (the HTTP server sleeps it, a simulator advances its clock by it).

Each `step(now)`, following vLLM V1's scheduler:

1. Running requests, in admission order, each take their next tokens from the step's token
   budget (`max_num_batched_tokens`): one token for a decode, the next chunk for a prompt still
   being prefilled, a chunk capped at `long_prefill_token_threshold` tokens when that is set
   (0 = off; not applied when a single request runs or waits). A request that needs a new KV
   block when none is free preempts a victim (possibly itself): under "fcfs" the latest-admitted
   running request, under "priority" the one with the largest (priority, arrival time). The
   victim's blocks are freed (and its tokens in this step unscheduled), it goes back to the
   waiting queue, and it recomputes prompt + tokens generated so far when it is admitted again.
   A running request is never displaced for any other reason.
2. If nothing was preempted, waiting requests are admitted in the policy's order (see
   `gateway_lab.engine.waiting`: "fcfs" arrival order, "priority" lowest value first, ties by
   arrival) while a sequence slot (`max_num_seqs`), some token budget and free blocks for the
   request's whole prompt remain; the head of the queue blocks the others (no skipping).
3. A request whose prefill completes in the step samples its first token in that step; every
   decode samples one token. A request finishes when it has `max_tokens` output tokens (the
   emulator behaves as `ignore_eos`).

KV accounting: a request holds ceil(computed_tokens / block_size) blocks; the whole prompt's
blocks are reserved at admission, later blocks are taken one by one as decodes grow the context.

Automatic prefix caching (`profile.enable_prefix_caching`, on by default as in vLLM V1; the
block semantics are in `gateway_lab.engine.block_cache`): a request carries the keys of its
prompt's full blocks (`token_ids` hashed here, or precomputed `block_hashes`). At admission the
longest run of cached leading blocks, never covering the last token, is its hit: those blocks
are shared instead of allocated and its prefill starts after them (`num_computed` = the hit).
A block gets its key when the tokens that fill it are scheduled. The hit is looked up again
when a preempted request is readmitted; only first admissions count in the prefix-cache
counters (vLLM keeps preempted lookups apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway_lab.engine.block_cache import BlockHash, BlockPool, chain_block_hashes
from gateway_lab.engine.profiles import EngineProfile
from gateway_lab.engine.waiting import WaitingQueue


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """Timing of a request that produced its last token. Times are on the caller's clock."""

    req_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_time: float
    scheduled_time: float
    first_token_time: float
    finish_time: float
    preemptions: int
    cached_tokens: int = 0
    """Prompt tokens its first admission found in the prefix cache (prefill skipped)."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine step did. Every request in `output` got exactly one new token."""

    start: float
    duration: float
    first_token: tuple[str, ...]
    output: tuple[str, ...]
    finished: tuple[FinishedRequest, ...]
    preempted: tuple[str, ...]
    num_decodes: int
    num_prefill_tokens: int
    num_context_tokens: int

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def idle(self) -> bool:
        return self.duration == 0.0


@dataclass(slots=True, eq=False)
class _Seq:
    req_id: str
    prompt_tokens: int
    max_tokens: int
    arrival_time: float
    priority: int
    order: int
    """Submission order: breaks ties between equal (priority, arrival_time)."""
    block_hashes: Sequence[BlockHash]
    """Keys of the prompt's full blocks (empty: the prompt can neither hit nor be cached)."""
    num_output: int = 0
    num_computed: int = 0
    num_blocks: int = 0
    cached: list[BlockHash] = field(default_factory=list)
    """The keys of the blocks it holds that are cached (shared or its own), in block order."""
    num_keyed: int = 0
    """Its leading blocks already given their key (or found as a hit)."""
    cached_tokens: int = 0
    """The prefix-cache hit of its first admission, in tokens."""
    aborted: bool = False
    preemptions: int = 0
    scheduled_time: float = -1.0
    first_token_time: float = -1.0


class EngineCore:
    """Deterministic continuous-batching scheduler with paged KV blocks."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self._seqs: dict[str, _Seq] = {}
        self._running: list[_Seq] = []
        self._waiting: WaitingQueue[_Seq] = WaitingQueue(profile.scheduling_policy)
        self._by_priority = profile.scheduling_policy == "priority"
        self._submitted = 0
        self._pool = BlockPool(profile.kv_blocks, profile.enable_prefix_caching)
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps_total = 0
        self.prefix_cache_queries_total = 0
        """Prompt tokens looked up at first admissions (vLLM's prefix_cache_queries)."""
        self.prefix_cache_hits_total = 0
        """Of those, tokens found cached (vLLM's prefix_cache_hits)."""

    # -- state -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def used_blocks(self) -> int:
        """Blocks held by requests (free cached blocks are not used, as vLLM counts)."""
        return self.profile.kv_blocks - self._pool.num_free

    @property
    def free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def block_pool(self) -> BlockPool:
        return self._pool

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vLLM's kv_cache_usage_perc is a fraction too)."""
        return self.used_blocks / self.profile.kv_blocks

    @property
    def has_work(self) -> bool:
        return bool(self._running) or len(self._waiting) > 0

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._seqs

    def output_tokens(self, req_id: str) -> int:
        return self._seqs[req_id].num_output

    def cached_prefix_tokens(self, prompt_tokens: int, block_hashes: Sequence[BlockHash]) -> int:
        """The tokens a prompt with these block keys would find cached if admitted now (no
        side effect: what a router that saw the engine's cache would know)."""
        block_size = self.profile.block_size
        return self._pool.longest_hit(block_hashes, prompt_tokens, block_size) * block_size

    # -- requests ----------------------------------------------------------------------------

    def check_request(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request cannot be served, or None if it can."""
        if prompt_tokens < 1:
            return "the prompt must have at least 1 token"
        if max_tokens < 1:
            return "max_tokens must be at least 1"
        if prompt_tokens + max_tokens > self.profile.max_model_len:
            return (
                f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.profile.max_model_len})"
            )
        return None

    def add_request(
        self,
        req_id: str,
        prompt_tokens: int,
        max_tokens: int,
        arrival_time: float = 0.0,
        priority: int = 0,
        *,
        token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> None:
        """Queue a request; raises ValueError if it is a duplicate or can never be served.

        `priority` (lower first) orders the waiting queue and the preemption victims only under
        the "priority" scheduling policy; under "fcfs" it is ignored, as vLLM ignores it.
        For prefix caching, give the prompt's `token_ids` (exactly `prompt_tokens` of them) or
        the keys of its full blocks, `block_hashes` (at most prompt_tokens // block_size,
        e.g. from `block_cache.rechunk_block_hashes`); with neither, the prompt never hits."""
        if req_id in self._seqs:
            raise ValueError(f"duplicate request id {req_id!r}")
        problem = self.check_request(prompt_tokens, max_tokens)
        if problem is not None:
            raise ValueError(problem)
        keys = self._prompt_keys(prompt_tokens, token_ids, block_hashes)
        seq = _Seq(req_id, prompt_tokens, max_tokens, arrival_time, priority, self._submitted, keys)
        self._submitted += 1
        self._seqs[req_id] = seq
        self._waiting.add(seq)

    def _prompt_keys(
        self,
        prompt_tokens: int,
        token_ids: Sequence[int] | None,
        block_hashes: Sequence[BlockHash] | None,
    ) -> Sequence[BlockHash]:
        block_size = self.profile.block_size
        if token_ids is not None:
            if block_hashes is not None:
                raise ValueError("give token_ids or block_hashes, not both")
            if len(token_ids) != prompt_tokens:
                raise ValueError(
                    f"{len(token_ids)} token ids for a prompt of {prompt_tokens} tokens"
                )
            if not self._pool.caching:
                return ()
            return chain_block_hashes(token_ids, block_size)
        if block_hashes is None:
            return ()
        if len(block_hashes) > prompt_tokens // block_size:
            raise ValueError(
                f"{len(block_hashes)} block hashes for {prompt_tokens // block_size} full blocks"
            )
        return block_hashes

    def abort(self, req_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. False if it is unknown/finished."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return False
        if seq.num_blocks:  # only running requests hold blocks, and every one holds some
            self._running.remove(seq)
            self._release(seq)
        else:
            self._waiting.mark_aborted(seq)
        return True

    # -- the step ----------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Schedule and run one step starting at `now`; idle (duration 0) when there is no work."""
        preempted: list[str] = []
        while True:
            # A request that preempts itself ends vLLM's scheduling pass; when nothing was
            # scheduled before it, vLLM's next pass follows at once: run it here, so that a
            # step with work is never empty.
            preempted_now: list[str] = []
            scheduled = self._schedule(now, preempted_now)
            preempted += preempted_now
            if scheduled or not preempted_now:
                break

        if not scheduled:
            return StepResult(now, 0.0, (), (), (), tuple(preempted), 0, 0, 0)
        return self._run(now, scheduled, preempted)

    def _schedule(self, now: float, preempted: list[str]) -> dict[_Seq, int]:
        """One vLLM scheduling pass: the tokens each scheduled request computes in the step."""
        profile = self.profile
        block_size = profile.block_size
        budget = profile.max_num_batched_tokens
        running = self._running
        pool = self._pool
        # vLLM applies the cap only when another request could be starved by a long prefill.
        threshold = profile.long_prefill_token_threshold
        many = len(running) + len(self._waiting) > 1
        chunk_cap = threshold if threshold and many else budget
        # Insertion-ordered: a preempted victim's tokens are taken back out of the step.
        scheduled: dict[_Seq, int] = {}

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            new = min(seq.prompt_tokens + seq.num_output - seq.num_computed, chunk_cap, budget)
            need = -(-(seq.num_computed + new) // block_size) - seq.num_blocks
            self_preempted = False
            while need > pool.num_free:
                at = self._victim_index()
                victim = running.pop(at)
                if at < i:
                    i -= 1
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is seq:
                    self_preempted = True
                    break
            if self_preempted:
                break  # as vLLM: no running request after it is scheduled in this step
            if need > 0:
                pool.allocate(need)
                seq.num_blocks += need
            if seq.num_keyed < len(seq.block_hashes):  # a decode has nothing left to key
                self._cache_full_blocks(seq, seq.num_computed + new)
            scheduled[seq] = new
            budget -= new
            i += 1

        if not preempted:
            waiting = self._waiting
            while budget > 0 and len(running) < profile.max_num_seqs:
                head = waiting.peek()
                if head is None:
                    break
                total = head.prompt_tokens + head.num_output
                hit = pool.longest_hit(head.block_hashes, total, block_size)
                hit_keys = head.block_hashes[:hit]
                required = -(-total // block_size)
                if pool.blocks_to_allocate(hit_keys, required - hit) > pool.num_free:
                    break
                seq = waiting.pop()
                pool.touch(hit_keys)  # before allocating, so that the hit is not evicted
                pool.allocate(required - hit)
                seq.num_blocks = required
                seq.cached = list(hit_keys)
                seq.num_keyed = hit
                seq.num_computed = hit * block_size
                if pool.caching and not seq.preemptions:
                    self.prefix_cache_queries_total += total
                    self.prefix_cache_hits_total += seq.num_computed
                    seq.cached_tokens = seq.num_computed
                if seq.scheduled_time < 0:
                    seq.scheduled_time = now
                running.append(seq)
                new = min(total - seq.num_computed, chunk_cap, budget)
                self._cache_full_blocks(seq, seq.num_computed + new)
                scheduled[seq] = new
                budget -= new

        return scheduled

    def _run(self, now: float, scheduled: dict[_Seq, int], preempted: list[str]) -> StepResult:
        """Compute the scheduled tokens: the step's duration, sampled tokens and finishes."""
        profile = self.profile
        running = self._running
        decodes = 0
        prefill_tokens = 0
        context = 0
        for seq, new in scheduled.items():
            # Feeding back the last sampled token is a decode; anything else is (re)prefill.
            if (
                new == 1
                and seq.num_output
                and seq.num_computed == seq.prompt_tokens + seq.num_output - 1
            ):
                decodes += 1
            else:
                prefill_tokens += new
            context += seq.num_computed + new
        duration = profile.step_time(decodes, prefill_tokens, context)
        end = now + duration

        first_token: list[str] = []
        output: list[str] = []
        finished: list[FinishedRequest] = []
        for seq, new in scheduled.items():
            seq.num_computed += new
            if seq.num_computed < seq.prompt_tokens + seq.num_output:
                continue  # a prefill chunk that does not finish the prompt
            seq.num_output += 1
            output.append(seq.req_id)
            if seq.num_output == 1:
                seq.first_token_time = end
                first_token.append(seq.req_id)
                self.prompt_tokens_total += seq.prompt_tokens
            if seq.num_output >= seq.max_tokens:
                finished.append(self._finish(seq, end))
        self.generation_tokens_total += len(output)
        if finished:
            self._running = [s for s in running if s.num_output < s.max_tokens]
        self.steps_total += 1
        return StepResult(
            now,
            duration,
            tuple(first_token),
            tuple(output),
            tuple(finished),
            tuple(preempted),
            decodes,
            prefill_tokens,
            context,
        )

    def _victim_index(self) -> int:
        """Where in `_running` the request to preempt is (vLLM V1's choice per policy)."""
        running = self._running
        if not self._by_priority:
            return len(running) - 1
        # max() keeps the first of equal keys, as vLLM's does.
        return max(
            range(len(running)), key=lambda k: (running[k].priority, running[k].arrival_time)
        )

    def _cache_full_blocks(self, seq: _Seq, num_tokens: int) -> None:
        """Key the blocks that `num_tokens` scheduled tokens fill (vLLM: at scheduling)."""
        keys = seq.block_hashes
        full = min(num_tokens // self.profile.block_size, len(keys))
        if full <= seq.num_keyed:
            return
        pool = self._pool
        for j in range(seq.num_keyed, full):
            if pool.cache(keys[j]):
                seq.cached.append(keys[j])
        seq.num_keyed = full

    def _release(self, seq: _Seq) -> None:
        self._pool.free(seq.cached, seq.num_blocks - len(seq.cached))
        seq.cached = []
        seq.num_blocks = 0
        seq.num_keyed = 0

    def _preempt(self, seq: _Seq) -> None:
        self._release(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions_total += 1
        self._waiting.add_preempted(seq)

    def _finish(self, seq: _Seq, end: float) -> FinishedRequest:
        self._release(seq)
        del self._seqs[seq.req_id]
        return FinishedRequest(
            seq.req_id,
            seq.prompt_tokens,
            seq.num_output,
            seq.arrival_time,
            seq.scheduled_time,
            seq.first_token_time,
            end,
            seq.preemptions,
            seq.cached_tokens,
        )
