"""Choose the pool for a request by its endpoint class and its token budget."""

from __future__ import annotations

from extproc.endpoints import GENERATIVE_CLASSES, EndpointClass
from extproc.errors import bad_request, endpoint_not_served
from extproc.policy import Policy


def choose_pool(policy: Policy, budget_tokens: int, endpoint: EndpointClass = "chat") -> str:
    """The smallest pool serving `endpoint` whose max_total_tokens holds the longest sequence
    the request runs: its budget (prompt + max output), or for the pooling classes its longest
    single input (a batch's inputs run as sequences of their own)."""
    pools = policy.pools_by_class[endpoint]
    if not pools:
        raise endpoint_not_served(endpoint)
    for name, pool in pools:
        if budget_tokens <= pool.max_total_tokens:
            return name
    largest = pools[-1][1].max_total_tokens
    needs = "prompt + max_tokens" if endpoint in GENERATIVE_CLASSES else "its longest input"
    raise bad_request(
        f"request needs about {budget_tokens} tokens ({needs}); the largest pool allows {largest}",
        "context_length_exceeded",
    )
