"""criu_bridge.rpc against a real `criu swrk`, plus stand-ins that misbehave.

The real-CRIU tests need CRIU 4.2 or newer (`$CRIU`, else `criu` on PATH,
/usr/local/sbin/criu or /usr/sbin/criu) and are skipped without one. The
timeout, cancellation and crash tests use small shell scripts in place of
CRIU, so they always run.
"""

from __future__ import annotations

import asyncio
import os
import platform
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from criu_bridge.errors import InvalidInput, RuntimeFailure
from criu_bridge.rpc import FEATURES, CriuClient, CriuVersion, rpc_pb2

MIN_VERSION = (4, 2)


def _binary_version(path: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return None
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


@pytest.fixture(scope="module")
def criu() -> tuple[str, tuple[int, ...]]:
    candidates = [
        os.environ.get("CRIU"),
        shutil.which("criu"),
        "/usr/local/sbin/criu",
        "/usr/sbin/criu",
    ]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            version = _binary_version(path)
            if version is not None and version[:2] >= MIN_VERSION:
                return path, version
    pytest.skip("no criu >= 4.2 found (set $CRIU)")


@pytest.fixture
def client(criu: tuple[str, tuple[int, ...]]) -> CriuClient:
    return CriuClient(criu[0], timeout=30.0)


# -- wire schema --------------------------------------------------------------------


def test_criu_opts_field_numbers() -> None:
    numbers = {f.name: f.number for f in rpc_pb2.criu_opts.DESCRIPTOR.fields}
    expected = {
        "images_dir_fd": 1, "pid": 2, "leave_running": 3, "tcp_established": 5,
        "shell_job": 7, "file_locks": 8, "log_level": 9, "log_file": 10, "ps": 11,
        "notify_scripts": 12, "parent_img": 14, "track_mem": 15, "auto_dedup": 16,
        "work_dir_fd": 17, "inherit_fd": 27, "manage_cgroups_mode": 34,
        "external": 37, "freeze_cgroup": 44, "timeout": 45, "lazy_pages": 48,
        "config_file": 51, "tcp_close": 52, "lsm_profile": 53, "pre_dump_mode": 61,
        "network_lock": 64, "images_dir": 68, "leave_stopped": 69,
    }  # fmt: skip
    assert {name: numbers.get(name) for name in expected} == expected
    req = {f.name: f.number for f in rpc_pb2.criu_req.DESCRIPTOR.fields}
    assert req == {
        "type": 1, "opts": 2, "notify_success": 3, "keep_open": 4, "features": 5, "pid": 6,
    }  # fmt: skip
    resp = {f.name: f.number for f in rpc_pb2.criu_resp.DESCRIPTOR.fields}
    assert resp == {
        "type": 1, "success": 2, "dump": 3, "restore": 4, "notify": 5, "ps": 6,
        "cr_errno": 7, "features": 8, "cr_errmsg": 9, "version": 10, "status": 11,
    }  # fmt: skip
    assert rpc_pb2.NOTIFY == 6 and rpc_pb2.FEATURE_CHECK == 9 and rpc_pb2.VERSION == 10


async def test_incomplete_request_is_invalid_input() -> None:
    # images_dir_fd is required in criu_opts.
    req = rpc_pb2.criu_req(type=rpc_pb2.DUMP, opts=rpc_pb2.criu_opts(pid=1))
    with pytest.raises(InvalidInput, match="incomplete request"):
        await CriuClient("/bin/false").request(req)


# -- real CRIU ---------------------------------------------------------------------------


async def test_version(client: CriuClient, criu: tuple[str, tuple[int, ...]]) -> None:
    version = await client.version()
    assert isinstance(version, CriuVersion)
    assert version.at_least(*MIN_VERSION)
    assert (version.major, version.minor) == criu[1][:2]
    assert version.text == ".".join(str(p) for p in criu[1])


async def test_check_passes(client: CriuClient) -> None:
    await client.check()


async def test_features(client: CriuClient) -> None:
    features = await client.features()
    assert set(features) == set(FEATURES)
    assert all(isinstance(v, bool) for v in features.values())


async def test_cpuinfo_round_trip(client: CriuClient, tmp_path: Path) -> None:
    await client.cpuinfo_dump(str(tmp_path))
    assert (tmp_path / "cpuinfo.img").stat().st_size > 0
    # Logs go to a separate work directory, never into the images.
    assert os.listdir(tmp_path) == ["cpuinfo.img"]
    await client.cpuinfo_check(str(tmp_path))


async def test_cpuinfo_check_without_image(client: CriuClient, tmp_path: Path) -> None:
    with pytest.raises(RuntimeFailure) as info:
        await client.cpuinfo_check(str(tmp_path))
    failure = info.value
    assert failure.phase == "criu cpuinfo-check"
    assert any("cpuinfo" in line.lower() for line in failure.decisive), failure.decisive
    assert "No cpuinfo image" in str(failure)
    assert failure.log_path is None  # the temporary work directory is gone


async def test_cpuinfo_check_keeps_log_in_work_dir(client: CriuClient, tmp_path: Path) -> None:
    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    with pytest.raises(RuntimeFailure) as info:
        await client.cpuinfo_check(str(images), work_dir=str(work))
    assert info.value.log_path == str(work / "cpuinfo-check.log")
    assert "No cpuinfo image" in (work / "cpuinfo-check.log").read_text()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 cpuinfo layout")
async def test_cpuinfo_check_names_the_mismatch(client: CriuClient, tmp_path: Path) -> None:
    await client.cpuinfo_dump(str(tmp_path))
    image = tmp_path / "cpuinfo.img"
    # Claim every xsave feature this machine might lack (x86 entry field 8).
    image.write_bytes(_edit_x86_cpuinfo(image.read_bytes(), field=8, update=lambda v: v | 0x7FFFF))
    with pytest.raises(RuntimeFailure) as info:
        await client.cpuinfo_check(str(tmp_path))
    assert any("xfeatures" in line for line in info.value.decisive), info.value.decisive


async def test_missing_images_dir(client: CriuClient, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot open directory"):
        await client.cpuinfo_dump(str(tmp_path / "nope"))


@pytest.mark.skipif(os.geteuid() != 0, reason="dumping a process needs root")
async def test_dump_answers_notifications(client: CriuClient, tmp_path: Path) -> None:
    with _sleeper() as pid:
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            scripts: list[str] = []

            async def on_notify(script: str) -> None:
                scripts.append(script)

            opts = rpc_pb2.criu_opts(
                images_dir_fd=fd, pid=pid, leave_running=True, notify_scripts=True,
                log_file="dump.log", log_level=4,
            )  # fmt: skip
            resp = await client.request(
                rpc_pb2.criu_req(type=rpc_pb2.DUMP, opts=opts), on_notify=on_notify
            )
            assert resp.success
            assert scripts[0] == "pre-dump" and scripts[-1] == "post-dump"
            assert (tmp_path / "inventory.img").exists()

            # A failing hook makes CRIU roll back; the hook's error comes out.
            async def refuse(script: str) -> None:
                raise ValueError(f"refused {script}")

            opts.log_file = "dump-refused.log"
            with pytest.raises(ValueError, match="refused pre-dump"):
                await client.request(
                    rpc_pb2.criu_req(type=rpc_pb2.DUMP, opts=opts), on_notify=refuse
                )
            assert "Pre dump script failed" in (tmp_path / "dump-refused.log").read_text()
        finally:
            os.close(fd)
        assert _alive(pid), "the dumped process must keep running"


# -- stand-ins for CRIU ------------------------------------------------------------------


def _fake_criu(tmp_path: Path, body: str) -> str:
    """An executable that records its PID (and a child's) and then runs `body`."""
    script = tmp_path / "criu"
    script.write_text(
        "#!/bin/sh\n"
        f"echo $$ > {tmp_path}/criu.pid\n"
        f"sleep 300 & echo $! > {tmp_path}/child.pid\n"
        f"{body}\n"
    )
    script.chmod(0o755)
    return str(script)


async def _pids(tmp_path: Path) -> tuple[int, int]:
    async with asyncio.timeout(10):
        while not (tmp_path / "child.pid").exists() or not (tmp_path / "child.pid").read_text():
            await asyncio.sleep(0.02)
    return int((tmp_path / "criu.pid").read_text()), int((tmp_path / "child.pid").read_text())


def _state(pid: int) -> str | None:
    """The process state letter from /proc, or None when the PID is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


async def _assert_killed_and_reaped(criu_pid: int, child_pid: int) -> None:
    # Reaped: not even a zombie is left of the process we started.
    assert _state(criu_pid) is None
    # Its process group was killed too (the child may linger as a zombie of init).
    async with asyncio.timeout(5):
        while _alive(child_pid):
            await asyncio.sleep(0.02)


async def test_timeout_kills_and_reaps(tmp_path: Path) -> None:
    client = CriuClient(_fake_criu(tmp_path, "wait"), timeout=1.0)
    started = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        await client.version()
    assert time.monotonic() - started < 5
    assert isinstance(info.value.__cause__, TimeoutError)
    assert "within 1s and was killed" in str(info.value)
    await _assert_killed_and_reaped(*await _pids(tmp_path))


async def test_per_request_timeout(tmp_path: Path) -> None:
    client = CriuClient(_fake_criu(tmp_path, "wait"), timeout=60.0)
    with pytest.raises(RuntimeFailure, match="within 0.5s"):
        await client.request(rpc_pb2.criu_req(type=rpc_pb2.VERSION), timeout=0.5)
    await _assert_killed_and_reaped(*await _pids(tmp_path))


async def test_cancellation_kills_and_reaps(tmp_path: Path) -> None:
    client = CriuClient(_fake_criu(tmp_path, "wait"), timeout=60.0)
    task = asyncio.create_task(client.features(), name="criu-features")
    criu_pid, child_pid = await _pids(tmp_path)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _assert_killed_and_reaped(criu_pid, child_pid)


async def test_exit_without_answer(tmp_path: Path) -> None:
    client = CriuClient(_fake_criu(tmp_path, "kill $!; echo 'swrk: bad socket' >&2; exit 3"))
    with pytest.raises(RuntimeFailure) as info:
        await client.version()
    assert "exited with status 3 before answering" in str(info.value)
    assert info.value.decisive == ["swrk: bad socket"]


async def test_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(RuntimeFailure, match="cannot run"):
        await CriuClient(str(tmp_path / "no-criu")).version()


# -- helpers --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_leftover_criu() -> Iterator[None]:
    yield
    # Every criu this test started has exited and been reaped (no zombies).
    assert _criu_children() == []


def _criu_children() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and comm == "criu":
            found.append(int(entry.name))
    return found


class _sleeper:
    """A `sleep` in its own session, with no terminal: dumpable without shell_job."""

    def __enter__(self) -> int:
        self.proc = subprocess.Popen(
            ["sleep", "600"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self.proc.pid

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    out: list[tuple[int, int, int | bytes]] = []
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            out.append((number, wire, value))
        elif wire == 2:
            size, i = _varint(data, i)
            out.append((number, wire, data[i : i + size]))
            i += size
        else:
            raise ValueError(f"unexpected wire type {wire}")
    return out


def _encode(fields: list[tuple[int, int, int | bytes]]) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += _put_varint(number << 3 | wire)
        if isinstance(value, int):
            out += _put_varint(value)
        else:
            out += _put_varint(len(value)) + value
    return bytes(out)


def _edit_x86_cpuinfo(image: bytes, *, field: int, update: Callable[[int], int]) -> bytes:
    """Change one varint field of the x86 entry in a cpuinfo.img.

    Layout: two magic words, a u32 entry size, then a CpuinfoEntry whose
    field 1 is the CpuinfoX86Entry.
    """
    (size,) = struct.unpack_from("<I", image, 8)
    entry = _fields(image[12 : 12 + size])
    edited = []
    for number, wire, value in entry:
        if number == 1 and isinstance(value, bytes):
            x86 = [
                (n, w, update(v) if n == field and isinstance(v, int) else v)
                for n, w, v in _fields(value)
            ]
            value = _encode(x86)
        edited.append((number, wire, value))
    body = _encode(edited)
    return image[:8] + struct.pack("<I", len(body)) + body + image[12 + size :]
