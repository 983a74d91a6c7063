"""One module per family of measurements, each run on the harness (bench/harness/) and writing its own
part of the results: `run(bench)` for bench/run.py's suite (bench/suite.py), `main(args)` for a family
with an entry script of its own. A scenario imports the harness and the report, never an entry script;
a new one is a new module here.
"""
