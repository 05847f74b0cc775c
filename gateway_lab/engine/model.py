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
   emulator behaves as `ignore_eos`). A pooling request (`add_request(pooling=True)`, max_tokens
   0: an embedding or a scored text, as vLLM's pooling runner runs it) finishes when its
   prefill completes, with no token sampled and no decode.

KV accounting: a request holds ceil(computed_tokens / block_size) blocks; the whole prompt's
blocks are reserved at admission, later blocks are taken one by one as decodes grow the context.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    num_output: int = 0
    num_computed: int = 0
    num_blocks: int = 0
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
        self._free_blocks = profile.kv_blocks
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps_total = 0

    # -- state -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def used_blocks(self) -> int:
        return self.profile.kv_blocks - self._free_blocks

    @property
    def free_blocks(self) -> int:
        return self._free_blocks

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

    # -- requests ----------------------------------------------------------------------------

    def check_request(
        self, prompt_tokens: int, max_tokens: int, pooling: bool = False
    ) -> str | None:
        """Why a request cannot be served, or None if it can. A pooling request has no
        output (max_tokens 0); any other needs at least one token."""
        if prompt_tokens < 1:
            return "the prompt must have at least 1 token"
        if pooling and max_tokens:
            return "a pooling request has no output tokens (max_tokens 0)"
        if not pooling and max_tokens < 1:
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
        pooling: bool = False,
    ) -> None:
        """Queue a request; raises ValueError if it is a duplicate or can never be served.

        `priority` (lower first) orders the waiting queue and the preemption victims only under
        the "priority" scheduling policy; under "fcfs" it is ignored, as vLLM ignores it."""
        if req_id in self._seqs:
            raise ValueError(f"duplicate request id {req_id!r}")
        problem = self.check_request(prompt_tokens, max_tokens, pooling)
        if problem is not None:
            raise ValueError(problem)
        seq = _Seq(req_id, prompt_tokens, max_tokens, arrival_time, priority, self._submitted)
        self._submitted += 1
        self._seqs[req_id] = seq
        self._waiting.add(seq)

    def abort(self, req_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. False if it is unknown/finished."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return False
        if seq.num_blocks:  # only running requests hold blocks, and every one holds some
            self._running.remove(seq)
            self._free_blocks += seq.num_blocks
            seq.num_blocks = 0
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
            while need > self._free_blocks:
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
                self._free_blocks -= need
                seq.num_blocks += need
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
                need = -(-total // block_size)
                if need > self._free_blocks:
                    break
                seq = waiting.pop()
                self._free_blocks -= need
                seq.num_blocks = need
                if seq.scheduled_time < 0:
                    seq.scheduled_time = now
                running.append(seq)
                new = min(total, chunk_cap, budget)
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
            if not seq.max_tokens:  # pooling: the prefill is the whole request
                self.prompt_tokens_total += seq.prompt_tokens
                finished.append(self._finish(seq, end))
                continue
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
            self._running = [s for s in running if s.req_id in self._seqs]
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

    def _preempt(self, seq: _Seq) -> None:
        self._free_blocks += seq.num_blocks
        seq.num_blocks = 0
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions_total += 1
        self._waiting.add_preempted(seq)

    def _finish(self, seq: _Seq, end: float) -> FinishedRequest:
        self._free_blocks += seq.num_blocks
        seq.num_blocks = 0
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
        )
