"""Benchmarks of node-agent against bare runc and CRIU (`bench/run.py`)."""
