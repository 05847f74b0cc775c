"""Offline benchmarks (`extproc bench ...`). Each takes its data directory as an argument."""
