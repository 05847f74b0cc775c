"""An emulated vLLM OpenAI-compatible HTTP server driven by EngineCore.

One asyncio task runs the engine: it takes a step from the core, sleeps until the step's end in
real time (clock: time.monotonic, not the loop's clock, which uvloop rounds to 1 ms and caches
per iteration), then delivers that step's tokens to the waiting request handlers; with no work it
awaits an event. While work lasts, a step starts where the previous one ended, not when the
loop wakes (`gateway_lab.engine.timeline`): the HTTP side's lag delays deliveries, not the
model's steps. Request and response JSON, SSE framing, error bodies and `vllm:` metrics
follow vLLM's OpenAI server; the pooling endpoints (embeddings, rerank, score) are in
`gateway_lab.engine.pooling_api`. Every output is generated as if `ignore_eos` were set: a request
always produces its `max_tokens` (finish_reason "length").

max_tokens: `max_completion_tokens` (chat) or `max_tokens`; when absent, `default_max_tokens`
(256 unless configured) capped at max_model_len - prompt tokens. vLLM's own default is the whole
remaining context, which makes run lengths unpredictable; pass a value to be exact.
`n`, `temperature` and other sampling options are accepted and ignored; `min_tokens` and
`ignore_eos` are validated and otherwise have no effect. `priority` is validated as vLLM's
pydantic model does and goes to the scheduler (which ignores it under "fcfs", as vLLM does).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from extproc.types import ENGINE_HEADER
from gateway_lab.engine.metrics import CONTENT_TYPE, EngineMetrics
from gateway_lab.engine.model import EngineCore, StepResult
from gateway_lab.engine.openai_api import (
    MAX_BODY_BYTES,
    ApiError,
    Params,
    error_middleware,
    full_body,
    parse_request,
    read_json,
    sse_event,
    token_event,
    usage_of,
)
from gateway_lab.engine.pooling_api import PoolingKind, parse_pooling_request, response_body
from gateway_lab.engine.profiles import EngineProfile, get_profile
from gateway_lab.engine.timeline import StepClock, StepTimeline

log = logging.getLogger(__name__)

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_MAX_TOKENS = 256
_SHUTDOWN_TIMEOUT_S = 2.0

# Events a request handler receives from the step loop.
_TOKEN = 0
_FINISHED = 1
_STOPPED = -1


class _Pending:
    __slots__ = ("arrival", "events", "last_token", "stream")

    def __init__(self, arrival: float, stream: bool) -> None:
        self.arrival = arrival
        self.stream = stream
        self.last_token = -1.0
        self.events: asyncio.Queue[int] = asyncio.Queue()


class EngineServer:
    """One emulated vLLM engine: an EngineCore, its step loop and an aiohttp app."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        engine_id: str | None = None,
        model: str = DEFAULT_MODEL,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        strict_model: bool = True,
        step_clock: StepClock = "model",
    ) -> None:
        """`step_clock`: "model", a step that follows another starts where it ended
        (gateway_lab/engine/timeline.py); "wake", when the event loop gets to it (the emulator
        before 2026-12-05, kept to measure what the host's lag adds: `extproc bench
        engine-clock`)."""
        if default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        self.profile = profile
        self.host = host
        self.model = model
        self.default_max_tokens = default_max_tokens
        self.strict_model = strict_model
        self.step_clock = step_clock
        self.core = EngineCore(profile)
        self.metrics = EngineMetrics(self.core, model)
        self._requested_port = port
        self._engine_id = engine_id
        self._port: int | None = None
        self._pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._timeline = StepTimeline()
        self._closing = False
        self._failed = False
        self._loop_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.app = self._make_app()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the engine server is not started")
        return self._port

    @property
    def engine_id(self) -> str:
        return self._engine_id or f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        )
        await runner.setup()
        self._runner = runner
        family, _, _, _, address = socket.getaddrinfo(
            self.host, self._requested_port, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError:
            sock.close()
            await runner.cleanup()
            raise
        site = web.SockSite(runner, sock, backlog=1024)
        await site.start()
        self._port = sock.getsockname()[1]
        self._loop_task = asyncio.create_task(self._step_loop(), name=f"engine-{self.engine_id}")
        log.info("engine %s (%s) listening on %s", self.engine_id, self.profile.name, self.base_url)

    async def stop(self) -> None:
        self._closing = True
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_pending()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def _fail_pending(self) -> None:
        for pending in self._pending.values():
            pending.events.put_nowait(_STOPPED)

    # -- the step loop -----------------------------------------------------------------------

    async def _step_loop(self) -> None:
        core = self.core
        clock = time.monotonic
        timeline = self._timeline
        anchored = self.step_clock == "model"
        try:
            while True:
                if not core.has_work:
                    timeline.idle()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                now = clock()
                result = core.step(timeline.start(now) if anchored else now)
                if result.idle:
                    timeline.idle()
                    await asyncio.sleep(0)  # defensive: never spin without yielding
                    continue
                timeline.ended(result.end)
                delay = result.end - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                self._deliver(result, clock())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine %s step loop failed", self.engine_id)
            self._failed = True
            self._fail_pending()

    def _deliver(self, result: StepResult, now: float) -> None:
        pending = self._pending
        metrics = self.metrics
        done = {f.req_id for f in result.finished} if result.finished else set()
        for req_id in result.output:
            entry = pending.get(req_id)
            if entry is None:
                continue
            if entry.last_token < 0:
                metrics.ttft.observe(now - entry.arrival)
            else:
                metrics.inter_token.observe(now - entry.last_token)
            entry.last_token = now
            if req_id in done:
                entry.events.put_nowait(_FINISHED)
                metrics.e2e.observe(now - entry.arrival)
            elif entry.stream:
                entry.events.put_nowait(_TOKEN)
        for finished in result.finished:
            metrics.queue_time.observe(finished.scheduled_time - finished.arrival_time)
            if finished.output_tokens:
                metrics.success["length"] += 1
                continue
            # A pooling request: done at its prefill, no token delivered above (vLLM counts
            # it as finished by "stop").
            metrics.success["stop"] += 1
            entry = pending.get(finished.req_id)
            if entry is not None:
                metrics.e2e.observe(now - entry.arrival)
                entry.events.put_nowait(_FINISHED)

    # -- HTTP --------------------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware])
        app.on_response_prepare.append(self._add_engine_header)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/completions", self._completions)
        for kind in ("embeddings", "rerank", "score"):
            app.router.add_post(f"/v1/{kind}", functools.partial(self._pooling, kind=kind))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _add_engine_header(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[ENGINE_HEADER] = self.engine_id

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=500 if self._failed else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.profile.max_model_len,
        }
        body = {"object": "list", "data": [card]}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrival = time.monotonic()
        params = parse_request(
            await read_json(request),
            chat,
            model=self.model,
            strict_model=self.strict_model,
            max_model_len=self.profile.max_model_len,
            default_max_tokens=self.default_max_tokens,
        )
        if self.profile.frontend_s > 0:
            await asyncio.sleep(self.profile.frontend_s)
        if self._closing or self._failed:
            raise ApiError(503, "The engine is not running.", "ServiceUnavailableError")
        entry = _Pending(arrival, params.stream)
        req_id = params.req_id
        self._pending[req_id] = entry
        try:
            now = time.monotonic()
            self.core.add_request(
                req_id,
                params.prompt_tokens,
                params.max_tokens,
                now,
                params.priority,
                token_ids=params.prompt_token_ids,
            )
            self._timeline.arrived(now)
            self._wake.set()
            if params.stream:
                return await self._stream(request, params, entry)
            if await entry.events.get() == _STOPPED:
                raise ApiError(503, "The engine stopped.", "ServiceUnavailableError")
            return web.Response(
                body=orjson.dumps(full_body(params)), content_type="application/json"
            )
        finally:
            del self._pending[req_id]
            # Still known to the core only if it did not finish: the client went away.
            if self.core.abort(req_id):
                self.metrics.success["abort"] += 1

    async def _pooling(self, request: web.Request, *, kind: PoolingKind) -> web.Response:
        """One pooling call: an engine request per input, each only prefilled; the answer
        once all have finished."""
        arrival = time.monotonic()
        params = parse_pooling_request(
            kind,
            await read_json(request),
            model=self.model,
            strict_model=self.strict_model,
            max_model_len=self.profile.max_model_len,
        )
        if self.profile.frontend_s > 0:
            await asyncio.sleep(self.profile.frontend_s)
        if self._closing or self._failed:
            raise ApiError(503, "The engine is not running.", "ServiceUnavailableError")
        ids = [f"{params.req_id}-{index}" for index in range(len(params.tokens))]
        entries = [_Pending(arrival, False) for _ in ids]
        self._pending.update(zip(ids, entries, strict=True))
        try:
            now = time.monotonic()
            for req_id, tokens in zip(ids, params.tokens, strict=True):
                self.core.add_request(req_id, tokens, 0, now, params.priority, pooling=True)
            self._timeline.arrived(now)
            self._wake.set()
            for entry in entries:
                if await entry.events.get() == _STOPPED:
                    raise ApiError(503, "The engine stopped.", "ServiceUnavailableError")
            return web.Response(
                body=orjson.dumps(response_body(params)), content_type="application/json"
            )
        finally:
            for req_id in ids:
                del self._pending[req_id]
                if self.core.abort(req_id):
                    self.metrics.success["abort"] += 1

    async def _stream(
        self, request: web.Request, params: Params, entry: _Pending
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
            }
        )
        await response.prepare(request)
        sent = 0
        events = entry.events
        try:
            while True:
                first = await events.get()
                batch = [first]
                while not events.empty():
                    batch.append(events.get_nowait())
                out = bytearray()
                if sent == 0 and params.chat:
                    role = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    counts = usage_of(params, 0) if params.continuous_usage else None
                    out += sse_event(params, [role], counts)
                finished = stopped = False
                for event in batch:
                    if event == _STOPPED:
                        stopped = True
                        break
                    finished = event == _FINISHED
                    out += token_event(params, sent, finished)
                    sent += 1
                if finished and params.include_usage:
                    out += sse_event(params, [], usage_of(params, sent))
                if finished:
                    out += b"data: [DONE]\n\n"
                if out:
                    await response.write(bytes(out))
                if finished or stopped:
                    break
        except ConnectionError:
            pass  # the client went away; the caller aborts the request
        return response


@contextlib.asynccontextmanager
async def running_engine(
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    profile: str | EngineProfile = "fast",
    engine_id: str | None = None,
    model: str = DEFAULT_MODEL,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    strict_model: bool = True,
    step_clock: StepClock = "model",
    **overrides: Any,
) -> AsyncIterator[EngineServer]:
    """Start an engine in this event loop; stop it on exit. `overrides` replace profile fields.

    `async with running_engine(profile="fast") as engine:` then use `engine.base_url`.
    """
    if isinstance(profile, str):
        resolved = get_profile(profile, **overrides)
    else:
        resolved = profile.with_overrides(overrides)
    server = EngineServer(
        resolved,
        host=host,
        port=port,
        engine_id=engine_id,
        model=model,
        default_max_tokens=default_max_tokens,
        strict_model=strict_model,
        step_clock=step_clock,
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
