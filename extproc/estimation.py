"""Estimate a request's prompt tokens before any engine has seen it.

Two modes (policy `estimation.mode`):

- ``bytes`` (default): UTF-8 bytes divided by a bytes-per-token ratio per content category, plus
  framing overhead per chat message, per request and per tool. The ratio of each category starts
  at a prior measured with the cl100k tokenizer and is then learned online, by an exponential
  moving average, from the real ``usage.prompt_tokens`` of completed requests (`observe`).
- ``tiktoken``: exact token counts of the texts with a tiktoken encoding, plus the same framing.

Categories and their cl100k priors (bytes per token; see docs/estimation.md for the sources):

=========  =====  ==========================================================================
category   prior  what falls in it
=========  =====  ==========================================================================
prose      5.0    Latin-script natural language of a paragraph or more
chat       4.1    short natural-language turns (under CHAT_MAX_BYTES): punctuation, names
                  and the first word weigh more, so fewer bytes per token
code       3.4    source code: indented lines, dense brackets/operators, fenced blocks
json       4.0    tool schemas (`tools`), tool calls and any text that is a JSON document
cjk        2.5    han ideographs, hangul, full-width forms (3 UTF-8 bytes each)
kana       2.9    kana and CJK punctuation, U+3000..U+3FFF (lead byte E3)
other      2.6    other non-ASCII characters (Cyrillic, Greek, Arabic, Devanagari, emoji)
=========  =====  ==========================================================================

A text's bytes may be split across categories: its CJK characters count as ``cjk`` / ``kana``,
its other non-ASCII characters as ``other`` when they are a large part of what is left, fenced
code blocks as ``code``, and the rest by the classifier. Classification looks at no more than
the first `SAMPLE_BYTES` bytes and uses only C-level byte counts, so an estimate costs about
2-7 microseconds for a 2 KB body (tiktoken mode: about 80).

Learning: a completed request's actual tokens minus the framing are attributed to the
categories in proportion to their estimated tokens (so every category present is corrected
by the same factor, weighted by its share), and each category keeps a bias-corrected EMA
(decay `settings.decay`) of its observed bytes per token. The learned ratio replaces the prior
once the category has `settings.min_samples` samples' worth of weight. The conservative
variant multiplies every ratio by `conservative_factor` (0.9), over-estimating tokens on purpose.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

from extproc.openai_request import PromptParts
from extproc.policy.model import Estimation

log = logging.getLogger(__name__)

CATEGORIES: tuple[str, ...] = ("prose", "chat", "code", "json", "cjk", "kana", "other")
PROSE, CHAT, CODE, JSON, CJK, KANA, OTHER = range(len(CATEGORIES))

# Measured with cl100k on real text (docs/estimation.md); "kana"
# from Japanese chat (ASDC: 2.87 for whole texts, about 3.0 for the kana alone); "other" from
# a handful of Cyrillic, Greek, Arabic and Devanagari sentences (2.1..3.5).
PRIOR_BYTES_PER_TOKEN: dict[str, float] = {
    "prose": 5.0,
    "chat": 4.1,
    "code": 3.4,
    "json": 4.0,
    "cjk": 2.5,
    "kana": 2.9,
    "other": 2.6,
}

CHAT_MAX_BYTES = 48  # natural-language texts shorter than this are "chat"
SAMPLE_BYTES = 512  # the classifier looks at most at this many leading bytes
# An observation whose content estimate is off by more than this factor is not learned from
# (images, truncation, a template the framing does not model): it would only add noise.
MAX_LEARN_FACTOR = 4.0
MIN_RATIO, MAX_RATIO = 0.5, 32.0

_CODE_SYMBOLS = b"{}()[];=<>_*#/\\|&`$"
# UTF-8 lead bytes of U+3000..U+DFFF (CJK punctuation, kana, CJK ideographs, hangul) and of
# U+F000..U+FFFF (mostly CJK compatibility ideographs and full-width punctuation).
_CJK_LEADS = bytes(range(0xE3, 0xEE)) + b"\xef"


class _Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class CategoryState:
    """What the estimator believes about one category (for the admin API and metrics)."""

    category: str
    prior: float
    learned: float | None  # bias-corrected EMA; None before any sample
    samples: float  # weight of evidence seen (1.0 = one request entirely of this category)
    active: float  # the ratio estimates use now (before the conservative factor)


def _classify_sample(raw: bytes, size: int, truncated: bool, lines: int = -1) -> int:
    """Natural text vs code vs JSON, from cheap counts on (a sample of) a text's UTF-8 bytes."""
    stripped = raw.strip()
    if stripped[:1] in (b"{", b"[") and (truncated or stripped[-1:] in (b"}", b"]")):
        return JSON  # (a truncated sample of a document has lost its closing bracket)
    symbols = len(raw) - len(raw.translate(None, _CODE_SYMBOLS))
    if lines < 0:
        lines = raw.count(b"\n")
    if lines >= 2:
        indented = raw.count(b"\n    ") + raw.count(b"\n\t")
        if indented * 4 >= lines and symbols * 100 >= len(raw):
            return CODE
    if symbols * 20 >= len(raw) and len(raw) >= 16:
        return CODE
    return CHAT if size < CHAT_MAX_BYTES else PROSE


