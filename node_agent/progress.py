"""How a checkpoint or a restore reports its progress while it runs.

One `Progress` per step: the phase it is in, how many containers and bytes
of how many are done, and a short message. The API streams each one to the
caller (`api.convert`); a caller that does not listen passes `no_progress`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Progress:
    phase: str
    containers_done: int = 0
    containers_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    message: str = ""


ProgressFn = Callable[[Progress], None]


def no_progress(_: Progress) -> None:
    """A `ProgressFn` that drops every report."""
