"""Choose the pool for a request by its token budget."""

from __future__ import annotations

from extproc.errors import bad_request
from extproc.policy import Policy


def choose_pool(policy: Policy, budget_tokens: int) -> str:
    """The smallest pool whose max_total_tokens holds the budget (prompt + max output)."""
    for name, pool in policy.pools_by_size:
        if budget_tokens <= pool.max_total_tokens:
            return name
    largest = policy.pools_by_size[-1][1].max_total_tokens
    raise bad_request(
        f"request needs about {budget_tokens} tokens (prompt + max_tokens); "
        f"the largest pool allows {largest}",
        "context_length_exceeded",
    )
