"""CRIU's page-server protocol, the part a lazy-pages daemon speaks.

``criu lazy-pages --page-server --address A --port P`` connects to a page
server over TCP and, for every page fault and then for the remaining pages
in the background, sends a request and waits for the answer:

* request: ``struct page_server_iov`` — ``u32 cmd``, 4 bytes of padding,
  ``u64 nr_pages``, ``u64 vaddr``, ``u64 dst_id`` (32 bytes, little-endian
  on x86-64 and arm64; CRIU 4 widened ``nr_pages`` to 64 bits). ``cmd`` is
  ``PS_IOV_GET`` and ``dst_id`` is the task's id in the images (its pid in
  the checkpoint);
* answer: the same header with ``cmd = PS_IOV_ADD_F | PE_PRESENT << 16``
  and ``nr_pages`` possibly smaller than asked, then that many pages;
* at the end ``PS_IOV_CLOSE`` (or ``PS_IOV_FORCE_CLOSE``), answered with a
  32-bit status (0), after which the daemon closes the connection.
"""

from __future__ import annotations

import struct
from typing import Final

HEADER: Final = struct.Struct("<I4xQQQ")
STATUS: Final = struct.Struct("<i")

PS_IOV_ADD_F: Final = 6
PS_IOV_GET: Final = 7
PS_IOV_CLOSE: Final = 0x1023
PS_IOV_FORCE_CLOSE: Final = 0x1024
PS_CMD_MASK: Final = 0xFFFF
PS_CMD_BITS: Final = 16


def reply_cmd(flags: int) -> int:
    """The command word of a pages answer carrying pagemap ``flags``."""
    return (flags << PS_CMD_BITS) | PS_IOV_ADD_F
