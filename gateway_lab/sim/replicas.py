"""Engine replicas of the simulated pools: one `EngineCore` each, plus the bookkeeping the
simulator needs (outstanding work for load balancing, busy time, the running step).

Load balancing inside a pool (`Balance`):

- ``tokens`` (default): among the replicas with a free sequence slot (fewer outstanding
  requests than max_num_seqs; all of them if none has one), the one with the fewest
  outstanding token budgets (prompt + max_tokens, which the gateway knows for every request it
  admitted), ties to fewer requests, then the lowest index: a token-aware endpoint picker that
  never sends a request to a full engine while another has room;
- ``requests``: the fewest outstanding requests (Envoy's LEAST_REQUEST; blind to sizes, so a
  replica can collect several long prefills while another idles);
- ``round-robin``: Envoy's default cluster policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from gateway_lab.engine.model import EngineCore, StepResult
from gateway_lab.sim.fleet import PoolEngines

Balance = Literal["requests", "tokens", "round-robin"]
BALANCES: tuple[Balance, ...] = ("requests", "tokens", "round-robin")

TIMELINE_BUCKET_S = 60.0
"""Width of the busy-time histogram kept per replica (utilisation over time)."""


class Replica:
    __slots__ = (
        "busy",
        "busy_buckets",
        "busy_s",
        "core",
        "gid",
        "index",
        "kicked",
        "outstanding",
        "outstanding_tokens",
        "pending",
        "pool",
        "steps",
        "tokens",
    )

    def __init__(self, pool: PoolEngines, index: int, gid: int) -> None:
        self.pool = pool.name
        self.index = index
        self.gid = gid
        """Index in the simulator's flat replica list (event payload)."""
        self.core = EngineCore(pool.profile)
        self.busy = False
        self.kicked = False
        self.pending: StepResult | None = None
        self.outstanding = 0
        """Requests sent to this replica (in transit or in the engine) and not finished."""
        self.outstanding_tokens = 0
        """Their token budgets (prompt + max_tokens)."""
        self.busy_s = 0.0
        self.busy_buckets: list[float] = []
        self.steps = 0
        self.tokens = 0

    def add_busy(self, start: float, duration: float) -> None:
        """Spread a step's busy time over the timeline buckets it overlaps."""
        buckets = self.busy_buckets
        end = start + duration
        first = int(start // TIMELINE_BUCKET_S)
        last = int(end // TIMELINE_BUCKET_S)
        while len(buckets) <= last:
            buckets.append(0.0)
        if first == last:
            buckets[first] += duration
            return
        buckets[first] += (first + 1) * TIMELINE_BUCKET_S - start
        for index in range(first + 1, last):
            buckets[index] += TIMELINE_BUCKET_S
        buckets[last] += end - last * TIMELINE_BUCKET_S

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.index}"


class Fleet:
    """Every pool's replicas and the pool's load-balancing choice."""

    def __init__(self, pools: Mapping[str, PoolEngines], balance: Balance = "requests") -> None:
        if balance not in BALANCES:
            raise ValueError(f"unknown balance {balance!r}; use one of {', '.join(BALANCES)}")
        self.pools = dict(pools)
        self.balance = balance
        self.replicas: list[Replica] = []
        self.by_pool: dict[str, list[Replica]] = {}
        self._next: dict[str, int] = {}
        for name, spec in pools.items():
            members = []
            for index in range(spec.replicas):
                replica = Replica(spec, index, len(self.replicas))
                self.replicas.append(replica)
                members.append(replica)
            self.by_pool[name] = members
            self._next[name] = 0

    def assign(self, pool: str, tokens: int) -> Replica:
        """Choose the replica for a request with this token budget and count it there."""
        members = self.by_pool[pool]
        if self.balance == "round-robin":
            index = self._next[pool]
            self._next[pool] = (index + 1) % len(members)
            best = members[index]
        elif self.balance == "tokens":
            slots = self.pools[pool].profile.max_num_seqs
            best = min(
                members,
                key=lambda r: (
                    r.outstanding >= slots,
                    r.outstanding_tokens,
                    r.outstanding,
                    r.index,
                ),
            )
        else:
            best = min(members, key=lambda r: (r.outstanding, r.index))
        best.outstanding += 1
        best.outstanding_tokens += tokens
        return best

    def assign_to(self, pool: str, index: int, tokens: int) -> Replica:
        """Count a request on the replica the gateway chose (its index in the pool)."""
        members = self.by_pool[pool]
        chosen = members[index % len(members)]
        chosen.outstanding += 1
        chosen.outstanding_tokens += tokens
        return chosen

    @staticmethod
    def done(replica: Replica, tokens: int) -> None:
        replica.outstanding -= 1
        replica.outstanding_tokens -= tokens
