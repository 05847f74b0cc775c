"""Coverage-guided fuzzing (atheris, libFuzzer) of the parsers that read what clients and
engines send: the request parser (`parse_inference_request`, `normalise_path`) may only raise
GatewayError; the usage parsers (`SseUsageParser`, `JsonUsageParser`) never raise, and give
the same answer however the body is cut into chunks. libFuzzer's per-input timeout bounds the
time one input may take.

CI runs each target for a bounded number of inputs (tests/adversarial/test_parser_fuzz.py);
a longer run:

    python -m tests.fuzz_parsers request --max-time 600
    python -m tests.fuzz_parsers sse --max-time 600 --corpus /tmp/sse-corpus

A failure prints the traceback and writes the input as crash-* (or timeout-*) under
--artifacts; `python -m tests.fuzz_parsers request <that file>` replays it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris
import orjson

with atheris.instrument_imports():
    from extproc.errors import GatewayError
    from extproc.openai_request import INFERENCE_PATHS, normalise_path, parse_inference_request
    from extproc.sse import JsonUsageParser, SseUsageParser

PER_INPUT_TIMEOUT_S = 2
"""libFuzzer reports an input that takes longer as a failure (timeout-*)."""
MAX_INPUT_BYTES = 64 * 1024

_REQUEST_SEEDS = [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
     "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 3},
    {"model": "m", "prompt": ["a", "b"], "max_tokens": 1, "stream": False},
    {"model": "m", "prompt": "x", "n": 2},
]  # fmt: skip
_SSE_SEEDS = [
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
    b"\n\ndata: [DONE]\n\n",
    b'event: error\r\ndata: {"error":{"message":"x"}}\r\n\r\n',
    b'data: {"choices":[{"text":"a","finish_reason":"stop"}]}\r\r: comment\n\n',
    b'{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":7,'
    b'"completion_tokens":3,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":2}}}',
]
_DICTIONARY = [
    '"model"', '"messages"', '"role"', '"content"', '"user"', '"text"', '"type"', '"prompt"',
    '"max_tokens"', '"max_completion_tokens"', '"stream"', '"stream_options"',
    '"include_usage"', "true", "false", "null", "-1", "0", "1e400", '"\\u0000"', '"\\ud800"',
    "data: ", "[DONE]", "event: ", '"usage"', '"choices"', '"delta"', '"prompt_tokens"',
    '"completion_tokens"', '"total_tokens"', '"error"', '"tool_calls"', "\r\n", "%2f", "%2F",
    "%5c", "/..", "/./", "//", "%69", "?", "#",
]  # fmt: skip


def request_target(data: bytes) -> None:
    # The last byte picks the endpoint; the rest is the body.
    path = INFERENCE_PATHS[data[-1] % len(INFERENCE_PATHS)] if data else INFERENCE_PATHS[0]
    raw = data[:-1]
    try:
        request = parse_inference_request(path, raw)
    except GatewayError as error:
        assert 400 <= error.status < 500, error
        return
    assert request.max_tokens is None or request.max_tokens >= 1
    assert isinstance(request.stream, bool) and isinstance(request.model, str)


def path_target(data: bytes) -> None:
    path = data.decode("utf-8", "surrogateescape")
    try:
        normalised = normalise_path(path)
    except GatewayError as error:
        assert error.status == 400, error
        return
    assert normalised.startswith("/")
    assert "//" not in normalised and "\\" not in normalised, normalised
    assert not {".", ".."} & set(normalised.split("/")), normalised


_CUT_SPEC_BYTES = 8


def _cuts(spec: bytes, body: bytes) -> list[bytes]:
    """The body cut where `spec` says: its first byte how many cuts (up to 7), the next ones
    where (a fraction of the length each)."""
    count = spec[0] % _CUT_SPEC_BYTES if spec else 0
    points = sorted({b * len(body) // 255 for b in spec[1 : 1 + count]})
    edges = [0, *points, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges)]


def sse_target(data: bytes) -> None:
    # The last bytes say where to cut the body into chunks; the rest is the body.
    body, spec = data[:-_CUT_SPEC_BYTES], data[-_CUT_SPEC_BYTES:]
    whole, pieces = SseUsageParser(), SseUsageParser()
    whole.feed(body)
    whole.close()
    for piece in _cuts(spec, body):
        pieces.feed(piece)
    pieces.close()
    observed = (whole.usage, whole.done, whole.output_tokens_seen, whole.malformed, whole.error)
    split = (pieces.usage, pieces.done, pieces.output_tokens_seen, pieces.malformed, pieces.error)
    assert observed == split, (observed, split)
    assert whole.output_tokens_seen >= 0
    json_whole, json_pieces = JsonUsageParser(), JsonUsageParser()
    json_whole.feed(body)
    for piece in _cuts(spec, body):
        json_pieces.feed(piece)
    assert json_whole.finish() == json_pieces.finish()


TARGETS: dict[str, Callable[[bytes], None]] = {
    "request": request_target,
    "path": path_target,
    "sse": sse_target,
}


def _seed_corpus(target: str, folder: Path) -> None:
    if target == "request":
        seeds = [orjson.dumps(seed) + bytes([i]) for seed in _REQUEST_SEEDS for i in range(2)]
    elif target == "path":
        seeds = [
            b"/v1/chat/completions",
            b"/v1//chat/./completions/",
            b"/v1/%63hat/..%2f",
            b"/?a#b",
        ]
    else:
        seeds = [body + bytes([3, 40, 90, 200, 0, 0, 0, 0]) for body in _SSE_SEEDS]
    for index, seed in enumerate(seeds):
        (folder / f"seed-{index}").write_bytes(seed)


def _escaped(token: str) -> str:
    """A libFuzzer dictionary entry: printable ASCII as is, every other byte as \\xNN."""
    return "".join(
        chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\x{b:02x}"
        for b in token.encode("utf-8")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--runs", type=int, default=-1, help="inputs to try (-1: no bound)")
    parser.add_argument("--max-time", type=int, default=0, help="seconds (0: no bound)")
    parser.add_argument("--corpus", type=Path, help="a folder kept between runs")
    parser.add_argument("--artifacts", type=Path, default=Path("."))
    parser.add_argument("replay", nargs="*", help="inputs to replay instead of fuzzing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuzz-seeds-") as tmp:
        seeds = Path(tmp) / "seeds"
        seeds.mkdir()
        _seed_corpus(args.target, seeds)
        dictionary = Path(tmp) / "tokens.dict"
        dictionary.write_text("".join(f'"{_escaped(token)}"\n' for token in _DICTIONARY))
        flags = [
            f"-timeout={PER_INPUT_TIMEOUT_S}",
            f"-max_len={MAX_INPUT_BYTES}",
            "-rss_limit_mb=2048",
            f"-dict={dictionary}",
            f"-artifact_prefix={args.artifacts}/",
            f"-runs={args.runs}",
        ]
        if args.max_time:
            flags.append(f"-max_total_time={args.max_time}")
        if args.replay:
            inputs = list(args.replay)
        else:
            corpus = [str(args.corpus)] if args.corpus else []
            if args.corpus:
                args.corpus.mkdir(parents=True, exist_ok=True)
            inputs = [*corpus, str(seeds)]
        atheris.Setup([sys.argv[0], *flags, *inputs], TARGETS[args.target])
        atheris.Fuzz()


if __name__ == "__main__":
    main()
