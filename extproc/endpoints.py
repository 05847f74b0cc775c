"""The inference endpoints the gateway admits, and the class each belongs to.

An endpoint class is the unit a tenant's limits can be set in (chat and completions stream
output tokens; embeddings and rerank are batches of input only) and what a pool may be
reserved for. Adding an endpoint is one entry in `ENDPOINTS`; the Envoy allowlist
(`envoy_routes.py`) and the service's own path check (`openai_request.py`) read this table.
"""

from __future__ import annotations

from typing import Final, Literal

EndpointClass = Literal["chat", "completions", "embeddings", "rerank"]

ENDPOINT_CLASSES: Final[tuple[EndpointClass, ...]] = ("chat", "completions", "embeddings", "rerank")

GENERATIVE_CLASSES: Final[frozenset[EndpointClass]] = frozenset({"chat", "completions"})
"""Classes whose responses stream output tokens; the others answer once, input tokens only."""

POOLING_CLASSES: Final[frozenset[EndpointClass]] = frozenset({"embeddings", "rerank"})
"""Classes served by pooling models (vLLM's `--runner pooling`): no output, no stream."""

ENDPOINTS: Final[dict[str, EndpointClass]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/score": "rerank",
}
"""Inference path -> its class. Every path here is admitted under the policy; no other path
reaches an engine."""


def endpoint_class(path: str) -> EndpointClass | None:
    """The class of a normalised inference path, or None when the path is not one."""
    return ENDPOINTS.get(path)
