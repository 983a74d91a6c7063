"""What bounds a lazy restore's transfer: the page source's stages, each alone, on this machine.

A lazily restored process's memory comes in as fast as the page source can
read chunks from the store, verify and decode them, and copy them into the
process. This measures each stage by itself and then the whole fault
handler, outside any container (a process set up as CRIU's restore leaves
one: testbed/lazyimages.py's UFFD_PROCESS), for N MiB of incompressible pages:

* read + verify: the chunks of the pages file through the page source's
  chunk cache (the store's read, sha256, decode; reads ahead in threads);
* UFFDIO_COPY: the kernel's copy of the same bytes into registered memory,
  in 1 MiB windows, from one buffer;
* handler, idle: the fault handler streaming everything into a process that
  does not touch its memory;
* handler, read: the same while the process reads all of its memory from
  the start (faults and the stream side by side), timed by the handler;
* page source start-up: a restore's page source as a new process and as the
  agent's spare (`node_agent.lazy.spare`), from the session's start until it
  serves a restore that connects at once, and the CPU it used meanwhile.

With ``--registry``, the same pages pushed to a loopback docker-registry and
pulled lazily (as on another node) are also read through the chunk cache and
by the handler, beside the registry's own GET bound (every chunk read by a
bare client over ``registry.connections`` connections) and a full pull. Each
stage shows the machine's CPU busy share over it and the registry's own share
(on a machine of few cores, the registry takes much of them):

    .venv/bin/python bench/lazy_throughput.py [--mib 256] [--runs 3] [--registry] [--chunk-sizes 1024,4096]

``--chunk-sizes`` (KiB, the store's chunking average) repeats the registry's
stages for checkpoints cut at each size, interleaved: a chunk is one blob,
one request (docs/store.md, "Chunk size").
"""

from __future__ import annotations

import argparse
import sys

from bench.scenarios.lazy_throughput import main as measure


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--registry", action="store_true",
                    help="also from a loopback docker-registry, as a lazy pull on another node reads it")
    ap.add_argument("--chunk-sizes", type=_kib_list, default=[],
                    help="KiB, comma-separated: the registry's stages for each chunking average (default: the store's)")
    args = ap.parse_args()
    return measure(args)


def _kib_list(text: str) -> list[int]:
    try:
        sizes = [int(part) << 10 for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of KiB: {text!r}") from None
    if not sizes:
        raise argparse.ArgumentTypeError("no chunk size given")
    return sizes


if __name__ == "__main__":
    sys.exit(main())
