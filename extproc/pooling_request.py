"""Validate the bodies of the pooling endpoints (embeddings, rerank, score) and collect what
their prompt tokens are estimated from.

Shapes are vLLM's (0.32, `vllm/entrypoints/pooling/`):

- `POST /v1/embeddings`: OpenAI's `input`, a string, an array of strings, an array of token ids
  or an array of arrays of token ids (vLLM's chat form, `messages`, is accepted too). Token
  ids are counted exactly: the engine tokenises nothing and adds nothing to them.
- `POST /v1/rerank`: `query` and `documents` (Jina / Cohere style), optional `top_n`.
- `POST /v1/score`: two sides, `text_1` / `text_2` (or vLLM's other spellings of the same
  pair: `queries` / `documents`, `queries` / `items`, `data_1` / `data_2`), each one input or an
  array of them; one first input is scored against every second one, otherwise pairwise.

A rerank or score input is a string or `{"content": [parts]}` (multimodal); only text parts
can be estimated. Every input is estimated once, the way vLLM counts a bi-encoder (an
embedding model scoring by cosine: the query once, then each document). A cross-encoder sees
the query again beside each document, so for it this under-estimates by the query's repeats;
the account is settled from the engine's own `usage.prompt_tokens` either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extproc.errors import bad_request
from extproc.prompt import PromptParts

EMBEDDINGS_INPUT_SHAPES = (
    "a string, an array of strings, an array of token ids or an array of arrays of token ids"
)
SCORE_SIDES: tuple[tuple[str, str], ...] = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)
"""vLLM's spellings of the two sides of a score request, in the order it tries them."""


@dataclass(frozen=True, slots=True)
class PoolingPrompt:
    prompt: PromptParts
    """Everything the call encodes: its estimate is the call's cost."""
    longest: PromptParts
    """Its longest single input. The engine runs each input as a sequence of its own, so this,
    not the whole batch, must fit a pool's max_total_tokens."""


def _of_texts(texts: list[str]) -> PoolingPrompt:
    longest = max(texts, key=lambda text: len(text.encode("utf-8", "surrogatepass")))
    return PoolingPrompt(PromptParts(texts=texts), PromptParts(texts=[longest]))


def _of_ids(lengths: list[int]) -> PoolingPrompt:
    return PoolingPrompt(PromptParts(token_ids=sum(lengths)), PromptParts(token_ids=max(lengths)))


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def embeddings_prompt(
    body: dict[str, Any], chat_prompt: Callable[[dict[str, Any]], PromptParts]
) -> PoolingPrompt:
    """What an embeddings request asks the engine to encode. `chat_prompt` parses vLLM's
    chat form (`messages`) like a chat request's."""
    if "input" not in body and "messages" in body:
        messages = chat_prompt(body)  # one conversation: one sequence
        return PoolingPrompt(messages, messages)
    value = body.get("input")
    if value is None:
        raise bad_request(
            f"'input' is required and must be {EMBEDDINGS_INPUT_SHAPES}", "missing_field"
        )
    if isinstance(value, str):
        return _of_texts([value])
    if not isinstance(value, list) or not value:
        raise bad_request(f"'input' must be {EMBEDDINGS_INPUT_SHAPES}, not empty")
    if all(isinstance(item, str) for item in value):
        return _of_texts(list(value))
    if all(_is_token_id(item) for item in value):
        return _of_ids([len(value)])
    if all(isinstance(item, list) for item in value):
        for index, item in enumerate(value):
            if not item or not all(_is_token_id(token) for token in item):
                raise bad_request(
                    f"'input[{index}]' must be a non-empty array of token ids "
                    "(non-negative integers)"
                )
        return _of_ids([len(item) for item in value])
    raise bad_request(f"'input' must be {EMBEDDINGS_INPUT_SHAPES}, one kind throughout")


def _score_input_text(value: Any, where: str) -> str:
    """The text of one rerank / score input: a string, or the text parts of
    `{"content": [parts]}`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        texts = []
        for index, part in enumerate(value["content"]):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"'{where}.content[{index}]' must be an object with a 'type'")
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
        return "\n".join(texts)
    raise bad_request(f"'{where}' must be a string or an object with a 'content' array")


def _score_side(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        raise bad_request(f"'{name}' is required", "missing_field")
    if isinstance(value, list):
        if not value:
            raise bad_request(f"'{name}' must not be an empty array")
        return [_score_input_text(item, f"{name}[{index}]") for index, item in enumerate(value)]
    return [_score_input_text(value, name)]


def _pairs(first: list[str], second: list[str], names: tuple[str, str]) -> PoolingPrompt:
    if len(first) != 1 and len(first) != len(second):
        raise bad_request(
            f"'{names[0]}' must hold one input or as many as '{names[1]}' "
            f"({len(first)} vs {len(second)})"
        )
    return _of_texts(first + second)


def rerank_prompt(body: dict[str, Any]) -> PoolingPrompt:
    """A rerank request: the query against each document."""
    query = body.get("query")
    if query is None:
        raise bad_request("'query' is required", "missing_field")
    top_n = body.get("top_n")
    if top_n is not None and not (_is_token_id(top_n)):
        raise bad_request("'top_n' must be a non-negative integer")
    return _pairs(
        [_score_input_text(query, "query")], _score_side(body, "documents"), ("query", "documents")
    )


def score_prompt(body: dict[str, Any]) -> PoolingPrompt:
    """A score request: its first side against its second (one to many, or pairwise)."""
    for names in SCORE_SIDES:
        if names[0] in body or names[1] in body:
            return _pairs(_score_side(body, names[0]), _score_side(body, names[1]), names)
    spellings = ", ".join(f"'{a}' and '{b}'" for a, b in SCORE_SIDES)
    raise bad_request(f"a score request needs two sides: {spellings}", "missing_field")
