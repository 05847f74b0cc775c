"""The options of `extproc simulate` and of its `plan` sub-command."""

from __future__ import annotations

import argparse

from extproc.defaults import default_policy_path
from gateway_lab.sim.replicas import BALANCES

DEFAULT_POLICY = default_policy_path()
DEFAULT_SERVEGEN = "../shared/data/traces/servegen/servegen_client_summary.csv"
DEFAULT_PROFILE = "a100-llama3-8b"


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--trace", help="CSV or JSONL trace (Azure 2023, Mooncake or generic)")
    group.add_argument(
        "--time-unit", choices=("auto", "s", "ms"), default="auto", help="numeric timestamps"
    )
    group.add_argument(
        "--rate-scale", type=float, default=1.0, help="multiply the request rate (default 1)"
    )
    group.add_argument(
        "--duration", type=float, default=None, help="keep arrivals in the first S seconds"
    )
    group.add_argument("--start", type=float, default=0.0, help="skip the first S trace seconds")
    group.add_argument("--sample", type=float, default=1.0, help="keep each request w.p. F")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--tenants",
        default="auto",
        help="auto | round-robin | random | trace | NAME=WEIGHT,... (default auto)",
    )
    group.add_argument(
        "--max-tokens",
        default="actual",
        help="max_tokens clients send: actual (the trace output), default (the policy's) or N",
    )
    group.add_argument(
        "--scenario", choices=("servegen",), help="generate tenants instead of reading --trace"
    )
    group.add_argument("--clients", type=int, default=8, help="servegen: number of tenants")
    group.add_argument("--servegen-file", default=DEFAULT_SERVEGEN)
    group.add_argument("--servegen-model", default="m-large")
    group.add_argument("--servegen-pick", choices=("top", "spread"), default="top")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engines")
    group.add_argument(
        "--profile",
        action="append",
        help=f"engine profile NAME (all pools) or POOL=NAME (default {DEFAULT_PROFILE})",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engines' automatic prefix caching, fed by the trace's hash_ids (default: the "
        "profile's, on as in vLLM V1)",
    )
    group.add_argument(
        "--kv-provision",
        type=float,
        default=1.0,
        help="KV tokens an engine budgets per sequence, as a fraction of max_model_len",
    )
    group.add_argument(
        "--max-num-seqs-cap", type=int, default=None, help="upper bound on max_num_seqs"
    )
    group.add_argument(
        "--balance",
        choices=BALANCES,
        default="tokens",
        help="replica choice in a pool: fewest outstanding token budgets (default), fewest "
        "outstanding requests, or round-robin",
    )


def _add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLO")
    group.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    group.add_argument(
        "--slo-ttft-per-ktok-ms",
        type=float,
        default=0.0,
        help="extra TTFT allowed per 1000 prompt tokens",
    )
    group.add_argument("--slo-tpot-ms", type=float, default=None)
    group.add_argument("--slo-e2e-ms", type=float, default=None)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    _add_workload_arguments(parser)
    _add_engine_arguments(parser)
    parser.add_argument(
        "--replicas", action="append", help="POOL=N (default: the pool's endpoint count)"
    )
    parser.add_argument(
        "--capacity",
        choices=("policy", "derived"),
        default="policy",
        help="pool limits from the policy, or replicas * max_num_seqs / KV tokens",
    )
    parser.add_argument(
        "--no-context-scaling",
        action="store_true",
        help="use the profile as is instead of configuring it for the pool's max_total_tokens",
    )
    _add_slo_arguments(parser)
    parser.add_argument("--out", default="results/sim", help="directory for JSON and PNG files")
    parser.add_argument("--save-requests", action="store_true", help="also write requests.csv")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy", default=None, help="tiers and weights of the tenants (limits are ignored)"
    )
    _add_workload_arguments(parser)
    _add_engine_arguments(parser)
    _add_slo_arguments(parser)
    parser.add_argument("--attainment", type=float, default=0.99)
    parser.add_argument(
        "--thresholds", default="2048,4096,8192", help="routing thresholds to sweep (tokens)"
    )
    parser.add_argument(
        "--long-context",
        type=int,
        default=None,
        help="max_model_len of the homogeneous and long pools (default: the longest request, "
        "rounded up to a power of two)",
    )
    parser.add_argument("--max-replicas", type=int, default=1024)
    parser.add_argument("--throughput-sample", type=int, default=2000)
    parser.add_argument("--out", default="results/plan")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no per-trial lines")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`simulate` options plus the `plan` sub-command."""
    add_simulate_arguments(parser)
    commands = parser.add_subparsers(dest="sim_command", metavar="{plan}")
    plan = commands.add_parser("plan", help="fewest engines meeting an SLO, 1 pool vs 2")
    add_plan_arguments(plan)
