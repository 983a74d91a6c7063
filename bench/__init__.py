"""Benchmarks: node-agent against bare runc and CRIU (`bench/run.py`), and the store alone
(`bench/store_throughput.py`)."""
