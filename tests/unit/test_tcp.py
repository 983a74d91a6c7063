"""Live TCP connections at a checkpoint: the connections a frozen container holds (criu_bridge.tcp), the
CRIU options they lead to (skip-in-flight always, tcp-close when held) and how those reach CRIU through runc."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from criu_bridge import tcp
from criu_bridge.runtime import CRIU_CONFIG_ENV, CheckpointFlags, Runc
from node_agent import errors
from node_agent.podformat import parse_all_options, parse_options

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _row(sl: int, local: str, remote: str, state: str, inode: int) -> str:
    return f"{sl:4}: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0\n"


def _proc(tmp: Path, pid: int, sockets: list[int], netns: Path, tcp4: str = "", tcp6: str = "") -> None:
    d = tmp / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "ns").mkdir()
    (d / "net").mkdir()
    for fd, inode in enumerate(sockets, start=3):
        os.symlink(f"socket:[{inode}]", d / "fd" / str(fd))
    os.symlink("/dev/null", d / "fd" / "0")
    os.symlink(str(netns), d / "ns" / "net")
    (d / "net" / "tcp").write_text(HEADER + tcp4)
    (d / "net" / "tcp6").write_text(HEADER + tcp6)


def test_held_connections_are_the_connected_sockets_the_processes_hold(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    netns = tmp_path / "netns"
    netns.write_text("")
    table = (
        _row(0, "00000000:1F90", "00000000:0000", "0A", 100)  # the listener: not connected
        + _row(1, "0201E70A:1F90", "0101E70A:B0C4", "01", 101)  # held by pid 7
        + _row(2, "0201E70A:1F90", "0101E70A:B0C6", "01", 999)  # in the table, held by nobody here
        + _row(3, "0201E70A:1F90", "0101E70A:B0C8", "08", 102)  # CLOSE_WAIT, held by pid 8
        + _row(4, "0201E70A:9C40", "0101E70A:1F90", "07", 103)  # CLOSE: not connected
    )
    v6 = _row(0, "00000000000000000000000001000000:1F90", "00000000000000000000000001000000:D431", "01", 104)
    _proc(proc, 7, [100, 101, 103], netns, table, v6)
    _proc(proc, 8, [102, 104], netns, table, v6)
    assert tcp.held_connections([7, 8, 9], proc=str(proc)) == [
        "pid 7: 10.231.1.2:8080 -> 10.231.1.1:45252 ESTABLISHED",
        "pid 8: 10.231.1.2:8080 -> 10.231.1.1:45256 CLOSE_WAIT",
        "pid 8: [::1]:8080 -> [::1]:54321 ESTABLISHED",
    ]
    assert tcp.held_connections([7], proc=str(proc)) == ["pid 7: 10.231.1.2:8080 -> 10.231.1.1:45252 ESTABLISHED"]
    assert tcp.held_connections([], proc=str(proc)) == []


def test_cgroup_pids_reads_the_cgroup_and_those_below(tmp_path: Path) -> None:
    (tmp_path / "child").mkdir()
    (tmp_path / "cgroup.procs").write_text("12\n7\n")
    (tmp_path / "child" / "cgroup.procs").write_text("30\n7\n")
    assert tcp.cgroup_pids(str(tmp_path)) == [7, 12, 30]
    assert tcp.cgroup_pids(str(tmp_path / "gone")) == []


def test_tcp_close_is_recorded_never_asked_for() -> None:
    flags = CheckpointFlags(file_locks=True, tcp_close=True)
    assert flags.as_options() == {"file-locks": "true", "tcp-close": "true"}
    assert flags.runc_args() == ["--file-locks"]  # runc has no flag for it
    assert flags.criu_config() == "skip-in-flight\ntcp-close\nnetwork-lock skip\n"
    assert CheckpointFlags().criu_config() == "skip-in-flight\nnetwork-lock skip\n"
    # Only a dump of connections kept open takes CRIU's network lock (and its restores, by the images).
    assert CheckpointFlags(tcp_established=True).criu_config() == "skip-in-flight\n"
    assert parse_options({"file-locks": "true", "tcp-close": "true"}) == flags  # what a checkpoint recorded
    with pytest.raises(errors.InvalidArgument) as e:
        parse_all_options({"tcp-close": "true"})  # what a caller asks for
    assert "unknown checkpoint option 'tcp-close'" in str(e.value)
    with pytest.raises(errors.InvalidArgument):
        parse_options({"tcp-close": "yes"})


@pytest.mark.parametrize("knows", [True, False], ids=["runc-1.3", "runc-1.1"])
def test_runc_checkpoint_skips_in_flight_connections_with_either_runc(tmp_path: Path, knows: bool) -> None:
    record = tmp_path / "argv"
    fake = tmp_path / "runc"
    help_text = "--tcp-established  allow open tcp connections\n" + (
        "   --tcp-skip-in-flight         skip in-flight tcp connections\n" if knows else "")
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$2" = "--help" ]; then printf "%s" "{help_text}"; exit 0; fi\n'
        f'printf "%s\\n" "$@" > {record}\n'
        f'cp "${CRIU_CONFIG_ENV}" {record}.conf\n'
    )
    fake.chmod(0o755)
    runc = Runc(str(fake), "/r")
    flags = CheckpointFlags(file_locks=True, tcp_close=True)
    asyncio.run(runc.checkpoint("c1", image_dir=str(tmp_path / "img"), work_dir=str(tmp_path / "work"), flags=flags))
    argv = record.read_text().splitlines()
    assert argv[:2] == ["--root", "/r"] and argv[-1] == "c1" and "--file-locks" in argv
    assert ("--tcp-skip-in-flight" in argv) is knows  # runc 1.3 sends the option itself (false unless given)
    assert Path(f"{record}.conf").read_text() == "skip-in-flight\ntcp-close\nnetwork-lock skip\n"
    assert (tmp_path / "work" / "criu.conf").read_text() == "skip-in-flight\ntcp-close\nnetwork-lock skip\n"
