"""A policy with a pool for pooling models (embeddings, rerank) beside the generative pools
of tests.conftest.policy_yaml, and the request bodies the pooling tests send."""

from __future__ import annotations

from typing import Any

from tests.conftest import policy_yaml

EMBED_POOL = "embed"


def pooling_policy_yaml(embed_endpoint: str = "127.0.0.1:8003", **options: Any) -> str:
    """policy_yaml's pools plus `embed`, serving embeddings and rerank (and only them)."""
    pool = (
        f"  {EMBED_POOL}:\n"
        "    max_total_tokens: 8192\n"
        "    max_inflight: 16\n"
        "    max_inflight_tokens: 400000\n"
        f'    endpoints: ["{embed_endpoint}"]\n'
        "    serves: [embeddings, rerank]\n"
        "    headroom: 0\n"
        "    adaptive: {enabled: false}\n"
    )
    return policy_yaml(**options).replace("pools:\n", "pools:\n" + pool, 1)


def embeddings_body(inputs: Any, model: str = "m") -> dict[str, Any]:
    return {"model": model, "input": inputs}


def rerank_body(query: str, documents: list[str], model: str = "m") -> dict[str, Any]:
    return {"model": model, "query": query, "documents": documents}


def score_body(text_1: Any, text_2: Any, model: str = "m") -> dict[str, Any]:
    return {"model": model, "text_1": text_1, "text_2": text_2}


def chat_and_pooling_policy_yaml(chat_endpoint: str, embed_endpoint: str) -> str:
    """Two pools: `short` for chat and completions, `embed` for embeddings and rerank; one
    engine each (what the real-vLLM tier runs on two cores)."""
    text = policy_yaml(chat_endpoint, embed_endpoint)
    start = text.index("  long:\n")
    end = text.index("\n", text.index("adaptive:", start)) + 1
    pool = (
        f"  {EMBED_POOL}:\n"
        "    max_total_tokens: 2048\n"
        "    max_inflight: 16\n"
        "    max_inflight_tokens: 400000\n"
        f'    endpoints: ["{embed_endpoint}"]\n'
        "    serves: [embeddings, rerank]\n"
        "    headroom: 0\n"
        "    adaptive: {enabled: false}\n"
    )
    return text[:start] + pool + text[end:]
