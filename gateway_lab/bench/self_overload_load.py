"""What `extproc bench self-overload` sends (gateway_lab.bench.self_overload): its loads and
timing, the request specs, and the flooder's client in a process of its own.

By default one load generator sends both tenants' requests on one event loop. Above the
engine's capacity the flooder's 48 streams a second of 256 tokens are ~12,000 chunks a second
for that loop to read, and a quiet request then waits for the loop: its first byte leaves late,
or its first chunk is read late (the `in` and `out` parts of gateway_lab.bench.quiet_path).
A real quiet tenant is not in its flooder's client. The `-apart` arms send the flood from a
child process (`python -m gateway_lab.bench.self_overload_load`, on the same cores), so
the quiet tenant's loop reads only its own stream; the flooder's records come back to the
parent at the end, timed on the same clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
from dataclasses import dataclass
from typing import Any

import orjson

from gateway_lab.bench.loadgen import Load, open_loop
from gateway_lab.bench.records import Meter, Record, Spec
from gateway_lab.bench.self_overload_arms import KEYS

MODEL = "bench"


@dataclass(frozen=True)
class Workload:
    quiet_rate: float = 1.0
    quiet_output: int = 64
    room_rate: float = 32.0
    room_output: int = 64
    over_rate: float = 48.0
    over_output: int = 256
    prompt_words: int = 12
    """One-line prompts."""

    def flood(self, load: str) -> tuple[float, int]:
        return (self.room_rate, self.room_output) if load == "room" else (
            self.over_rate, self.over_output
        )  # fmt: skip


@dataclass(frozen=True)
class Timing:
    measure_s: float = 30.0
    warmup_s: float = 3.0
    grace_s: float = 10.0

    @classmethod
    def quick(cls) -> Timing:
        return cls(4.0, 1.0, 3.0)


@dataclass(frozen=True, slots=True)
class CompletionSpec(Spec):
    include_usage: bool = False

    def body(self) -> bytes:
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body)


def maker(tenant: str, output: int, work: Workload, seed: int, usage: bool) -> Any:
    rng = random.Random(seed)
    words = ("tell", "me", "a", "story", "about", "the", "sea", "and", "a", "ship", "at", "dawn")
    prompts = [
        " ".join(rng.choice(words) for _ in range(work.prompt_words)) + "." for _ in range(16)
    ]
    headers = {"x-tenant-id": tenant, "x-bench-tenant": tenant}

    def make(index: int) -> Spec:
        return CompletionSpec(
            tenant, KEYS[tenant], prompts[index % 16], work.prompt_words + 2, output, headers,
            include_usage=usage,
        )  # fmt: skip

    return make


RECORDS_LIMIT = 1 << 27
"""The longest line read from the child: its records, one JSON line (~100 bytes a request)."""
_FIELDS = tuple(f.name for f in dataclasses.fields(Record) if f.name != "chunks")
"""What of a record crosses the process boundary (a flooder keeps no chunks)."""


@dataclass(frozen=True)
class FloodJob:
    """The flooder's open loop, as the child runs it: its times are on the parent's clock
    (`t0`, a `time.perf_counter` value: one monotonic clock for every process of the host)."""

    url: str
    t0: float
    rate: float
    output: int
    work: Workload
    seed: int
    usage: bool
    request_timeout_s: float | None


async def flood(job: FloodJob, start: float, until: float) -> list[Record]:
    """Run the flooder's open loop from `start` to `until` (in the child) and return its
    records."""
    make = maker("flooder", job.output, job.work, job.seed, job.usage)
    async with Load(job.url, Meter(bin_s=0.5), t0=job.t0,
                    request_timeout_s=job.request_timeout_s) as load:  # fmt: skip
        await open_loop(load, make, job.rate, until, seed=job.seed + 1, start=start)
        return list(load.records)


async def start_flood(job: FloodJob) -> asyncio.subprocess.Process:
    """The child process for `job`, once it is ready to send (its imports take a second or
    so, which must not become a burst of overdue arrivals); `begin_flood` starts it."""
    args = orjson.dumps(job)  # a dataclass, nested `work` included
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway_lab.bench.self_overload_load", args.decode(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=RECORDS_LIMIT,
    )  # fmt: skip
    assert child.stdout is not None
    if await child.stdout.readline() != b"ready\n":
        child.kill()
        await child.wait()
        raise RuntimeError("the flooder's process did not start")
    return child


async def begin_flood(child: asyncio.subprocess.Process, start: float, until: float) -> None:
    assert child.stdin is not None
    child.stdin.write(orjson.dumps([start, until]) + b"\n")
    await child.stdin.drain()


async def collect_flood(child: asyncio.subprocess.Process) -> list[Record]:
    """The child's records, once its loop has ended. It stays alive until `end_flood`, so the
    CPU it used can still be read at the window's end."""
    assert child.stdout is not None
    line = await child.stdout.readline()
    if not line:
        raise RuntimeError(f"the flooder's process failed (exit {await child.wait()})")
    return [Record(**dict(zip(_FIELDS, row, strict=True))) for row in orjson.loads(line)]


async def end_flood(child: asyncio.subprocess.Process) -> None:
    """Let the child exit (it waits for its stdin to close); kill it if it does not."""
    if child.returncode is not None:
        return
    if child.stdin is not None:
        child.stdin.close()
    try:
        await asyncio.wait_for(child.wait(), timeout=10.0)
    except TimeoutError:
        child.kill()
        await child.wait()


class Flood:
    """The flooder's open loop of one arm: on the load generator's own `load`, or, `apart`, in
    a child process (`async with`: the child starts, and is killed if the run fails).
    Nothing for the `alone` load."""

    def __init__(
        self, load: Load, arm_load: str, work: Workload, seed: int, usage: bool,
        apart: bool = False,
    ) -> None:  # fmt: skip
        self.load = load
        self.apart = apart
        self.active = arm_load != "alone"
        self.rate, self.output = work.flood(arm_load)
        self.work = work
        self.seed = seed
        self.usage = usage
        self.child: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Flood:
        if self.active and self.apart:
            job = FloodJob(self.load.url, self.load.t0, self.rate, self.output, self.work,
                           self.seed, self.usage, self.load.request_timeout_s)  # fmt: skip
            self.child = await start_flood(job)
        return self

    async def __aexit__(self, failed: type[BaseException] | None, *exc: object) -> None:
        if self.child is None:
            return
        if failed is not None and self.child.returncode is None:
            self.child.kill()
        await end_flood(self.child)

    @property
    def pid(self) -> int | None:
        return None if self.child is None else self.child.pid

    async def run(self, start: float, until: float) -> None:
        """Send the flood from `start` to `until` (the load's run time), cut at `until`."""
        if self.child is None:
            make = maker("flooder", self.output, self.work, self.seed, self.usage)
            await open_loop(self.load, make, self.rate, until, seed=self.seed + 1, start=start)
            return
        await begin_flood(self.child, start, until)
        self.load.records.extend(await collect_flood(self.child))


def _job_of(text: str) -> FloodJob:
    fields = orjson.loads(text)
    return FloodJob(**{**fields, "work": Workload(**fields["work"])})


def main(argv: list[str]) -> int:
    job = _job_of(argv[1])
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.buffer.flush()
    start, until = orjson.loads(sys.stdin.buffer.readline())
    records = asyncio.run(flood(job, start, until))
    rows = [[getattr(record, name) for name in _FIELDS] for record in records]
    sys.stdout.buffer.write(orjson.dumps(rows) + b"\n")
    sys.stdout.buffer.flush()
    sys.stdin.buffer.read()  # until the parent closes it: its CPU reading is done
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
