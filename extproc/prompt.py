"""What a request asks an engine to tokenise, as admission estimates it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptParts:
    """The text that will be tokenised, split by role so framing can be estimated."""

    texts: list[str] = field(default_factory=list)
    messages: int = 0
    tools_json: str = ""
    tools: int = 0
    token_ids: int = 0
    """Tokens the request gives as ids (embeddings `input`): counted exactly, not estimated."""
