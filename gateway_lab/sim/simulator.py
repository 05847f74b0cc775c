"""The discrete-event simulator: trace arrivals through the real scheduler into engine replicas.

Events, in time order (ties in this order, then first come first served):

1. a replica's engine step ends: first tokens and output tokens are recorded, every generated
   token is charged to the scheduler (`charge_output(lease, 1)`), finished requests release
   their lease with their actual tokens (`release(lease, input, output)`, the settlement), the
   scheduler is pumped, and the replica starts its next step;
2. an admitted request reaches its replica (admission time + the profile's `frontend_s`) and
   joins the engine's waiting queue;
3. a request arrives: pool by budget, ticket, `submit`, pump;
4. an engine probe, if configured: the pools' engines are shown to a callback (to drive an
   adaptive capacity from engine metrics), then pump;
5. a scheduler timer (`next_deadline()`): pump (expiries, shedding, lease reclaim);
6. an idle replica that received work starts a step (after everything else at that instant,
   so requests entering together share the step).

"Pump" is what the live `AdmissionController` does: `poll()` then `dispatch()`; admissions go
to the least-loaded replica of their pool. Nothing waits on a wall clock: a step of duration d
is one event d simulated seconds later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any

from extproc.errors import GatewayError
from extproc.policy.runtime import Policy
from extproc.scheduler import Admission, Rejection
from extproc.types import Outcome
from gateway_lab.engine.block_cache import rechunk_block_hashes
from gateway_lab.engine.model import EngineCore
from gateway_lab.sim.fleet import PoolEngines
from gateway_lab.sim.gateway import SimGateway, route_or_error
from gateway_lab.sim.records import RequestRecord
from gateway_lab.sim.replicas import Balance, Fleet, Replica
from gateway_lab.sim.slo import Slo
from gateway_lab.sim.trace import HASH_BLOCK_TOKENS, TraceRequest

_STEP_END = 0
_ENTER = 1
_ARRIVAL = 2
_PROBE = 3
_TIMER = 4
_KICK = 5

MaxTokens = str | int
"""'actual' (max_tokens = the trace's output), 'default' (the policy's default_max_tokens), or
a fixed number. The engine generates min(trace output, max_tokens)."""

ProgressHook = Callable[[float, int, int], None]
"""Called now and then with (simulated time, requests resolved, requests total)."""

EngineProbe = Callable[[float, str, Sequence[EngineCore]], None]
"""Called every `probe_interval_s` with (simulated time, pool, the pool's engines): the place
to feed engine metrics (num_waiting, kv_usage, ...) to an adaptive capacity created through
`scheduler_options["capacity_factory"]`. The scheduler is pumped right after."""


@dataclass(frozen=True)
class SimConfig:
    policy: Policy
    fleet: Mapping[str, PoolEngines]
    """Engines for every pool of the policy."""
    slo: Slo = field(default_factory=Slo)
    max_tokens: MaxTokens = "actual"
    scheduler_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments for `Scheduler` (max_bypass, reserve_output, ...)."""
    stop_after_misses: int | None = None
    """Stop as soon as more than this many requests are known to miss the SLO (planning)."""
    time_limit: float | None = None
    """Stop the simulated clock here; None runs until every request has an outcome."""
    balance: Balance = "tokens"
    """How a pool spreads admitted requests over its replicas (see replicas.py)."""
    engine_probe: EngineProbe | None = None
    probe_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    name: str
    pool: str
    busy_s: float
    steps: int
    output_tokens: int
    preemptions: int
    prefix_cache_queries: int
    """Prompt tokens its prefix cache was queried for (vLLM's prefix_cache_queries)."""
    prefix_cache_hits: int
    max_num_seqs: int
    max_model_len: int
    busy_timeline: tuple[float, ...]
    """Busy seconds in each `TIMELINE_BUCKET_S` interval from time 0."""


@dataclass
class SimResult:
    records: list[RequestRecord]
    replicas: list[ReplicaStats]
    fleet: dict[str, PoolEngines]
    end_time: float
    """Last arrival or engine activity (simulated seconds from the trace start)."""
    wall_s: float
    events: int
    stopped_early: bool
    snapshot: dict[str, Any]
    """The scheduler's final snapshot()."""
    slo: Slo

    def misses(self) -> int:
        return sum(1 for record in self.records if not self.slo.met(record))


def engine_output(
    request: TraceRequest, max_tokens: MaxTokens, default_max_tokens: int
) -> tuple[int, int]:
    """(max_tokens the client sends, tokens the engine generates) for a trace request."""
    if max_tokens == "actual":
        limit = request.output_tokens
    elif max_tokens == "default":
        limit = default_max_tokens
    elif isinstance(max_tokens, int) and max_tokens > 0:
        limit = max_tokens
    else:
        raise ValueError(f"max_tokens must be 'actual', 'default' or > 0, not {max_tokens!r}")
    return limit, max(1, min(request.output_tokens, limit))


class Simulation:
    """One run. `run()` once; the object keeps the state for inspection afterwards."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        config: SimConfig,
        progress: ProgressHook | None = None,
    ) -> None:
        policy = config.policy
        missing = sorted(set(policy.pools) - set(config.fleet))
        if missing:
            raise ValueError(f"no engines for pool(s) {', '.join(missing)} of the policy")
        if config.probe_interval_s <= 0:
            raise ValueError("probe_interval_s must be > 0")
        self.config = config
        self.gateway = SimGateway(policy, **dict(config.scheduler_options))
        self.clock = self.gateway.clock
        self.fleet = Fleet({name: config.fleet[name] for name in policy.pools}, config.balance)
        self.records: list[RequestRecord] = []
        for index, request in enumerate(requests):
            if request.tenant is None:
                raise ValueError(f"request {index} has no tenant (assign tenants first)")
            max_tokens, output = engine_output(
                request, config.max_tokens, policy.source.gateway.default_max_tokens
            )
            self.records.append(
                RequestRecord(
                    index=index,
                    request_id=f"r{index}",
                    tenant=request.tenant,
                    arrival=request.at,
                    input_tokens=request.input_tokens,
                    output_tokens=output,
                    max_tokens=max_tokens,
                    priority=request.priority,
                    hash_ids=request.hash_ids,
                )
            )
        self._by_id = {record.request_id: record for record in self.records}
        self._by_lease: dict[int, RequestRecord] = {}
        self._progress = progress
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._resolved = 0
        self._missed = bytearray(len(self.records))
        self._misses = 0
        self._ttft_watch: list[tuple[float, int]] = []
        self._stop = False
        self._last_activity = 0.0
        self.events = 0

    # --- event queue ----------------------------------------------------------------------

    def _push(self, at: float, kind: int, payload: int) -> None:
        self._seq += 1
        heappush(self._heap, (at, kind, self._seq, payload))

    # --- outcomes -------------------------------------------------------------------------

    def _miss(self, record: RequestRecord) -> None:
        limit = self.config.stop_after_misses
        if limit is None or self._missed[record.index]:
            return
        self._missed[record.index] = 1
        self._misses += 1
        if self._misses > limit:
            self._stop = True

    def _resolve(self, record: RequestRecord, outcome: Outcome, detail: str = "") -> None:
        record.outcome = outcome
        record.detail = detail
        self._resolved += 1
        if outcome is not Outcome.ADMITTED:
            self._miss(record)

    def _rejected(self, rejection: Rejection) -> None:
        record = self._by_id[rejection.request_id]
        self._resolve(record, rejection.outcome, rejection.message)

    # --- scheduler ------------------------------------------------------------------------

    def _pump(self) -> None:
        pumped = self.gateway.pump()
        for rejection in pumped.rejections:
            self._rejected(rejection)
        for admission in pumped.admissions:
            self._admitted(admission)
        self._arm_timer()

    def _arm_timer(self) -> None:
        at = self.gateway.wakeup()
        if at is not None:
            self._push(at, _TIMER, 0)

    def _admitted(self, admission: Admission) -> None:
        now = self.clock.now()
        record = self._by_id[admission.ticket.request_id]
        record.admitted_at = now
        record.lease_id = admission.lease.lease_id
        self._by_lease[admission.lease.lease_id] = record
        chosen = admission.lease.replica  # the gateway's locality index chose (dlpm)
        if chosen is None:
            replica = self.fleet.assign(admission.ticket.pool, admission.ticket.budget)
        else:
            replica = self.fleet.assign_to(admission.ticket.pool, chosen, admission.ticket.budget)
        record.replica = replica.gid
        self._push(now + replica.core.profile.frontend_s, _ENTER, record.index)

    # --- events ---------------------------------------------------------------------------

    def _arrival(self, record: RequestRecord, now: float) -> None:
        gateway = self.gateway
        spec = gateway.policy.tenant(record.tenant)
        record.tier = spec.tier if spec is not None else None
        limit = self.config.slo.ttft_limit(record.input_tokens)
        if limit is not None and self.config.stop_after_misses is not None:
            heappush(self._ttft_watch, (now + limit, record.index))
        pool = route_or_error(gateway, record.input_tokens + record.max_tokens)
        if isinstance(pool, GatewayError):
            self._resolve(record, pool.outcome, pool.message)
            return
        record.pool = pool
        ticket = gateway.ticket(
            record.request_id,
            record.tenant,
            pool,
            record.input_tokens,
            record.max_tokens,
            prefix_blocks=tuple(record.hash_ids),
        )
        rejection = gateway.submit(ticket)
        if rejection is not None:
            self._rejected(rejection)
            return
        self._pump()

    def _enter(self, record: RequestRecord, now: float) -> None:
        assert record.replica is not None and record.lease_id is not None
        replica = self.fleet.replicas[record.replica]
        core = replica.core
        problem = core.check_request(record.input_tokens, record.output_tokens)
        if problem is not None:
            # The engine answers 400 (e.g. the pool routes more tokens than max_model_len).
            self.fleet.done(replica, record.input_tokens + record.max_tokens)
            self.gateway.scheduler.release(record.lease_id, record.input_tokens, 0)
            self._resolve(record, Outcome.BAD_REQUEST, f"engine {replica.name}: {problem}")
            self._pump()
            return
        record.engine_at = now
        block_hashes = None
        if record.hash_ids:
            block_hashes = rechunk_block_hashes(
                record.hash_ids, HASH_BLOCK_TOKENS, record.input_tokens, core.profile.block_size
            )
        core.add_request(
            record.request_id,
            record.input_tokens,
            record.output_tokens,
            now,
            record.priority,
            block_hashes=block_hashes,
        )
        if not replica.busy:
            self._kick(replica, now)

    def _start_step(self, replica: Replica, now: float) -> None:
        result = replica.core.step(now)
        if result.idle:
            return
        replica.busy = True
        replica.pending = result
        self._push(result.end, _STEP_END, replica.gid)

    def _step_end(self, replica: Replica, now: float) -> None:
        result = replica.pending
        assert result is not None
        replica.busy = False
        replica.pending = None
        replica.busy_s += result.duration
        replica.add_busy(result.start, result.duration)
        replica.steps += 1
        replica.tokens += len(result.output)
        by_id = self._by_id
        for request_id in result.first_token:
            record = by_id[request_id]
            record.first_token_at = now
            limit = self.config.slo.ttft_limit(record.input_tokens)
            if limit is not None and now - record.arrival > limit:
                self._miss(record)
        charge = self.gateway.scheduler.charge_output
        for request_id in result.output:
            record = by_id[request_id]
            record.generated += 1
            if record.lease_id is not None and charge(record.lease_id, 1):
                record.charged += 1
        if result.finished:
            release = self.gateway.scheduler.release
            slo = self.config.slo
            for finished in result.finished:
                record = by_id[finished.req_id]
                record.finished_at = finished.finish_time
                record.preemptions = finished.preemptions
                record.cached_tokens = finished.cached_tokens
                self.fleet.done(replica, record.input_tokens + record.max_tokens)
                if record.lease_id is not None:
                    release(record.lease_id, record.input_tokens, finished.output_tokens)
                self._resolve(record, Outcome.ADMITTED)
                if not slo.met(record):
                    self._miss(record)
            self._pump()
        # The next step starts after everything else at this instant (requests admitted by
        # this release with no frontend delay join it), like an engine's next scheduling pass.
        self._kick(replica, now)

    def _kick(self, replica: Replica, now: float) -> None:
        if not replica.kicked:
            replica.kicked = True
            self._push(now, _KICK, replica.gid)

    def _probe(self, now: float) -> None:
        probe = self.config.engine_probe
        assert probe is not None
        for pool, members in self.fleet.by_pool.items():
            probe(now, pool, [replica.core for replica in members])
        self._pump()
        if self._resolved < len(self.records):
            self._push(now + self.config.probe_interval_s, _PROBE, 0)

    def _check_ttft_watch(self, now: float) -> None:
        watch = self._ttft_watch
        records = self.records
        while watch and watch[0][0] < now:
            _at, index = heappop(watch)
            if records[index].first_token_at is None:
                self._miss(records[index])

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        records = self.records
        clock = self.clock
        heap = self._heap
        replicas = self.fleet.replicas
        limit = self.config.time_limit
        watching = self.config.stop_after_misses is not None and self.config.slo.ttft_s is not None
        if records:
            self._push(records[0].arrival, _ARRIVAL, 0)
            if self.config.engine_probe is not None:
                self._push(records[0].arrival, _PROBE, 0)
        events = 0
        while heap and not self._stop:
            at, kind, _seq, payload = heappop(heap)
            if limit is not None and at > limit:
                break
            clock.set(at)
            events += 1
            if kind == _STEP_END:
                self._last_activity = at
                self._step_end(replicas[payload], at)
            elif kind == _ENTER:
                self._enter(records[payload], at)
            elif kind == _ARRIVAL:
                self._last_activity = at
                if payload + 1 < len(records):
                    self._push(records[payload + 1].arrival, _ARRIVAL, payload + 1)
                self._arrival(records[payload], at)
            elif kind == _TIMER:
                self.gateway.timer_fired(at)
                self._pump()
            elif kind == _PROBE:
                self._probe(at)
            else:
                replica = replicas[payload]
                replica.kicked = False
                if not replica.busy:
                    self._start_step(replica, at)
            if watching:
                self._check_ttft_watch(at)
            if self._progress is not None and events & 0xFFF == 0:
                self._progress(at, self._resolved, len(records))
        self.events = events
        if self._progress is not None:
            self._progress(self._last_activity, self._resolved, len(records))
        return SimResult(
            records=records,
            replicas=[self._replica_stats(replica) for replica in replicas],
            fleet=dict(self.fleet.pools),
            end_time=self._last_activity,
            wall_s=time.perf_counter() - started,
            events=events,
            stopped_early=self._stop or any(record.outcome is None for record in records),
            snapshot=self.gateway.scheduler.snapshot(),
            slo=self.config.slo,
        )

    @staticmethod
    def _replica_stats(replica: Replica) -> ReplicaStats:
        profile = replica.core.profile
        return ReplicaStats(
            name=replica.name,
            pool=replica.pool,
            busy_s=replica.busy_s,
            steps=replica.steps,
            output_tokens=replica.tokens,
            preemptions=replica.core.preemptions_total,
            prefix_cache_queries=replica.core.prefix_cache_queries_total,
            prefix_cache_hits=replica.core.prefix_cache_hits_total,
            max_num_seqs=profile.max_num_seqs,
            max_model_len=profile.max_model_len,
            busy_timeline=tuple(replica.busy_buckets),
        )


def simulate(
    requests: Sequence[TraceRequest],
    config: SimConfig,
    progress: ProgressHook | None = None,
) -> SimResult:
    """Run one simulation of `requests` (with tenants) on the configured fleet."""
    return Simulation(requests, config, progress).run()
