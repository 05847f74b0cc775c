"""Deterministic token counting and output text for the emulated engine (no tokenizer).

Counting rule, chosen to be stable and easy to predict in tests:

- A text counts ceil(utf8_bytes / 4) tokens (an empty text counts 0). Four bytes per token is
  the usual average for English with cl100k-style tokenizers.
- Completions: the prompt string by the text rule; a list of token ids counts its length.
- Chat: every message counts MESSAGE_OVERHEAD_TOKENS (role and template markers) plus its
  text content (a string, or the "text" parts of a content list) plus, for assistant messages
  that carry `tool_calls`, their compact JSON. A request's `tools` add their compact JSON.
  The total is at least 1.

Token ids, for prefix caching: a text piece of 4 bytes is one id (the bytes as a 32-bit
integer, the last piece zero-padded); a message's template markers are ids derived from its
role; a completions prompt given as token ids keeps them.

Output: token i of a completion is OUTPUT_WORDS[i % len(OUTPUT_WORDS)] preceded by a space:
exactly 4 ASCII bytes, so feeding a generated reply back as a prompt counts the same number of
tokens under the text rule.
"""

from __future__ import annotations

import zlib
from typing import Any

import orjson

MESSAGE_OVERHEAD_TOKENS = 4
BYTES_PER_TOKEN = 4
_MARKER_BASE = 1 << 40
"""Marker ids lie above every id a 4-byte text piece can take (< 2**32)."""

OUTPUT_WORDS: tuple[str, ...] = (
    "the", "cat", "sat", "and", "saw", "one", "red", "fox", "run", "far",
    "off", "its", "den", "old", "oak", "sun", "set", "low", "sky", "all",
    "had", "tea", "now", "new", "day", "for", "you", "who", "can", "fly",
)  # fmt: skip

_PIECES: tuple[str, ...] = tuple(" " + word for word in OUTPUT_WORDS)


class PromptError(ValueError):
    """The request's prompt or messages have a shape the emulator cannot count."""


def text_tokens(text: str) -> int:
    n = len(text.encode("utf-8"))
    return -(-n // BYTES_PER_TOKEN)


def _text_ids(text: str, out: list[int]) -> None:
    data = text.encode("utf-8")
    if len(data) % BYTES_PER_TOKEN:
        data += b"\0" * (-len(data) % BYTES_PER_TOKEN)
    out.extend(memoryview(data).cast("I").tolist())


def _json_ids(value: Any, out: list[int]) -> None:
    _text_ids(orjson.dumps(value).decode("utf-8"), out)


def _content_ids(content: Any, out: list[int]) -> None:
    if content is None:
        return
    if isinstance(content, str):
        _text_ids(content, out)
        return
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                raise PromptError("each content part must be an object")
            text = part.get("text")
            if part.get("type") == "text" and isinstance(text, str):
                _text_ids(text, out)
        return
    raise PromptError("message content must be a string, a list of parts or null")


def _marker_ids(role: Any) -> list[int]:
    """The MESSAGE_OVERHEAD_TOKENS ids of a message's template markers, by role."""
    base = _MARKER_BASE + (zlib.crc32(str(role).encode("utf-8")) << 3)
    return [base + k for k in range(MESSAGE_OVERHEAD_TOKENS)]


def chat_prompt_token_ids(messages: Any, tools: Any = None) -> list[int]:
    """The token ids of a chat request's prompt: `tools` first (as templates render them in
    the system turn), then each message's markers, text and tool calls. Equal ids for equal
    renderings, so a resent conversation shares its prefix with the earlier turn."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    ids: list[int] = []
    if tools:
        _json_ids(tools, ids)
    for message in messages:
        if not isinstance(message, dict):
            raise PromptError("each message must be an object")
        ids += _marker_ids(message.get("role"))
        _content_ids(message.get("content"), ids)
        tool_calls = message.get("tool_calls")
        if tool_calls:
            _json_ids(tool_calls, ids)
    return ids


def chat_prompt_tokens(messages: Any, tools: Any = None) -> int:
    """Prompt tokens of a chat request's `messages` (and `tools`)."""
    return max(len(chat_prompt_token_ids(messages, tools)), 1)


def completion_prompt_token_ids(prompt: Any) -> list[int]:
    """The token ids of a completions request's `prompt` (one prompt only)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids: list[int] = []
        _text_ids(prompt, ids)
        return ids
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise PromptError("'prompt' must be a string or a list of token ids (one prompt only)")


def completion_prompt_tokens(prompt: Any) -> int:
    """Prompt tokens of a completions request's `prompt` (one prompt only)."""
    return len(completion_prompt_token_ids(prompt))


def output_piece(index: int) -> str:
    """The text of output token `index` (0-based)."""
    return _PIECES[index % len(_PIECES)]


def output_text(num_tokens: int) -> str:
    return "".join(output_piece(i) for i in range(num_tokens))
