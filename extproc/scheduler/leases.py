"""Admitted work: taking a queued request into a lease, charging streamed output, settling
real usage, and freeing the lease's capacity exactly once."""

from __future__ import annotations

from extproc.endpoints import EndpointClass
from extproc.policy.model import LatencyDelta, Objective
from extproc.scheduler.latency import IDLE_INFLIGHT, LOW_BATCH, allowed_lag
from extproc.scheduler.live import Live, below_class_concurrency, below_concurrency
from extproc.scheduler.pools import PoolState
from extproc.scheduler.records import LeaseState, PoolUsage, QueueEntry
from extproc.scheduler.types import ENGINE_PRIORITY_STRIDE, Admission, Lease


class Leases:
    def __init__(self, live: Live) -> None:
        self._live = live
        self._lease_seq = 0

    def admit(
        self, pool: PoolState, entry: QueueEntry, now: float, light: bool, reserve: bool = False
    ) -> Admission:
        """Take the entry into a lease; `light`: its tenant was within its fair share;
        `reserve`: it goes above a hard limit cut below what is in flight (`fits_reserve`).
        Taken above the soft limit (the headroom), the fair share does not count it
        (`LeaseState.fair_exempt`)."""
        live = self._live
        ticket = entry.ticket
        state = live.tenants[ticket.tenant]
        spec = live.policy.tenants[ticket.tenant]
        state.queues[pool.name].pop_head()
        band = state.bands[pool.name]  # only a member's request is chosen
        band.queued -= 1
        pool.budget_left(ticket.budget)
        pool.lift_hold_of(state.name)
        del live.entries[ticket.request_id]
        state.queued -= 1
        live.timers.entry_left(entry)
        budget = ticket.budget
        idle = pool.prefilling_tokens == 0 and pool.capacity.inflight <= IDLE_INFLIGHT
        headroom = not pool.capacity.has_slot()
        pool.capacity.acquire(budget)
        prefilling = ticket.input_tokens if ticket.streamed else 0
        pool.prefilling_tokens += prefilling
        pool.prefilling_requests += prefilling > 0
        used = pool.users.get(state.name)
        if used is None:
            used = pool.users[state.name] = PoolUsage()
            pool.active_changes += 1
        used.requests += 1
        used.tokens += budget
        state.inflight += 1
        by_class = state.inflight_by_class
        by_class[ticket.endpoint] = by_class.get(ticket.endpoint, 0) + 1
        state.inflight_tokens += budget
        cost = 0.0
        if not headroom:
            cost = live.fair_cost(ticket)
            band.fair.on_dispatch(state.name, cost)
        self._lease_seq += 1
        replica = live.locality.route(pool.name, ticket.prefix_blocks, ticket.input_tokens)
        lease = Lease(
            lease_id=self._lease_seq,
            request_id=ticket.request_id,
            tenant=ticket.tenant,
            pool=pool.name,
            tier=spec.tier,
            budget=budget,
            admitted_at=now,
            expires_at=now + live.policy.source.gateway.lease_timeout,
            replica=replica,
            fair_exempt=headroom,
        )
        reserved = ticket.max_output_tokens if live.reserve_output else 0
        live.leases[lease.lease_id] = LeaseState(
            lease, ticket, reserved, cost, entry=entry, light=light,
            prefilling=prefilling, alone_sample=idle and ticket.streamed, reserve=reserve,
            fair_exempt=headroom,
        )  # fmt: skip
        pool.reserve_inflight += reserve
        live.timers.lease_added(lease.expires_at, lease.lease_id)
        self._compact_timers()
        state.dispatches.record(now)
        state.served_requests += 1
        state.served_tokens += budget
        if below_concurrency(state, spec) and below_class_concurrency(state, spec, ticket.endpoint):
            live.sync(state, pool.name)
        else:
            live.sync_all(state)
        pool_spec = live.policy.pools.get(pool.name)
        engine_priority = None
        if pool_spec is not None and pool_spec.engine_priority:
            engine_priority = live.rank(spec) * ENGINE_PRIORITY_STRIDE + (0 if light else 1)
        return Admission(ticket, lease, now - entry.enqueued_at, entry.headers, engine_priority)

    def _compact_timers(self) -> None:
        """Drop timer entries of requests and leases that are gone, once they dominate."""
        live = self._live
        timers = live.timers
        if timers.leases_need_compaction(len(live.leases)):
            timers.rebuild_leases(
                (held.lease.expires_at, lease_id) for lease_id, held in live.leases.items()
            )
        if timers.entries_need_compaction(len(live.entries)):
            live.rebuild_entry_timers()

    def first_token(self, held: LeaseState, now: float) -> None:
        """Its first token passed: its prompt is no longer being prefilled; its TTFT is a
        δ sample (and an alone sample if the pool was nearly idle at its admission)."""
        if held.first_token:
            return
        held.first_token = True
        pool = self._live.pools.get(held.lease.pool)
        if pool is None:
            return
        pool.prefilling_tokens -= held.prefilling
        pool.prefilling_requests -= held.prefilling > 0
        held.prefilling = 0
        if not held.ticket.streamed:
            return  # its first byte comes with its last token: no TTFT to learn from
        ttft = now - self._submitted_at(held)
        prompt = held.ticket.input_tokens
        alone = pool.alone.ttft(prompt)  # before this sample teaches it
        if alone is not None:
            lag = ttft - alone
            self._live.delta_of(held.lease.tenant).ttft.add(lag, now)
            objective = self._objective(held)
            if objective is not None:
                self._steer(pool, lag, objective, objective.first_token, alone, now)
        if held.alone_sample and pool.prefilling_tokens == 0:
            # idle at its admission and still no other prompt in the engine at its first token:
            # one admitted meanwhile may have shared its prefill step. Timed from its admission:
            # a request alone does not wait at the door, and one that waited seconds there (a
            # backlogged tenant's, held by this very controller) would teach seconds as "alone".
            pool.alone.observe_ttft(prompt, now - held.lease.admitted_at)

    def _submitted_at(self, held: LeaseState) -> float:
        entry = held.entry
        return held.lease.admitted_at if entry is None else entry.enqueued_at

    def _observe_chunk(
        self, held: LeaseState, tokens: int, now: float, largest_gap: float | None = None
    ) -> None:
        """A chunk of `tokens` output tokens arrived: the token δ, and the k-th token's lag.
        `largest_gap`: the tokens came as one batch of several chunks (counting in Envoy), and
        this was the longest gap between two of them: the δ sample is that gap's."""
        if not held.first_token:
            self.first_token(held, now)
        last, held.tokens_at = held.tokens_at, now
        pool = self._live.pools.get(held.lease.pool)
        if last is None or pool is None:
            return  # the first chunk with tokens only starts the clock (its gap is the TTFT)
        mean_gap = (now - last) / tokens
        gap = mean_gap if largest_gap is None else largest_gap
        alone = pool.alone
        step = alone.step()  # before this sample teaches it
        if pool.capacity.inflight <= LOW_BATCH and pool.prefilling_tokens == 0:
            # a gap with another prompt being prefilled is that prompt's step, not a decode
            alone.observe_step(mean_gap)
        if step is None:
            return
        self._live.delta_of(held.lease.tenant).tokens.add(gap - step, now)
        objective = self._objective(held)
        if objective is None:
            return
        self._steer(pool, gap - step, objective, objective.token_gap, step, now)
        first = alone.ttft(held.ticket.input_tokens)
        if first is not None and objective.every_token is not None:
            alone_until = first + (held.output_seen - 1) * step
            lag = now - self._submitted_at(held) - alone_until
            self._steer(pool, lag, objective, objective.every_token, alone_until, now)

    def _objective(self, held: LeaseState) -> LatencyDelta | None:
        """The δ objectives of a light tenant's tier (a backlogged tenant's lag steers
        nothing)."""
        if not held.light:
            return None
        options = self._live.policy.source.tier_options.get(held.lease.tier)
        return None if options is None else options.latency_delta

    @staticmethod
    def _steer(
        pool: PoolState,
        lag: float,
        objectives: LatencyDelta,
        objective: Objective | None,
        alone_s: float,
        now: float,
    ) -> None:
        """A light tenant's lag drives the pool's δ controller, against `objective`, one of
        its tier's `objectives` (None: that kind of token is not watched); `alone_s` is what
        the token would have taken alone, for an objective relative to it."""
        if objective is not None:
            bound = allowed_lag(objective, alone_s)
            pool.delta.observe(lag, bound, now, objectives.quantile)

    def charge_output(
        self, held: LeaseState, tokens: int, now: float, largest_gap: float | None = None
    ) -> None:
        if tokens <= 0:
            return
        held.output_seen += tokens
        self._observe_chunk(held, tokens, now, largest_gap)
        extra = held.output_seen - held.charged_output
        if extra > 0:
            held.charged_output = held.output_seen
            if held.fair_exempt:
                return
            cost = self._live.policy.source.fairness.output_weight * extra
            held.fair_charged += cost
            band = self._live.band_of(held.lease.tenant, held.lease.pool)
            if band is not None:
                band.fair.charge(held.lease.tenant, cost)

    def settle(
        self, held: LeaseState, actual_in: int | None, actual_out: int | None, now: float
    ) -> None:
        """Correct the token buckets and the fair share from the reservation to real usage
        (a missing actual keeps its estimate)."""
        ticket = held.ticket
        in_tokens = ticket.input_tokens if actual_in is None else max(0, actual_in)
        out_tokens = ticket.max_output_tokens if actual_out is None else max(0, actual_out)
        fairness = self._live.policy.source.fairness
        fair_out = max(held.charged_output, held.output_seen) if actual_out is None else out_tokens
        final = fairness.input_weight * in_tokens + fairness.output_weight * fair_out
        self.charge_difference(
            ticket.tenant,
            held.lease.pool,
            ticket.endpoint,
            in_tokens + out_tokens - ticket.budget,
            0.0 if held.fair_exempt else final - held.fair_charged,
            now,
        )

    def correct(
        self,
        tenant: str,
        pool: str,
        endpoint: EndpointClass,
        d_in: int,
        d_out: int,
        now: float,
        *,
        fair: bool = True,
    ) -> None:
        """A later correction of a settled request's input and output tokens (`fair`: False
        for a request that was outside the fair share, `Lease.fair_exempt`)."""
        fairness = self._live.policy.source.fairness
        cost = fairness.input_weight * d_in + fairness.output_weight * d_out if fair else 0.0
        self.charge_difference(tenant, pool, endpoint, d_in + d_out, cost, now)

    def charge_difference(
        self,
        tenant: str,
        pool: str,
        endpoint: EndpointClass,
        delta_tokens: int,
        delta_cost: float,
        now: float,
    ) -> None:
        """Move a tenant's served tokens, usage-settled buckets and fair-share counter by what
        its real usage differs from what was charged."""
        live = self._live
        state = live.tenants.get(tenant)
        if state is not None:
            state.served_tokens += delta_tokens
        spec = live.policy.tenant(tenant)
        if spec is not None:
            live.limiter.settle(tenant, endpoint, spec, delta_tokens, now)
        band = live.band_of(tenant, pool)
        if band is not None and delta_cost != 0:
            band.fair.charge(tenant, delta_cost)

    def free(self, held: LeaseState) -> None:
        live = self._live
        lease = held.lease
        state = live.tenants[lease.tenant]
        spec = live.policy.tenant(lease.tenant)
        endpoint = held.ticket.endpoint
        was_blocked = spec is not None and not (
            below_concurrency(state, spec) and below_class_concurrency(state, spec, endpoint)
        )
        state.inflight -= 1
        by_class = state.inflight_by_class
        by_class[endpoint] -= 1
        if not by_class[endpoint]:
            del by_class[endpoint]
        state.inflight_tokens -= lease.budget
        pool = live.pools[lease.pool]
        pool.capacity.release(lease.budget)
        pool.reserve_inflight -= held.reserve
        pool.prefilling_tokens -= held.prefilling
        pool.prefilling_requests -= held.prefilling > 0
        held.prefilling = 0
        live.locality.finished(lease.pool, lease.replica)
        used = pool.users.get(lease.tenant)
        if used is not None:
            used.requests -= 1
            used.tokens -= lease.budget
            if used.requests <= 0:
                del pool.users[lease.tenant]
                pool.active_changes += 1
        if pool.retired and pool.capacity.inflight == 0:
            del live.pools[lease.pool]
        if was_blocked:
            live.sync_all(state)
        if spec is None and state.inflight == 0 and state.queued == 0:
            del live.tenants[lease.tenant]

    def reclaim_expired(self, now: float) -> int:
        """Free leases past their expiry (their release was lost); returns how many."""
        count = 0
        for lease_id in self._live.timers.expired_leases(now):
            held = self._live.leases.pop(lease_id, None)
            if held is not None:
                self.free(held)
                count += 1
        return count
