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

log = logging.getLogger("extproc.reload")

FileIdentity = tuple[int, int, int, int]
"""(device, inode, size, mtime in ns) of the policy file; compared, never interpreted."""

_SETTLE_S = 0.05


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
    _identity: FileIdentity | None = field(default=None, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def mark_loaded(self, text: str) -> None:
        """Record the policy that is in force (loaded at start by the caller)."""
        self.fingerprint = _fingerprint(text)
        self._identity = file_identity(self.path)

    # -- one reload -------------------------------------------------------------------------------

    def reload(self, trigger: str, *, skip_unchanged: bool = False) -> ReloadResult:
        """Read, validate and apply the policy file. Never raises for a bad file."""
        self._identity = file_identity(self.path)
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except OSError as exc:
            issue = f"{self.path}:1: cannot read: {exc.strerror or exc}"
            return self._rejected(trigger, (issue,))
        fingerprint = _fingerprint(text)
        if skip_unchanged and fingerprint == self.fingerprint:
            result = ReloadResult("unchanged", trigger, self.path, fingerprint=fingerprint)
            self.metrics.reload_attempt("unchanged")
            log.debug("policy file touched, content unchanged", extra={"fields": result.as_json()})
            self.last_result = result
            return result
        try:
            policy = compile_policy(parse_policy(text, self.path), self.path)
        except PolicyError as error:
            return self._rejected(trigger, tuple(str(issue) for issue in error.issues))
        removed = self.apply(policy)
        self.fingerprint = fingerprint
        result = ReloadResult(
            "success", trigger, self.path, removed_queued=removed,
            tenants=len(policy.tenants), fingerprint=fingerprint,
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
                self.reload("watch", skip_unchanged=True)
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


def _fingerprint(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
