"""The pure core of an emulated vLLM engine: a continuous-batching scheduler.

No asyncio, no I/O and no clock: the caller passes the time in and decides what a step's
duration means (the HTTP server sleeps it, a simulator advances its clock by it).

Each `step(now)`, following vLLM V1's scheduler:

1. Running requests, oldest first, each take their next tokens from the step's token budget
   (`max_num_batched_tokens`): one token for a decode, the next chunk for a prompt still being
   prefilled. A decode that needs a new KV block when none is free preempts the newest running
   request (possibly itself): its blocks are freed, it goes back to the front of the waiting
   queue, and it recomputes prompt + tokens generated so far when it is admitted again.
2. If nothing was preempted, waiting requests are admitted FCFS while a sequence slot
   (`max_num_seqs`), some token budget and free blocks for the request's whole prompt remain;
   the head of the queue blocks the others (no skipping).
3. A request whose prefill completes in the step samples its first token in that step; every
   decode samples one token. A request finishes when it has `max_tokens` output tokens (the
   emulator behaves as `ignore_eos`).

KV accounting: a request holds ceil(computed_tokens / block_size) blocks; the whole prompt's
blocks are reserved at admission, later blocks are taken one by one as decodes grow the context.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gateway_lab.engine.profiles import EngineProfile


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
        # Aborted waiting entries stay in the deque (flagged) and are dropped when reached,
        # so an abort never scans the queue.
        self._waiting: deque[_Seq] = deque()
        self._num_waiting = 0
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
        return self._num_waiting

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
        return bool(self._running) or self._num_waiting > 0

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._seqs

    def output_tokens(self, req_id: str) -> int:
        return self._seqs[req_id].num_output

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
        self, req_id: str, prompt_tokens: int, max_tokens: int, arrival_time: float = 0.0
    ) -> None:
        """Queue a request; raises ValueError if it is a duplicate or can never be served."""
        if req_id in self._seqs:
            raise ValueError(f"duplicate request id {req_id!r}")
        problem = self.check_request(prompt_tokens, max_tokens)
        if problem is not None:
            raise ValueError(problem)
        seq = _Seq(req_id, prompt_tokens, max_tokens, arrival_time)
        self._seqs[req_id] = seq
        self._waiting.append(seq)
        self._num_waiting += 1

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
            seq.aborted = True
            self._num_waiting -= 1
        return True

    # -- the step ----------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Schedule and run one step starting at `now`; idle (duration 0) when there is no work."""
        profile = self.profile
        block_size = profile.block_size
        budget = profile.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[_Seq, int]] = []
        preempted: list[str] = []

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            new = seq.prompt_tokens + seq.num_output - seq.num_computed
            if new > budget:
                new = budget
            need = -(-(seq.num_computed + new) // block_size) - seq.num_blocks
            self_preempted = False
            while need > self._free_blocks:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is seq:
                    self_preempted = True
                    break
            if self_preempted:
                break
            if need > 0:
                self._free_blocks -= need
                seq.num_blocks += need
            scheduled.append((seq, new))
            budget -= new
            i += 1

        if not preempted:
            waiting = self._waiting
            while waiting and budget > 0 and len(running) < profile.max_num_seqs:
                seq = waiting[0]
                if seq.aborted:
                    waiting.popleft()
                    continue
                total = seq.prompt_tokens + seq.num_output
                need = -(-total // block_size)
                if need > self._free_blocks:
                    break
                waiting.popleft()
                self._num_waiting -= 1
                self._free_blocks -= need
                seq.num_blocks = need
                if seq.scheduled_time < 0:
                    seq.scheduled_time = now
                running.append(seq)
                new = min(total, budget)
                scheduled.append((seq, new))
                budget -= new

        if not scheduled:
            return StepResult(now, 0.0, (), (), (), tuple(preempted), 0, 0, 0)

        decodes = 0
        prefill_tokens = 0
        context = 0
        for seq, new in scheduled:
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
        for seq, new in scheduled:
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

    def _preempt(self, seq: _Seq) -> None:
        self._free_blocks += seq.num_blocks
        seq.num_blocks = 0
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions_total += 1
        self._waiting.appendleft(seq)
        self._num_waiting += 1

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
