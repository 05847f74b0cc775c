"""Deterministic token counting and output text for the emulated engine (no tokenizer).

Counting rule, chosen to be stable and easy to predict in tests:

- A text counts ceil(utf8_bytes / 4) tokens (an empty text counts 0). Four bytes per token is
  the usual average for English with cl100k-style tokenizers.
- Completions: the prompt string by the text rule; a list of token ids counts its length.
- Chat: every message counts MESSAGE_OVERHEAD_TOKENS (role and template markers) plus its
  text content (a string, or the "text" parts of a content list) plus, for assistant messages
  that carry `tool_calls`, their compact JSON. A request's `tools` add their compact JSON.
  The total is at least 1.

Output: token i of a completion is OUTPUT_WORDS[i % len(OUTPUT_WORDS)] preceded by a space:
exactly 4 ASCII bytes, so feeding a generated reply back as a prompt counts the same number of
tokens under the text rule.
"""

from __future__ import annotations

from typing import Any

import orjson

MESSAGE_OVERHEAD_TOKENS = 4
BYTES_PER_TOKEN = 4

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


def _json_tokens(value: Any) -> int:
    return -(-len(orjson.dumps(value)) // BYTES_PER_TOKEN)


def _content_tokens(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, dict):
                raise PromptError("each content part must be an object")
            text = part.get("text")
            if part.get("type") == "text" and isinstance(text, str):
                total += text_tokens(text)
        return total
    raise PromptError("message content must be a string, a list of parts or null")


def chat_prompt_tokens(messages: Any, tools: Any = None) -> int:
    """Prompt tokens of a chat request's `messages` (and `tools`)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            raise PromptError("each message must be an object")
        total += MESSAGE_OVERHEAD_TOKENS + _content_tokens(message.get("content"))
        tool_calls = message.get("tool_calls")
        if tool_calls:
            total += _json_tokens(tool_calls)
    if tools:
        total += _json_tokens(tools)
    return max(total, 1)


def completion_prompt_tokens(prompt: Any) -> int:
    """Prompt tokens of a completions request's `prompt` (one prompt only)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return len(prompt)
    raise PromptError("'prompt' must be a string or a list of token ids (one prompt only)")


def output_piece(index: int) -> str:
    """The text of output token `index` (0-based)."""
    return _PIECES[index % len(_PIECES)]


def output_text(num_tokens: int) -> str:
    return "".join(output_piece(i) for i in range(num_tokens))
