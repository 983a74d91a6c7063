"""Tests for criu_bridge.mountinfo: the one mount-table parser (the capture's upperdir, doctor's mounts)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from criu_bridge.errors import BridgeError
from criu_bridge.mountinfo import Mount, mounts_below, option, parse, parse_root_upperdir, unescape, upperdir_of
from node_agent.undoing import remove_dir


def test_lines_of_the_mountinfo_shape_are_kept_and_unescaped() -> None:
    text = (
        "22 1 0:21 / / rw - overlay overlay rw,upperdir=/u\\054v\n"
        "23 22 0:22 / /run/containerd rw,relatime shared:5 master:1 - tmpfs tmpfs rw\n"
        "24 22 0:23 / /var/lib/node\\040agent rw - ext4 /dev/disk\\040a rw\n"
        "garbage\n"
        "25 22 0:24 / /short rw -\n"
        "26 22 0:25 / /no-separator rw shared:1 x y z\n"
        "27 22 0:26 / /no-options rw - proc proc\n"
    )
    mounts = parse(text)
    assert mounts == [
        Mount("/", "overlay", "overlay", "rw,upperdir=/u\\054v"),
        Mount("/run/containerd", "tmpfs", "tmpfs", "rw"),
        Mount("/var/lib/node agent", "ext4", "/dev/disk a", "rw"),
        Mount("/no-options", "proc", "proc", ""),
    ]
    assert option(mounts[0], "upperdir") == "/u,v"  # an escaped comma does not split the option
    assert option(mounts[0], "lowerdir") is None
    assert option(Mount("/", "overlay", "overlay", "upperdir=,upperdir=/x"), "upperdir") == "/x"


def test_unescape_takes_exactly_three_octal_digits() -> None:
    assert unescape("a\\040b\\011c\\012d\\134e") == "a b\tc\nd\\e"
    assert unescape("no\\escape\\09") == "no\\escape\\09"
    assert unescape("\\0401") == " 1"


def test_this_process_mount_table_parses_line_for_line() -> None:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        text = f.read()
    mounts = parse(text)
    assert len(mounts) == len(text.splitlines())
    assert any(m.point == "/" for m in mounts)


def test_parse_root_upperdir() -> None:
    text = (
        "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
        "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "812 27 0:95 / / rw,relatime master:7 shared:9 - overlay overlay "
        "rw,lowerdir=/var/lib/l1:/var/lib/l2,"
        "upperdir=/var/lib/containerd/snap\\040shot/12/fs\\054x\\134y\\075z,"
        "workdir=/var/lib/containerd/snapshots/12/work,uuid=on\n"
        "813 812 0:96 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755\n"
    )
    assert parse_root_upperdir(text) == "/var/lib/containerd/snap shot/12/fs,x\\y=z"


def test_parse_root_upperdir_errors() -> None:
    with pytest.raises(BridgeError, match="ext4"):
        parse_root_upperdir("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n")
    with pytest.raises(BridgeError, match="no upperdir"):
        parse_root_upperdir("27 1 0:9 / / rw - overlay overlay ro,lowerdir=/a:/b\n")
    with pytest.raises(BridgeError, match="no mount at /"):
        parse_root_upperdir("22 27 0:21 / /proc rw,relatime - proc proc rw\ngarbage\n")
    # A mount point whose escaped name is "/x" is not the root.
    with pytest.raises(BridgeError):
        parse_root_upperdir("27 1 0:9 / /\\040 rw - overlay overlay rw,upperdir=/u\n")


def test_upperdir_of_this_process() -> None:
    with open("/proc/self/mountinfo") as f:
        roots = [line.split(" - ")[1].split()[0] for line in f if line.split()[4] == "/"]
    if roots[-1] == "overlay":
        assert upperdir_of(os.getpid())
    else:
        with pytest.raises(BridgeError, match="not overlayfs"):
            upperdir_of(os.getpid())
    with pytest.raises(BridgeError, match="mount table"):
        upperdir_of(2**22 + 12345)


def test_mounts_below_a_directory_deepest_first() -> None:
    text = (
        "30 1 0:5 / /plans/c/work/.criu.cgyard.x rw - tmpfs none rw\n"
        "31 30 0:6 / /plans/c/work/.criu.cgyard.x/memory rw - cgroup none rw,memory\n"
        "32 1 0:7 / /plans/cc rw - tmpfs none rw\n"
        "33 1 0:8 / /plans/c\\040d rw - tmpfs none rw\n"
    )
    assert mounts_below("/plans/c/", text) == ["/plans/c/work/.criu.cgyard.x/memory", "/plans/c/work/.criu.cgyard.x"]


def test_a_plan_with_mounts_left_in_it_is_removed(tmp_path: Path) -> None:
    """What a CRIU cut off mid-restore leaves: its cgroup yard, a tmpfs with a hierarchy mounted on it."""
    yard = tmp_path / "plan" / "work" / ".criu.cgyard.AbC123"
    yard.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(yard)], check=True)
    try:
        (yard / "pids").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "none", str(yard / "pids")], check=True)
        (yard / "pids" / "tasks").write_text("")
        assert remove_dir(str(tmp_path / "plan")) == ""
        assert not (tmp_path / "plan").exists()
    finally:
        with open("/proc/self/mountinfo") as fh:
            left = mounts_below(str(tmp_path), fh.read())
        for point in left:
            subprocess.run(["umount", "-l", point], check=False)
    assert left == []
