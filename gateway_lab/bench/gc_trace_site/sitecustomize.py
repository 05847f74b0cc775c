"""Loaded by every Python process a benchmark run starts with `--gc-trace`
(gateway_lab/bench/gc_trace.py puts this directory on PYTHONPATH). A Python without
gateway_lab (a peer's own virtualenv) is not traced."""

try:
    from gateway_lab.bench.gc_trace import trace_from_environment
except ImportError:
    pass
else:
    trace_from_environment()
