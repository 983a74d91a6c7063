"""From raw samples to figures: statistics (stats), targets, the text tables and docs/benchmarks.md's
generated blocks (docs). Standard library only; it measures nothing and imports no other part of bench.
"""
