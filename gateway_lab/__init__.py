"""The lab around the gateway: local stacks, the emulated engine, simulator and benchmarks.

Nothing in `extproc` (the runtime) imports from here.
"""
