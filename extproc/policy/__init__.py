"""Policy files: format, validation with file:line errors, and the compiled runtime form."""

from extproc.policy.keys import hash_key
from extproc.policy.loader import PolicyError, PolicyIssue, load_policy_file, parse_policy
from extproc.policy.model import PolicyFile
from extproc.policy.runtime import Policy, compile_policy, load_policy, policy_from_text

__all__ = [
    "Policy",
    "PolicyError",
    "PolicyFile",
    "PolicyIssue",
    "compile_policy",
    "hash_key",
    "load_policy",
    "load_policy_file",
    "parse_policy",
    "policy_from_text",
]
