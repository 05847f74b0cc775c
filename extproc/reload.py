"""Policy hot reload: watch the policy file, reload on change, SIGHUP or POST /v1/reload.

A valid new version goes to `Gateway.apply_policy` (new requests use it at once; queued requests
of removed tenants are answered with a clear error). An invalid version is rejected: every
problem is logged with file:line, `extproc_policy_reloads_total{result="error"}` counts it and
the last good policy stays in force (envoyproxy/ratelimit's behaviour).

The watcher polls the file's identity (device, inode, size, mtime) about once a second, which
costs one stat() call. It follows replace-by-rename (editors, `kubectl` ConfigMap volumes, whose
`..data` symlink is swapped) because the stat follows symlinks and the inode changes. A change is
read only once the identity has held still for a moment, so a file caught half-written is not
reported as an error; if it still is, the next complete write reloads again.

Reading and validating run in a worker thread (`reload_async`), under the YAML bounds of
extproc.policy.yaml_limits and a timeout, so the event loop keeps serving whatever the file
holds. A version whose holds the running Envoy cannot honour is refused (extproc.policy.hold):
the Envoy's `max_message_timeout` is fixed by the policy it was rendered from, the one in force
when the service started.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.metrics import Metrics
from extproc.policy import Policy, PolicyError, compile_policy, parse_policy
from extproc.policy.hold import envoy_hold_limit, holds_over_limit
from extproc.policy.loader import issues_at

log = logging.getLogger("extproc.reload")

FileIdentity = tuple[int, int, int, int]
"""(device, inode, size, mtime in ns) of the policy file; compared, never interpreted."""

_SETTLE_S = 0.05
PARSE_TIMEOUT_S = 10.0


def file_identity(path: str | os.PathLike[str]) -> FileIdentity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class ReloadResult:
    result: str
    """"success", "error" or "unchanged"."""
    trigger: str
    file: str
    errors: tuple[str, ...] = ()
    removed_queued: int = 0
    tenants: int = 0
    fingerprint: str = ""

    @property
    def ok(self) -> bool:
        return self.result != "error"

    def as_json(self) -> dict[str, Any]:
        return {
            "result": self.result,
            "trigger": self.trigger,
            "file": self.file,
            "errors": list(self.errors),
            "removed_queued": self.removed_queued,
            "tenants": self.tenants,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class _Loaded:
    """What reading the file gave: errors, an unchanged file, or a policy to apply."""

    identity: FileIdentity | None = None
    errors: tuple[str, ...] = ()
    fingerprint: str = ""
    policy: Policy | None = None
    unchanged: bool = False


@dataclass
class PolicyReloader:
    """Loads the policy file and hands valid versions to `apply`.

    `apply(policy) -> int` is `Gateway.apply_policy` (returns how many queued requests of
    removed tenants were answered). Not thread-safe: one event loop drives it.
    """

    path: str
    apply: Callable[[Policy], int]
    metrics: Metrics
    interval_s: float = 1.0
    fingerprint: str = ""
    """SHA-256 of the text of the policy in force."""
    last_result: ReloadResult | None = None
    envoy_hold_limit_s: float | None = None
    """max_message_timeout of the Envoy in front (set by mark_loaded); None: not checked."""
    parse_timeout_s: float = PARSE_TIMEOUT_S
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    _identity: FileIdentity | None = field(default=None, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def mark_loaded(self, text: str) -> None:
        """Record the policy that is in force (loaded at start by the caller), and the hold
        limit of the Envoy rendered from it."""
        self.fingerprint = _fingerprint(text)
        self._identity = file_identity(self.path)
        try:
            self.envoy_hold_limit_s = envoy_hold_limit(parse_policy(text, self.path))
        except PolicyError:
            self.envoy_hold_limit_s = None

    # -- one reload -------------------------------------------------------------------------------

    def reload(self, trigger: str, *, skip_unchanged: bool = False) -> ReloadResult:
        """Read, validate and apply the policy file on the calling thread. Never raises for a
        bad file; the YAML bounds keep even a hostile file short to reject."""
        return self._finish(trigger, self._load(skip_unchanged))

    async def reload_async(self, trigger: str, *, skip_unchanged: bool = False) -> ReloadResult:
        """`reload` with the reading and validating in a worker thread, at most
        `parse_timeout_s`; one reload at a time. The policy is applied on the event loop."""
        async with self._lock:
            work = asyncio.ensure_future(asyncio.to_thread(self._load, skip_unchanged))
            done, _ = await asyncio.wait({work}, timeout=self.parse_timeout_s)
            if not done:
                # A thread cannot be stopped; its late result is dropped.
                work.add_done_callback(_drop_result)
                limit = self.parse_timeout_s
                issue = f"{self.path}:1: reading the policy took longer than {limit:g}s"
                timed_out = _Loaded(identity=file_identity(self.path), errors=(issue,))
                return self._finish(trigger, timed_out)
            return self._finish(trigger, work.result())

    def _load(self, skip_unchanged: bool) -> _Loaded:
        """Read and validate; no side effects, so it may run on any thread."""
        identity = file_identity(self.path)
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except OSError as exc:
            issue = f"{self.path}:1: cannot read: {exc.strerror or exc}"
            return _Loaded(identity=identity, errors=(issue,))
        fingerprint = _fingerprint(text)
        if skip_unchanged and fingerprint == self.fingerprint:
            return _Loaded(identity=identity, fingerprint=fingerprint, unchanged=True)
        try:
            source = parse_policy(text, self.path)
            policy = compile_policy(source, self.path)
        except PolicyError as error:
            return _Loaded(identity=identity, errors=tuple(str(i) for i in error.issues))
        limit = self.envoy_hold_limit_s
        over = holds_over_limit(source, limit) if limit is not None else []
        if over:
            found: list[tuple[tuple[str | int, ...], str]] = [
                (
                    ("tenants", name, "limits", "max_queue_wait"),
                    f"a hold of {hold:g}s (max_queue_wait + 5s) exceeds the running Envoy's "
                    f"max_message_timeout of {limit:g}s: lower it, or re-render Envoy with a "
                    "larger gateway.max_message_timeout and restart it first",
                )
                for name, hold in over
            ]
            issues = issues_at(text, self.path, found)
            return _Loaded(identity=identity, errors=tuple(str(i) for i in issues))
        return _Loaded(identity=identity, fingerprint=fingerprint, policy=policy)

    def _finish(self, trigger: str, loaded: _Loaded) -> ReloadResult:
        self._identity = loaded.identity
        if loaded.errors:
            return self._rejected(trigger, loaded.errors)
        if loaded.unchanged or loaded.policy is None:
            result = ReloadResult("unchanged", trigger, self.path, fingerprint=loaded.fingerprint)
            self.metrics.reload_attempt("unchanged")
            log.debug("policy file touched, content unchanged", extra={"fields": result.as_json()})
            self.last_result = result
            return result
        policy = loaded.policy
        removed = self.apply(policy)
        self.fingerprint = loaded.fingerprint
        result = ReloadResult(
            "success", trigger, self.path, removed_queued=removed,
            tenants=len(policy.tenants), fingerprint=loaded.fingerprint,
        )  # fmt: skip
        self.metrics.reload_attempt("success")
        self.metrics.policy_tenants.set(len(policy.tenants))
        log.info("policy reloaded", extra={"fields": result.as_json()})
        self.last_result = result
        return result

    def _rejected(self, trigger: str, errors: tuple[str, ...]) -> ReloadResult:
        result = ReloadResult("error", trigger, self.path, errors=errors)
        self.metrics.reload_attempt("error")
        log.error(
            "policy reload rejected; the last good policy stays in force: %s",
            "; ".join(errors),
            extra={"fields": result.as_json()},
        )
        self.last_result = result
        return result

    # -- watching ---------------------------------------------------------------------------------

    def changed(self) -> bool:
        return file_identity(self.path) != self._identity

    async def watch(self) -> None:
        """Poll the file's identity; reload when it changed and has held still."""
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.changed():
                continue
            seen = file_identity(self.path)
            await asyncio.sleep(_SETTLE_S)
            if file_identity(self.path) != seen:
                continue  # still being written: look again next round
            if seen is None:
                # Deleted (or mid-rename): keep the policy in force, say so once.
                if self._identity is not None:
                    log.warning(
                        "policy file is gone; the last good policy stays in force",
                        extra={"fields": {"file": self.path}},
                    )
                self._identity = None
                continue
            try:
                await self.reload_async("watch", skip_unchanged=True)
            except Exception:  # pragma: no cover - apply() failing is a bug; keep watching
                log.exception("policy reload failed")

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.watch(), name="policy-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _drop_result(work: asyncio.Future[_Loaded]) -> None:
    if not work.cancelled():
        work.exception()  # retrieved, so asyncio does not log it as never seen


def _fingerprint(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
