"""API keys are stored as "sha256:<hex>"; a plain key is never kept or logged."""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "sha256:"
_BUCKET_CHARS = 12


def hash_key(plain_key: str) -> str:
    """Return the stored form of an API key."""
    return PREFIX + hashlib.sha256(plain_key.encode("utf-8")).hexdigest()


def is_key_hash(value: str) -> bool:
    digest = value.removeprefix(PREFIX)
    return (
        value.startswith(PREFIX)
        and len(digest) == 64
        and all(c in "0123456789abcdef" for c in digest)
    )


class KeyIndex:
    """Maps a presented key to its tenant.

    Entries are bucketed by a short digest prefix, then the full digest is compared with
    hmac.compare_digest, so the final match does not leak through timing.
    """

    def __init__(self, hashed_keys: dict[str, str]) -> None:
        self._buckets: dict[str, list[tuple[bytes, str]]] = {}
        for stored, tenant in hashed_keys.items():
            digest = stored.removeprefix(PREFIX)
            self._buckets.setdefault(digest[:_BUCKET_CHARS], []).append((digest.encode(), tenant))

    def tenant_for(self, plain_key: str) -> str | None:
        digest = hashlib.sha256(plain_key.encode("utf-8")).hexdigest()
        found: str | None = None
        for stored, tenant in self._buckets.get(digest[:_BUCKET_CHARS], ()):
            if hmac.compare_digest(stored, digest.encode()):
                found = tenant
        return found
