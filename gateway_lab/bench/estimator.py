"""Benchmark: prompt-token estimation error per content category.

`extproc bench estimator --text-dir ../shared/data/text [--out results/estimator]`

Builds realistic chat requests from public text (code, prose, chat, tool schemas, CJK), counts
each one's true prompt tokens with cl100k as the project's vLLM (ChatML template) would, and
compares estimators on a held-out half:

- ``flat``: 4 bytes per token for everything (the baseline), plus framing;
- ``prior``: per-category priors, no learning;
- ``calibrated``: per-category ratios learned online (EMA) on the training half;
- ``conservative``: calibrated, every ratio times 0.9 (over-estimates on purpose);
- ``tiktoken``: exact cl100k counts of the texts, plus framing.

Truth: the ChatML rendering of the messages (``<|im_start|>role\\n content<|im_end|>\\n`` each,
then ``<|im_start|>assistant\\n``), special markers one token each, text encoded with cl100k;
tools rendered as a leading system message holding one JSON document per tool (json.dumps with
its default separators, as Hugging Face chat templates' ``tojson`` does).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc.estimation import CATEGORIES, TokenEstimator
from extproc.openai_request import CHAT_PATH, PromptParts, parse_inference_request
from extproc.policy.model import Estimation
from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.provenance import with_provenance
from gateway_lab.progress import Progress

MODES = ("flat", "prior", "calibrated", "conservative", "tiktoken")
GROUPS = ("code", "prose", "chat", "json", "cjk")
MAX_PER_SOURCE = 160
SEED = 20240601
DEFAULT_OUT = Path("results/estimator")
COLON = "\uff1a"  # the full-width colon CJK instructions end with


@dataclass
class BenchRequest:
    group: str  # the data set's category: code, prose, chat, json, cjk
    source: str  # the file it came from (cjk has several)
    body: dict[str, Any]
    prompt: PromptParts
    truth: int = 0


# -- loading -----------------------------------------------------------------------------


def _jsonl(path: Path) -> Iterable[Any]:
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _chat(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in turns]


def _alternating(texts: list[str], first: str = "user") -> list[dict[str, str]]:
    """Turns of a dialogue as messages, cut so that the last one is the user's."""
    other = "assistant" if first == "user" else "user"
    roles = [first if i % 2 == 0 else other for i in range(len(texts))]
    while roles and roles[-1] != "user":
        roles.pop()
    return _chat(*zip(roles, texts[: len(roles)], strict=True))


