"""The benchmarks' environment: the test bed and its agent, pods, single timed operations, the shared main.

Scenarios (bench/scenarios/) measure with it; it imports no scenario.
"""
