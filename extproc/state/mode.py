"""The mode the shared state runs in."""

from __future__ import annotations

import enum


class Mode(enum.StrEnum):
    SHARED = "shared"
    """Redis answers: budgets, capacity and fair share are shared."""
    LOCAL = "local"
    """Redis is away (`on_failure: local`): this process enforces its share of every limit."""
    CLOSED = "closed"
    """Redis is away (`on_failure: closed`): new requests are answered 503."""