def _code(path: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for index, row in enumerate(_jsonl(path)):
        prompt = row["prompt"]
        if index % 2:
            content = f"Complete the following Python function.\n\n```python\n{prompt}```"
            messages = _chat(("system", "You are an expert Python programmer."), ("user", content))
        else:
            messages = _chat(("user", prompt))
        out.append(("code", {"messages": messages}))
    return out


def _prose(path: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for row in _jsonl(path):
        for turn in row["turns"]:
            out.append(("prose", {"messages": _chat(("user", turn))}))
    return out


def _sharegpt(path: Path) -> list[tuple[str, dict[str, Any]]]:
    out, seen = [], set()
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    for conversation in json.loads(path.read_text(encoding="utf-8")):
        turns = [(roles.get(t["from"], "user"), t["value"]) for t in conversation["conversations"]]
        while turns and turns[-1][0] != "user":
            turns.pop()
        key = json.dumps(turns)
        if turns and key not in seen:  # the sample repeats many identity dialogues
            seen.add(key)
            out.append(("chat", {"messages": _chat(*turns)}))
    return out


def _bfcl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for row in _jsonl(path):
        messages = [m for turn in row["question"] for m in turn]
        tools = [{"type": "function", "function": f} for f in row["function"]]
        out.append(("json", {"messages": messages, "tools": tools}))
    return out


def _lunyu(path: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chapter in json.loads(path.read_text(encoding="utf-8")):
        for paragraph in chapter["paragraphs"]:
            out.append(
                ("zh_lunyu", {"messages": _chat(("user", f"请解释这段话{COLON}\n{paragraph}"))})
            )
    return out


def _kdconv(path: Path) -> list[tuple[str, dict[str, Any]]]:
    return [("zh_kdconv", {"messages": _alternating(row["turns"])}) for row in _jsonl(path)]


def _asdc(path: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for row in _jsonl(path):
        roles = {"customer": "user", "operator": "assistant"}
        turns = [(roles.get(t["speaker"], "user"), t["text"]) for t in row["turns"]]
        while turns and turns[-1][0] != "user":
            turns.pop()
        if turns:
            out.append(("ja_asdc", {"messages": _chat(*turns)}))
    return out


def _book(path: Path, source: str, instruction: str) -> list[tuple[str, dict[str, Any]]]:
    sections = path.read_text(encoding="utf-8").split("\n## ")
    out = []
    for section in sections:
        for start in range(0, len(section), 3000):  # about 6-9 KB of UTF-8 per request
            piece = section[start : start + 3000].strip()
            if len(piece) > 40:
                out.append((source, {"messages": _chat(("user", f"{instruction}\n\n{piece}"))}))
    return out


LOADERS: dict[str, tuple[str, Callable[[Path], list[tuple[str, dict[str, Any]]]]]] = {
    "HumanEval.jsonl.gz": ("code", _code),
    "question.jsonl": ("prose", _prose),
    "dummy_conversation.json": ("chat", _sharegpt),
    "BFCL_v4_live_simple.json": ("json", _bfcl),
    "zh_classical_lunyu.json": ("cjk", _lunyu),
    "zh_kdconv_dialogs.jsonl": ("cjk", _kdconv),
    "ja_asdc_dialogs.jsonl": ("cjk", _asdc),
    "zh_rust_book_ch01-04.md": (
        "cjk",
        lambda p: _book(p, "zh_rust_book", f"请总结以下内容{COLON}"),
    ),
    "ja_rust_book_ch01-04.md": (
        "cjk",
        lambda p: _book(p, "ja_rust_book", f"次の内容を要約して{COLON}"),
    ),
}


def load_requests(text_dir: Path, rng: random.Random) -> list[BenchRequest]:
    """Every known file present in `text_dir`, at most MAX_PER_SOURCE requests per source."""
    requests = []
    for name, (group, loader) in LOADERS.items():
        path = text_dir / name
        if not path.exists():
            continue
        items = loader(path)
        rng.shuffle(items)
        for source, body in items[:MAX_PER_SOURCE]:
            body = {"model": "bench", **body}
            parsed = parse_inference_request(CHAT_PATH, orjson.dumps(body))
            requests.append(BenchRequest(group, source, body, parsed.prompt))
    return requests


# -- truth -------------------------------------------------------------------------------


def true_prompt_tokens(body: dict[str, Any], encode: Callable[[str], list[int]]) -> int:
    """Prompt tokens of `body` under ChatML with cl100k (see the module docstring)."""
    newline = len(encode("\n"))
    messages = list(body["messages"])
    tools = body.get("tools")
    if tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        messages.insert(0, {"role": "system", "content": listing})
    total = 0
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if message.get("tool_calls"):
            content += json.dumps(message["tool_calls"], ensure_ascii=False)
        total += 2 + len(encode(f"{message['role']}\n{content}")) + newline
    return total + 1 + len(encode("assistant\n"))


# -- running -----------------------------------------------------------------------------


def _split(requests: list[BenchRequest]) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """Half of each source for training, half held out (requests are already shuffled)."""
    train, test = [], []
    by_source: dict[str, list[BenchRequest]] = {}
    for request in requests:
        by_source.setdefault(request.source, []).append(request)
    for items in by_source.values():
        half = len(items) // 2
        train += items[:half]
        test += items[half:]
    return train, test


def _summary(errors: list[float]) -> dict[str, float | int]:
    if not errors:
        return {"n": 0}
    return {
        "n": len(errors),
        "mape": 100 * statistics.fmean(abs(e) for e in errors),
        "bias": 100 * statistics.fmean(errors),
        "p90_abs": 100 * sorted(abs(e) for e in errors)[int(0.9 * (len(errors) - 1))],
        "under": sum(1 for e in errors if e < 0),
        "under_pct": 100 * sum(1 for e in errors if e < 0) / len(errors),
    }


def run(
    text_dir: Path,
    out_dir: Path,
    *,
    settings: Estimation | None = None,
    plot: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the benchmark; write results.json (and estimator.png) into `out_dir`."""
    import tiktoken

    settings = settings or Estimation()
    encoding = tiktoken.get_encoding(settings.encoding)
    rng = random.Random(SEED)
    requests = load_requests(Path(text_dir), rng)
    if not requests:
        raise FileNotFoundError(f"no known text files in {text_dir}")
    # Steps: counting the truth, training, then one per mode's estimates.
    sink = io.StringIO() if quiet else None
    tracker = Progress("estimator", 2 + len(MODES), unit="steps", stream=sink)
    tracker.phase(f"true token counts of {len(requests)} requests")
    for index, request in enumerate(requests):
        request.truth = true_prompt_tokens(request.body, encoding.encode_ordinary)
        tracker.update((index + 1) / len(requests))
    train, test = _split(requests)
    rng.shuffle(train)  # one mixed stream of traffic, as the service would see it

    estimators = {
        "flat": TokenEstimator(settings, mode="flat"),
        "prior": TokenEstimator(settings, learn=False),
        "calibrated": TokenEstimator(settings),
        "conservative": TokenEstimator(settings, conservative=True),
        "tiktoken": TokenEstimator(settings, mode="tiktoken"),
    }
    tracker.phase(f"training on {len(train)} requests", done=1)
    for request in train:
        for estimator in estimators.values():
            estimator.observe(request.prompt, request.truth)

    errors: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    cost_us: dict[str, float] = {}
    raw: list[dict[str, Any]] = [
        {
            "group": r.group,
            "source": r.source,
            "bytes": _size(r.prompt),
            "messages": r.prompt.messages,
            "tools": r.prompt.tools,
            "truth": r.truth,
        }
        for r in test
    ]
    for index, (mode, estimator) in enumerate(estimators.items()):
        tracker.phase(f"estimating {len(test)} requests: {mode}", done=2 + index)
        started = time.perf_counter()
        estimates = [estimator.estimate_prompt(r.prompt) for r in test]
        cost_us[mode] = (time.perf_counter() - started) / len(test) * 1e6
        for request, estimate, row in zip(test, estimates, raw, strict=True):
            row[mode] = estimate
            error = (estimate - request.truth) / request.truth
            for key in dict.fromkeys((request.group, request.source, "all")):
                errors[mode].setdefault(key, []).append(error)

    tracker.finish()
    keys = [g for g in GROUPS if g in errors["flat"]]
    keys += sorted(k for k in errors["flat"] if k not in GROUPS and k != "all" and k not in keys)
    keys.append("all")
    result: dict[str, Any] = {
        "text_dir": str(text_dir),
        "seed": SEED,
        "requests": {"train": len(train), "test": len(test)},
        "truth": "cl100k, ChatML template; tools as a system message of json.dumps documents",
        "settings": settings.model_dump(),
        "cost_us_per_estimate": cost_us,
        "learned": {
            s.category: {"bytes_per_token": s.active, "samples": s.samples, "prior": s.prior}
            for s in estimators["calibrated"].state()
        },
        "categories": list(CATEGORIES),
        "summary": {mode: {k: _summary(errors[mode].get(k, [])) for k in keys} for mode in MODES},
        "rows": keys,
        "raw": raw,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(with_provenance(result), indent=1))
    if plot:
        _plot(result, out_dir / "estimator.png")
    if not quiet:
        print(format_table(result))
        print(
            f"\nwrote {out_dir / 'results.json'}"
            + (f", {out_dir / 'estimator.png'}" if plot else "")
        )
    return result


def _size(prompt: PromptParts) -> int:
    return sum(len(t.encode()) for t in prompt.texts) + len(prompt.tools_json.encode())


def format_table(result: dict[str, Any]) -> str:
    summary = result["summary"]
    header = f"{'category':<14}{'n':>5}"
    for mode in MODES:
        header += f" | {mode:^22}"
    sub = f"{'':<14}{'':>5}" + " | MAPE%  bias%  under%  " * len(MODES)
    lines = [header, sub.rstrip(), "-" * len(header)]
    for key in result["rows"]:
        n = summary["flat"][key]["n"]
        line = f"{key:<14}{n:>5}"
        for mode in MODES:
            s = summary[mode][key]
            line += f" | {s['mape']:5.1f} {s['bias']:+6.1f} {s['under_pct']:6.0f}  "
        lines.append(line.rstrip())
    lines.append("")
    lines.append(
        "cost per estimate (us): "
        + ", ".join(f"{m} {c:.1f}" for m, c in result["cost_us_per_estimate"].items())
    )
    learned = ", ".join(
        f"{name} {v['bytes_per_token']:.2f} (n={v['samples']:.0f})"
        for name, v in result["learned"].items()
    )
    lines.append(f"learned bytes/token: {learned}")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    keys = [k for k in result["rows"] if k in GROUPS or k == "all"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        xs = [j + (i - (len(MODES) - 1) / 2) * width for j in range(len(keys))]
        top.bar(xs, [result["summary"][mode][k]["mape"] for k in keys], width, label=mode)
        bottom.bar(xs, [result["summary"][mode][k]["bias"] for k in keys], width, label=mode)
    top.set_ylabel("mean abs error (%)")
    bottom.set_ylabel("signed bias (%)")
    bottom.axhline(0, color="black", linewidth=0.6)
    bottom.set_xticks(range(len(keys)), keys)
    top.legend(ncol=len(MODES), fontsize=8)
    top.set_title("Prompt-token estimate vs cl100k (held-out requests)")
    save_figure(fig, path, dpi=110)


# -- command line ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--text-dir", type=Path, required=True, help="directory with the text files (see docs)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--tokens-per-message", type=int, help="framing per chat message (policy default if unset)"
    )
    parser.add_argument("--tokens-per-tool", type=int, help="framing per tool (policy default)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def main(args: argparse.Namespace) -> int:
    changes = {
        name: getattr(args, name)
        for name in ("tokens_per_message", "tokens_per_tool")
        if getattr(args, name, None) is not None
    }
    settings = Estimation(**changes)
    try:
        run(args.text_dir, args.out, settings=settings, plot=not getattr(args, "no_plot", False))
    except FileNotFoundError as error:
        print(f"bench estimator: {error}")
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="extproc bench estimator")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
