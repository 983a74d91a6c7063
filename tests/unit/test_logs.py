"""Tests for criu_bridge.logs and the RuntimeFailure error."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from criu_bridge.errors import BridgeError, InvalidInput, LimitExceeded, RuntimeFailure
from criu_bridge.logs import (
    criu_log_path,
    decisive_lines,
    format_runc_log_line,
    read_decisive,
    runc_log_errors,
)

RLIMIT = "(00.000102) Error (criu/util.c:632): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted"

TCP_DUMP_LOG = f"""\
(00.000000) Version: 4.2 (gitid 0)
(00.000027) Running on node-1 Linux 6.18.0 #1 SMP PREEMPT_DYNAMIC x86_64
(00.000031) Would overwrite RPC settings with values from /etc/criu/runc.conf
(00.000075) Loaded kdat cache from /run/criu/criu.kdat
{RLIMIT}
(00.000130) ========================================
(00.000132) Dumping processes (pid: 4242 comm: nginx)
(00.000133) ========================================
(00.000140) rlimit: RLIMIT_NOFILE unlimited for self
(00.004120) Seized task 4242, state 1
(00.012034) Dumping file descriptors
(00.012341) 4242 fdinfo 3: pos:                0 flags:           2004002/0
(00.012360) sk-inet: Dumping inet socket at 3
(00.012380) Error (criu/sk-inet.c:191): inet: Connected TCP socket, consider using --tcp-established option.
(00.012390) Error (criu/cr-dump.c:1667): Dump files (pid: 4242) failed with -1
(00.012755) Waiting for 4242 to trap
(00.012771) Daemon 4242 exited trapping
(00.012800) Unlock network
(00.012812) Running network-unlock scripts
(00.013000) Unfreezing tasks into 1
(00.013010) \tUnseizing 4242 into 1
(00.013200) Error (criu/cr-dump.c:2111): Dumping FAILED.
"""

MISSING_FILE_RESTORE_LOG = f"""\
(00.000000) Version: 4.2 (gitid 0)
{RLIMIT}
(00.001000) Restoring processes (pid: 1)
(00.040000) Warn  (criu/kerndat.c:1290): Can't keep kdat cache on non-tempfs
(00.051000)      1: Restoring fd 3 (state -> prepare)
(00.051234)      1: Error (criu/files-reg.c:2213): Can't open file var/log/app/data.log on restore: No such file or directory
(00.051240)      1: Error (criu/files-reg.c:2138): Can't open file var/log/app/data.log: No such file or directory
(00.051300)      1: Error (criu/files.c:1231): Unable to open fd=3 id=0x5
(00.052000) Error (criu/cr-restore.c:1512): 4321 exited, status=1
(00.052100) Error (criu/cr-restore.c:2561): Restoring FAILED.
"""

BAD_SIZE_RESTORE_LOG = f"""\
{RLIMIT}
(00.068542)      1: Error (criu/files-reg.c:1970): File var/log/x has bad size 10 (expect 8)
(00.068600)      1: Error (criu/files.c:1211): Unable to open fd=1 id=0x3
(00.070000) Error (criu/cr-restore.c:2561): Restoring FAILED.
"""

OPT_DUMP_LOG = f"""\
{RLIMIT}
(00.010000) Error (criu/sockets.c:551): sockets: Can't get 1:16 opt: Operation not supported
(00.010010) Error (criu/sk-inet.c:550): inet: Can't dump socket options
(00.010020) Error (criu/cr-dump.c:1667): Dump files (pid: 77) failed with -1
(00.011000) Error (criu/cr-dump.c:2111): Dumping FAILED.
"""


def test_tcp_established_dump_failure() -> None:
    assert decisive_lines(TCP_DUMP_LOG) == [
        "inet: Connected TCP socket, consider using --tcp-established option.",
        "Dump files (pid: 4242) failed with -1",
    ]


def test_missing_volume_file_restore_failure() -> None:
    lines = decisive_lines(MISSING_FILE_RESTORE_LOG)
    assert lines == [
        "Can't open file var/log/app/data.log on restore: No such file or directory",
        "Can't open file var/log/app/data.log: No such file or directory",
        "Unable to open fd=3 id=0x5",
        "4321 exited, status=1",
    ]
    # With a small limit the most specific lines win over the wrappers.
    assert decisive_lines(MISSING_FILE_RESTORE_LOG, limit=1) == [lines[0]]


def test_bad_size_restore_failure() -> None:
    assert decisive_lines(BAD_SIZE_RESTORE_LOG) == [
        "File var/log/x has bad size 10 (expect 8)",
        "Unable to open fd=1 id=0x3",
    ]


def test_socket_option_failure_keeps_order_and_limit() -> None:
    assert decisive_lines(OPT_DUMP_LOG, limit=2) == [
        "sockets: Can't get 1:16 opt: Operation not supported",
        "inet: Can't dump socket options",
    ]
    assert decisive_lines(OPT_DUMP_LOG, limit=0) == []


def test_rlimit_noise_is_never_decisive() -> None:
    log = RLIMIT + "\n(00.1) Info: nothing\n(00.2) Error (criu/cr-dump.c:2111): Dumping FAILED.\n"
    assert decisive_lines(log) == ["Dumping FAILED."]
    assert all("RLIMIT" not in line for line in decisive_lines(RLIMIT + "\n"))


def test_fallback_to_last_lines_without_errors() -> None:
    log = "\n".join(
        [RLIMIT]
        + [f"(00.{i:06d}) step {i}" for i in range(20)]
        + ["(00.300000) Warn  (criu/kerndat.c:1290): Can't keep kdat cache", "", "   "]
    )
    assert decisive_lines(log, limit=3) == ["step 18", "step 19", "Warn: Can't keep kdat cache"]
    assert decisive_lines("") == []


def test_duplicates_prefixes_and_control_characters() -> None:
    log = (
        "(00.1) pie: 12: Error (criu/pie/restorer.c:99): Unable to map\x1b[31m 0x10\r\n"
        "(00.2)      7: Error (criu/mem.c:5): Unable to map\x1b[31m 0x10\r\n"
        "(00.3) Error (criu/x.c:1): " + "y" * 5000 + "\n"
        "Error (criu/y.c:2): no timestamp but a location\n"
        "Error: plain words are not CRIU errors\n"
    )
    lines = decisive_lines(log)
    assert lines[0] == "Unable to map\\x1b[31m 0x10"
    assert len(lines[1]) == 1000 and lines[1].endswith("\u2026")
    assert lines[2] == "no timestamp but a location"
    assert len(lines) == 3


@given(st.text())
def test_decisive_lines_never_crashes(text: str) -> None:
    lines = decisive_lines(text)
    assert len(lines) <= 6
    assert all(line and "\n" not in line and len(line) <= 1000 for line in lines)


def test_read_decisive(tmp_path: Path) -> None:
    assert read_decisive(str(tmp_path / "missing.log")) == []
    log = tmp_path / "restore.log"
    log.write_text(BAD_SIZE_RESTORE_LOG)
    assert read_decisive(str(log))[0] == "File var/log/x has bad size 10 (expect 8)"
    # Only the tail is read; the first, cut line is dropped.
    filler = "".join(f"(00.{i:06d}) Error (criu/a.c:1): early error {i}\n" for i in range(5000))
    log.write_text(filler + BAD_SIZE_RESTORE_LOG)
    tail = read_decisive(str(log), tail_bytes=len(BAD_SIZE_RESTORE_LOG) + 20)
    assert tail == ["File var/log/x has bad size 10 (expect 8)", "Unable to open fd=1 id=0x3"]
    log.write_bytes(b"(00.1) Error (criu/a.c:1): bad \xff byte\n")
    assert read_decisive(str(log)) == ["bad \ufffd byte"]
    assert read_decisive(str(tmp_path))[0].startswith("cannot read log")


RUNC_JSON_LOG = "\n".join(
    [
        '{"level":"info","msg":"restoring container","time":"2026-11-30T10:00:00Z"}',
        '{"level":"warning","msg":"lsm label ignored","time":"2026-11-30T10:00:00Z"}',
        json.dumps(
            {
                "level": "error",
                "msg": "criu failed: type NOTIFY errno 0\nlog file: /run/ck/work/restore.log",
                "time": "2026-11-30T10:00:01Z",
            }
        ),
        '{"level":"error","msg":"criu failed: type NOTIFY errno 0\\nlog file: /run/ck/work/restore.log"}',
        '{"level":"fatal","msg":"container init exited","time":"2026-11-30T10:00:01Z"}',
        '["not", "an", "object"]',
        "{broken json with error inside",
        'time="2026-11-30T10:00:02Z" level=error msg="runc run failed: \\"bad\\" config"',
        'time="2026-11-30T10:00:02Z" level=info msg="all fine, no error here"',
        "panic: runtime error: index out of range",
        "just some output",
        "",
    ]
)


def test_runc_log_errors() -> None:
    errors = runc_log_errors(RUNC_JSON_LOG)
    assert errors == [
        "criu failed: type NOTIFY errno 0; log file: /run/ck/work/restore.log",
        "container init exited",
        "{broken json with error inside",
        'runc run failed: "bad" config',
        "panic: runtime error: index out of range",
    ]
    assert criu_log_path(errors) == "/run/ck/work/restore.log"
    assert criu_log_path(["nothing here"]) is None


def test_format_runc_log_line_round_trip() -> None:
    line = format_runc_log_line("error", 'restore failed: "File x has bad size"\nsecond line \u00e9')
    assert line.endswith("\n") and line.count("\n") == 1
    entry = json.loads(line)
    assert list(entry) == ["level", "msg", "time"]
    assert entry["level"] == "error"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", entry["time"])
    assert runc_log_errors(line) == ['restore failed: "File x has bad size"; second line \u00e9']
    assert json.loads(format_runc_log_line("WARN", "x"))["level"] == "warning"
    with pytest.raises(ValueError):
        format_runc_log_line("loud", "x")


def test_runtime_failure() -> None:
    err = RuntimeFailure(
        "restore",
        "criu failed: type NOTIFY errno 0",
        decisive=decisive_lines(BAD_SIZE_RESTORE_LOG),
        log_path="/run/ck/restore.log",
    )
    assert isinstance(err, BridgeError)
    assert str(err) == (
        'restore failed: criu failed: type NOTIFY errno 0: "File var/log/x has bad size 10 (expect 8)"; '
        '"Unable to open fd=1 id=0x3" (log: /run/ck/restore.log)'
    )
    assert str(RuntimeFailure("dump")) == "dump failed"
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is RuntimeFailure and str(copy) == str(err)
    assert copy.decisive == err.decisive and copy.log_path == err.log_path
    assert issubclass(LimitExceeded, InvalidInput) and issubclass(InvalidInput, BridgeError)
