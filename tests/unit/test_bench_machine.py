"""What the benchmarks read about the machine (bench/harness/machine.py)."""

from __future__ import annotations

from pathlib import Path

from bench.harness.machine import inode_reuse_window


def test_no_inode_reuse_window_where_the_filesystem_has_none(tmp_path: Path) -> None:
    """Only ext4 without a journal makes new files pay for files deleted moments before: memory-backed
    filesystems and paths that do not exist give no window to wait out."""
    assert inode_reuse_window("/proc") == 0.0
    assert inode_reuse_window("/dev/shm") == 0.0
    assert inode_reuse_window(str(tmp_path / "gone")) == 0.0