def _add_text(text: str, out: list[float], forced: int = -1) -> None:
    """Add a text's UTF-8 bytes to `out`, split by category. `forced` overrides the classifier
    for the non-CJK part (tool schemas are JSON whatever they look like)."""
    if text.isascii():
        size = len(text)
        if not size:
            return
        if forced >= 0:
            out[forced] += size
            return
        truncated = size > SAMPLE_BYTES
        raw = (text[:SAMPLE_BYTES] if truncated else text).encode()
        lines = raw.count(b"\n")
        if lines >= 2 and raw.count(b"`") >= 3 and "```" in text:
            _add_fenced(text, out)
        else:
            out[_classify_sample(raw, size, truncated, lines)] += size
        return
    raw = text.encode("utf-8", "surrogatepass")
    size = len(raw)
    # Every character has one lead byte, so the continuation bytes are size - len(text); a
    # CJK character (lead byte E3..EF) has two of them. What continuation bytes are left
    # belong to other scripts, mostly two-byte characters (one lead + one continuation).
    cjk_chars = size - len(raw.translate(None, _CJK_LEADS))
    cjk = 3 * cjk_chars
    rest = size - cjk
    if cjk_chars:
        # Characters U+3000..U+3FFF (lead byte E3: kana and CJK punctuation) tokenise at
        # more bytes per token than han characters; one single-byte count finds them.
        kana = 3 * raw.count(b"\xe3")
        out[KANA] += kana
        cjk -= kana
    out[CJK] += cjk
    if rest <= 0:
        return
    other = 2 * max(0, size - len(text) - 2 * cjk_chars)
    if other * 10 >= rest * 3:  # a third of what is left is non-ASCII: a non-Latin script
        out[OTHER] += rest
    elif forced >= 0:
        out[forced] += rest
    elif rest * 4 < size:  # a few digits and ASCII punctuation inside CJK text
        out[CHAT if rest < CHAT_MAX_BYTES else PROSE] += rest
    else:
        out[_classify_sample(raw[:SAMPLE_BYTES], rest, size > SAMPLE_BYTES)] += rest


def _add_fenced(text: str, out: list[float]) -> None:
    """Markdown with ``` fences: the fenced blocks are code (or JSON), the rest is classified."""
    parts = text.split("```")
    last = len(parts) - 1
    for index, part in enumerate(parts):
        size = len(part)
        if index % 2:  # inside a fence; the info string ("python", "json") ends at the newline
            size += 6 if index < last else 3  # its opening and closing fences
            info, _, body = part.partition("\n")
            category = JSON if "json" in info.lower() else CODE
            if category == CODE and body.lstrip()[:1] in ("{", "["):
                category = JSON
            out[category] += size
        elif part.strip():
            truncated = len(part) > SAMPLE_BYTES
            raw = (part[:SAMPLE_BYTES] if truncated else part).encode()
            out[_classify_sample(raw, len(text), truncated)] += size
        else:
            out[CODE] += size


