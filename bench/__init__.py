"""Benchmarks: node-agent against bare runc and CRIU (`bench/run.py`), encryption at rest, the image check,
and the store and the page source alone.

The files directly in bench/ are entry scripts (run as `.venv/bin/python bench/NAME.py`): each parses its
flags and calls into the package; nothing imports them. harness/ is the environment, scenarios/ the
measurements (one module per family), report/ the statistics, targets and docs/benchmarks.md's
generated blocks.
"""
