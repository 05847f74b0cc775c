"""The site hook of `extproc bench ... --gc-trace` (gateway_lab/bench/gc_trace.py)."""
