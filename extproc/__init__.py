"""Tier-first, token-fair admission for LLM serving, as an Envoy ext_proc service."""

__version__ = "0.1.0"