def categorize(text: str) -> dict[str, int]:
    """Bytes of `text` per category (only categories present), as the estimator sees them."""
    out = [0.0] * len(CATEGORIES)
    _add_text(text, out)
    return {CATEGORIES[i]: int(b) for i, b in enumerate(out) if b}


def classify(text: str) -> str:
    """The category holding most of `text`'s bytes ("prose" for an empty text)."""
    out = [0.0] * len(CATEGORIES)
    _add_text(text, out)
    best = max(range(len(out)), key=out.__getitem__)
    return CATEGORIES[best] if out[best] else "prose"


class TokenEstimator:
    """Prompt tokens from bytes per token per content category, learned online from usage."""

    def __init__(
        self,
        settings: Estimation,
        *,
        mode: str | None = None,
        conservative: bool | None = None,
        learn: bool | None = None,
    ) -> None:
        n = len(CATEGORIES)
        self._sum = [0.0] * n  # EMA numerator: decayed sum of weight * observed ratio
        self._weight = [0.0] * n  # EMA denominator: decayed sum of weights
        self._samples = [0.0] * n  # undecayed sum of weights (the min_samples gate)
        self._ratio = [0.0] * n  # active ratio per category (before the conservative factor)
        self._inv = [0.0] * n  # tokens per byte used by estimates (after the factor)
        self._encoding: _Encoding | None = None
        self.observations = 0
        self.skipped = 0  # observations too far off to learn from
        self.last_error: float | None = None  # estimated / actual of the last observation
        self._overrides = (mode, conservative, learn)
        self.configure(settings)

    # -- configuration ------------------------------------------------------------------

    def configure(self, settings: Estimation) -> None:
        """Apply (new) settings, keeping what has been learned (for a policy hot reload)."""
        mode, conservative, learn = self._overrides
        self.settings = settings
        self.mode: str = mode if mode is not None else settings.mode
        self.conservative: bool = (
            conservative if conservative is not None else settings.conservative
        )
        self.learn: bool = learn if learn is not None else settings.learn
        self.conservative_factor = settings.conservative_factor
        self.tokens_per_message = settings.tokens_per_message
        self.tokens_per_tool = settings.tokens_per_tool
        self.tokens_per_request = settings.tokens_per_request
        self.decay = settings.decay
        self.min_samples = settings.min_samples
        priors = dict(PRIOR_BYTES_PER_TOKEN)
        priors.update({str(name): ratio for name, ratio in settings.category_priors.items()})
        self.priors = [float(priors[name]) for name in CATEGORIES]
        self._encoding = None
        if self.mode == "tiktoken":
            self._encoding = _load_encoding(settings.encoding)
            if self._encoding is None:
                self.mode = "bytes"
        elif self.mode == "flat":
            self.learn = False
        self._refresh()

    def _refresh(self) -> None:
        factor = self.conservative_factor if self.conservative else 1.0
        for c in range(len(CATEGORIES)):
            if self.mode == "flat":
                ratio = self.settings.default_bytes_per_token
            elif self._samples[c] >= self.min_samples and self._weight[c] > 0:
                ratio = self._sum[c] / self._weight[c]
            else:
                ratio = self.priors[c]
            self._ratio[c] = ratio
            self._inv[c] = 1.0 / (ratio * factor)

    # -- estimating ---------------------------------------------------------------------

    def framing(self, prompt: PromptParts) -> int:
        """Template tokens around the texts: per chat message, per request and per tool."""
        framing = prompt.tools * self.tokens_per_tool
        if prompt.messages:
            framing += prompt.messages * self.tokens_per_message + self.tokens_per_request
        return framing

    def category_bytes(self, prompt: PromptParts) -> list[float]:
        """UTF-8 bytes of the prompt per category, indexed like CATEGORIES."""
        out = [0.0] * len(CATEGORIES)
        for text in prompt.texts:
            _add_text(text, out)
        if prompt.tools_json:
            _add_text(prompt.tools_json, out, JSON)
        return out

    def estimate_prompt(self, prompt: PromptParts) -> int:
        """Estimated prompt tokens (at least 1)."""
        if self._encoding is not None:
            return max(1, self._exact_content(prompt) + self.framing(prompt))
        inv = self._inv
        tokens = 0.0
        for c, size in enumerate(self.category_bytes(prompt)):
            if size:
                tokens += size * inv[c]
        return max(1, math.ceil(tokens) + self.framing(prompt))

    def _exact_content(self, prompt: PromptParts) -> int:
        encoding = self._encoding
        assert encoding is not None
        count = sum(len(encoding.encode_ordinary(text)) for text in prompt.texts if text)
        if prompt.tools_json:
            count += len(encoding.encode_ordinary(prompt.tools_json))
        return count

    # -- learning -----------------------------------------------------------------------

    def observe(
        self, prompt: PromptParts, actual_prompt_tokens: int, estimated: int | None = None
    ) -> float:
        """Learn from a completed request's real `usage.prompt_tokens`.

        Returns estimated / actual (> 1 over-estimated), for the estimation-error metric; the
        estimate is `estimated` when given (what admission used), else the current estimate.
        """
        if estimated is None:
            estimated = self.estimate_prompt(prompt)
        actual = max(1, actual_prompt_tokens)
        error = estimated / actual
        self.last_error = error
        self.observations += 1
        if not self.learn or self._encoding is not None or actual_prompt_tokens <= 0:
            return error
        sizes = self.category_bytes(prompt)
        ratio = self._ratio
        content_est = 0.0
        for c, size in enumerate(sizes):
            if size:
                content_est += size / ratio[c]
        content_actual = actual_prompt_tokens - self.framing(prompt)
        if content_est <= 0:
            return error
        if content_actual < 1 or not (
            1 / MAX_LEARN_FACTOR <= content_est / content_actual <= MAX_LEARN_FACTOR
        ):
            self.skipped += 1
            return error
        correction = content_est / content_actual  # same factor for every category present
        decay = self.decay
        for c, size in enumerate(sizes):
            if not size:
                continue
            share = size / ratio[c] / content_est
            observed = min(MAX_RATIO, max(MIN_RATIO, ratio[c] * correction))
            # Forget in proportion to the evidence: a category with 1% of the request decays
            # its memory by decay**0.01, so small shares do not wash out what was learned.
            keep = decay**share
            self._sum[c] = keep * self._sum[c] + share * observed
            self._weight[c] = keep * self._weight[c] + share
            self._samples[c] += share
        self._refresh()
        return error

    # -- introspection ------------------------------------------------------------------

    def chat_bytes_per_token(self) -> float:
        """The active bytes per token of chat text (what the locality index's blocks hold)."""
        return self._ratio[CHAT]

    def state(self) -> list[CategoryState]:
        return [
            CategoryState(
                category=name,
                prior=self.priors[c],
                learned=self._sum[c] / self._weight[c] if self._weight[c] > 0 else None,
                samples=self._samples[c],
                active=self._ratio[c],
            )
            for c, name in enumerate(CATEGORIES)
        ]

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view for the admin API."""
        return {
            "mode": self.mode,
            "conservative": self.conservative,
            "observations": self.observations,
            "skipped": self.skipped,
            "last_error": self.last_error,
            "categories": {
                s.category: {
                    "prior": s.prior,
                    "learned": s.learned,
                    "samples": round(s.samples, 3),
                    "bytes_per_token": s.active,
                }
                for s in self.state()
            },
        }


def _load_encoding(name: str) -> _Encoding | None:
    try:
        import tiktoken

        encoding: _Encoding = tiktoken.get_encoding(name)
    except Exception as error:  # unknown name, missing package or data: fall back to bytes
        log.warning("tiktoken encoding %r unavailable (%s): estimating by bytes", name, error)
        return None
    return encoding
