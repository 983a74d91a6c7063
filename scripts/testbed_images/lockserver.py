#!/usr/bin/python3
"""lockserver: a test workload for the Debian image of scripts/testbed.

    lockserver [--db PATH] [--rows N] [--lock PATH] [--port P] [--interval-ms MS]

Installed as /usr/local/bin/lockserver (mode 0755) in localhost/node-agent-test/debian:1.
Python 3 standard library only. It holds the kinds of state a checkpoint has to
carry over, so that a restored process can be told from a restarted one:

- one sqlite connection in WAL mode (POSIX locks on the db and its -shm file),
  opened at start and kept for the process's whole life: every read goes
  through it;
- one child process (forked before any thread starts) that holds an exclusive
  flock on --lock, with its pid written into the file, and sleeps; it dies with
  its parent (PR_SET_PDEATHSIG, plus a getppid check in its loop);
- a listening TCP socket on 0.0.0.0:PORT (threaded). Each connection gets one
  JSON line, then the server closes it:

      {"pid": ..., "started": <time.time() at start>,
       "starttime_ticks": <field 22 of /proc/self/stat at start>,
       "rows": <SELECT COUNT(*)>, "checksum": <sha256 hex>,
       "journal_mode": "wal", "lock_pid": <child's pid>, "lock_held": true,
       "ticks": <tick counter>}

  checksum is the sha256 of every value ordered by id, each followed by "\\n"
  (`row-1\\nrow-2\\n...`). lock_held tests the lock with a new open of the lock
  file and flock(LOCK_EX|LOCK_NB): held when that would block;
- a counter: `tick N` (N from 1) on stdout, the CRI log, every --interval-ms.

It must run as root in the container: CRIU cannot dump another user's process
on machines without CAP_SYS_RESOURCE. SIGTERM and SIGINT exit 0 (PID 1 of a
container gets no default handlers).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import signal
import socketserver
import sqlite3
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockserver", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", default="/var/lib/app/app.db", help="sqlite database (default %(default)s)")
    p.add_argument("--rows", type=int, default=1000, help="rows to insert into an empty table (default %(default)s)")
    p.add_argument("--lock", default="/var/lib/app/app.lock", help="file the child flocks (default %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="TCP port on 0.0.0.0 (default %(default)s)")
    p.add_argument("--interval-ms", type=int, default=200, help="tick interval (default %(default)s)")
    return p.parse_args(argv)


def proc_starttime() -> int:
    """Field 22 of /proc/self/stat: the start time in clock ticks since boot."""
    with open("/proc/self/stat") as f:
        stat = f.read()
    # Fields after the command name, "(comm)", start with field 3.
    return int(stat[stat.rfind(")") + 2:].split()[22 - 3])


def open_db(path: str, rows: int) -> tuple[sqlite3.Connection, str]:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False)
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    conn.execute("CREATE TABLE IF NOT EXISTS items(id INTEGER PRIMARY KEY, value TEXT)")
    if conn.execute("SELECT COUNT(*) FROM items").fetchone()[0] == 0:
        conn.executemany("INSERT INTO items(id, value) VALUES (?, ?)",
                         ((i, f"row-{i}") for i in range(1, rows + 1)))
    conn.commit()
    return conn, mode


def lock_child(lock_path: str, parent: int) -> None:
    """The forked child: holds an exclusive flock on lock_path until the parent dies.
    Never returns; never touches the parent's sqlite connection."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the getppid check below still ends the child
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(0)
        os.makedirs(os.path.dirname(os.path.abspath(lock_path)), exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        while os.getppid() == parent:
            time.sleep(1)
    except BaseException as exc:  # noqa: BLE001 - the child must never return
        try:
            os.write(2, f"lockserver: lock child: {exc}\n".encode())
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def lock_held(lock_path: str) -> bool:
    """Whether someone holds a flock on lock_path: tried through a new open file."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return True
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    starttime_ticks = proc_starttime()

    def on_term(signum: int, frame: object) -> None:
        try:
            sys.stdout.flush()
        finally:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    conn, _ = open_db(args.db, args.rows)
    db_lock = threading.Lock()

    # Fork before any thread exists.
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        lock_child(args.lock, parent)
    deadline = time.monotonic() + 10
    while not lock_held(args.lock) and time.monotonic() < deadline:
        time.sleep(0.01)

    state = {"ticks": 0}

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            with db_lock:
                rows = conn.execute("SELECT COUNT(*) FROM items").fetchone()[0]
                digest = hashlib.sha256()
                for (value,) in conn.execute("SELECT value FROM items ORDER BY id"):
                    digest.update(str(value).encode() + b"\n")
                journal_mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            answer = {
                "pid": os.getpid(),
                "started": started,
                "starttime_ticks": starttime_ticks,
                "rows": rows,
                "checksum": digest.hexdigest(),
                "journal_mode": journal_mode,
                "lock_pid": child,
                "lock_held": lock_held(args.lock),
                "ticks": state["ticks"],
            }
            try:
                self.request.sendall((json.dumps(answer) + "\n").encode())
            except OSError:
                pass

    server = Server(("0.0.0.0", args.port), Handler)
    threading.Thread(target=server.serve_forever, name="server", daemon=True).start()

    interval = max(args.interval_ms, 1) / 1000.0
    next_at = time.monotonic()
    while True:
        state["ticks"] += 1
        print(f"tick {state['ticks']}", flush=True)
        try:
            os.waitpid(-1, os.WNOHANG)  # reap the lock child, should it die
        except ChildProcessError:
            pass
        next_at += interval
        delay = next_at - time.monotonic()
        if delay < 0:  # fell behind (say, frozen for a checkpoint): don't catch up in a burst
            next_at = time.monotonic()
            delay = 0
        time.sleep(delay)


if __name__ == "__main__":
    sys.exit(main())
