"""A process whose memory is missing, as CRIU's restore leaves it: run as a script by the fault handler's tests.

It maps anonymous memory, registers it with a userfaultfd of its own (the
features CRIU's restore asks for), prints the address, and on ``connect
PATH`` hands the userfaultfd to whoever listens there the way CRIU's
restore does: its task id, then the descriptor with one byte, then
RESTORE_FINISHED (``hand-over PATH`` stops before RESTORE_FINISHED, as a
restore still under way does; ``finish`` then sends it). Then it obeys
commands on stdin, one per line, and answers each on stdout:

* ``hash OFF N``: sha256 of N pages from page OFF (reading them faults);
* ``fork-hash OFF N``: the same, read by a child it forks first;
* ``remove OFF N``: madvise(MADV_DONTNEED) on them (a REMOVE event);
* ``move OFF N``: mremap them to a fresh address (a REMAP event), which it
  prints;
* ``hash-at ADDR N``: sha256 of N pages at ADDR.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import socket
import struct
import sys

PAGE = 4096
FEATURES = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 6)  # EVENT_FORK, EVENT_REMAP, EVENT_REMOVE, EVENT_UNMAP
UFFDIO_API = (3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F
UFFDIO_REGISTER = (3 << 30) | (32 << 16) | (0xAA << 8) | 0x00
SYS_USERFAULTFD = 323  # x86-64
RESTORE_FINISHED = 0x52535446

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.syscall.restype = ctypes.c_long


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"{what}: {os.strerror(ctypes.get_errno())}")


def main() -> None:
    task_id, pages = int(sys.argv[1]), int(sys.argv[2])
    addr = libc.mmap(None, pages * PAGE, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
    check(addr not in (None, ctypes.c_void_p(-1).value), "mmap")
    uffd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
    check(uffd >= 0, "userfaultfd")
    api = (ctypes.c_uint64 * 3)(0xAA, FEATURES, 0)
    check(libc.ioctl(uffd, ctypes.c_ulong(UFFDIO_API), api) == 0, "UFFDIO_API")
    reg = (ctypes.c_uint64 * 4)(addr, pages * PAGE, 1, 0)  # range, MODE_MISSING, ioctls
    check(libc.ioctl(uffd, ctypes.c_ulong(UFFDIO_REGISTER), reg) == 0, "UFFDIO_REGISTER")
    print(hex(addr), flush=True)
    restore: socket.socket | None = None  # a hand-over's connection, until it finishes
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd in ("connect", "hand-over"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(args[0])
            s.sendall(struct.pack("=i", task_id))
            socket.send_fds(s, [b"\0"], [uffd])
            os.close(uffd)
            if cmd == "connect":
                s.sendall(struct.pack("=i", RESTORE_FINISHED))
                s.close()
            else:
                restore = s
            print("ok", flush=True)
        elif cmd == "finish":
            assert restore is not None
            restore.sendall(struct.pack("=i", RESTORE_FINISHED))
            restore.close()
            print("ok", flush=True)
        elif cmd == "hang-up":  # as a restore that fails on its own: the connection ends before it finished
            assert restore is not None
            restore.close()
            print("ok", flush=True)
        elif cmd in ("hash", "fork-hash"):
            off, n = int(args[0]), int(args[1])
            if cmd == "fork-hash":
                pid = os.fork()
                if pid == 0:
                    print(hashlib.sha256(ctypes.string_at(addr + off * PAGE, n * PAGE)).hexdigest(), flush=True)
                    os._exit(0)
                os.waitpid(pid, 0)
            else:
                print(hashlib.sha256(ctypes.string_at(addr + off * PAGE, n * PAGE)).hexdigest(), flush=True)
        elif cmd == "hash-at":
            at, n = int(args[0], 16), int(args[1])
            print(hashlib.sha256(ctypes.string_at(at, n * PAGE)).hexdigest(), flush=True)
        elif cmd == "remove":
            off, n = int(args[0]), int(args[1])
            check(libc.madvise(addr + off * PAGE, n * PAGE, 4) == 0, "madvise")  # MADV_DONTNEED
            print("ok", flush=True)
        elif cmd == "move":
            off, n = int(args[0]), int(args[1])
            dest = libc.mmap(None, n * PAGE, 0, 0x22, -1, 0)  # a free place to move to
            moved = libc.mremap(addr + off * PAGE, n * PAGE, n * PAGE, 3, dest)  # MREMAP_MAYMOVE|MREMAP_FIXED
            check(moved == dest, "mremap")
            print(hex(moved), flush=True)


if __name__ == "__main__":
    main()
