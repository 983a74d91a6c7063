"""Descriptors below one rootfs: directories opened one component at a time, entries removed in place.

Every directory is opened relative to its parent's descriptor with
O_NOFOLLOW, so a symlink or a non-directory anywhere in a path is `NotDir`
and is never followed, and a directory on another filesystem is never
entered (BridgeError). `Tree` keeps the descriptors of the last parent path
open, since archive members and sorted path lists come in tree order; it
drops those at or below a directory before that directory is changed.
Removal never follows a symlink either.
"""

from __future__ import annotations

import errno
import os
import stat

from criu_bridge.errors import BridgeError, InvalidInput
from criu_bridge.rootfs.common import DIR_FLAGS, show

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    _T = TypeVar("_T")


class NotDir(Exception):
    """A path component is a symlink or not a directory."""


class Tree:
    """The rootfs below `root_fd` (which the caller owns and closes)."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.root_dev = os.fstat(root_fd).st_dev
        self._chain: list[tuple[bytes, int]] = []  # open directories of the last parent path

    def close(self) -> None:
        """Close every cached descriptor."""
        self._truncate(0)

    def _truncate(self, depth: int) -> None:
        while len(self._chain) > depth:
            os.close(self._chain.pop()[1])

    # -- opening

    def open_dir(self, parent_fd: int, name: bytes) -> int:
        """Open a child directory without following symlinks or leaving the filesystem."""
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except (NotADirectoryError, OSError) as e:
            if isinstance(e, NotADirectoryError) or e.errno == errno.ELOOP:
                raise NotDir() from None
            raise
        if os.fstat(fd).st_dev != self.root_dev:
            os.close(fd)
            raise BridgeError(f"{show(name)} is a mount point; refusing to cross it")
        return fd

    def dir_fd(
        self, parts: tuple[bytes, ...], *, create: bool, opened: Callable[[bytes], None] | None = None
    ) -> int | None:
        """The cached fd of directory `parts` below the root; None if missing (create=False).

        Missing directories are created (0755) with `create`. `opened` is
        told the path of every directory opened on the way. Raises NotDir
        when a component is a symlink or not a directory.
        """
        common = 0
        limit = min(len(self._chain), len(parts))
        while common < limit and self._chain[common][0] == parts[common]:
            common += 1
        self._truncate(common)
        fd = self._chain[-1][1] if self._chain else self.root_fd
        for depth in range(common, len(parts)):
            name = parts[depth]
            try:
                child = self.open_dir(fd, name)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(name, 0o755, dir_fd=fd)
                child = self.open_dir(fd, name)
            self._chain.append((name, child))
            if opened is not None:
                opened(b"/".join(parts[: depth + 1]))
            fd = child
        return fd

    def forget_below(self, parts: tuple[bytes, ...], keep_self: bool) -> None:
        """Drop cached descriptors at or under `parts` before it is changed."""
        n = len(parts)
        if len(self._chain) >= n and all(self._chain[i][0] == parts[i] for i in range(n)):
            self._truncate(n if keep_self else n - 1)

    def open_path(self, parts: tuple[bytes, ...]) -> int:
        """A fresh fd of an existing directory (no creation, no symlinks); the root's own fd for ()."""
        fd = self.root_fd
        try:
            for name in parts:
                child = self.open_dir(fd, name)
                if fd != self.root_fd:
                    os.close(fd)
                fd = child
        except NotDir:
            if fd != self.root_fd:
                os.close(fd)
            raise InvalidInput(f"path {show(b'/'.join(parts))} goes through a symlink") from None
        except BaseException:
            if fd != self.root_fd:
                os.close(fd)
            raise
        return fd

    # -- removal

    def empty_dir(self, fd: int) -> None:
        """Remove everything inside the directory `fd`, never following symlinks."""
        stack: list[tuple[int, list[tuple[str, bool]], str | None]] = [(fd, _list(fd), None)]
        try:
            while stack:
                cur, names, name_in_parent = stack[-1]
                if names:
                    name, is_dir = names.pop()
                    if is_dir:
                        try:
                            child = self.open_dir(cur, os.fsencode(name))
                        except NotDir:
                            os.unlink(name, dir_fd=cur)
                            continue
                        except FileNotFoundError:
                            continue
                        try:
                            listing = _list(child)
                        except BaseException:
                            os.close(child)
                            raise
                        stack.append((child, listing, name))
                    else:
                        try:
                            os.unlink(name, dir_fd=cur)
                        except FileNotFoundError:
                            pass
                    continue
                stack.pop()
                if name_in_parent is not None:
                    os.close(cur)
                    os.rmdir(name_in_parent, dir_fd=stack[-1][0])
        finally:
            for cur, _, name_in_parent in stack:
                if name_in_parent is not None:
                    os.close(cur)

    def empty_named(self, parent_fd: int, name: bytes) -> bool:
        """Empty the directory `name` of `parent_fd`; False, touching nothing, if it is not a directory."""
        try:
            fd = self.open_dir(parent_fd, name)
        except NotDir:
            return False
        try:
            self.empty_dir(fd)
        finally:
            os.close(fd)
        return True

    def remove(self, parent_fd: int, name: bytes, st: os.stat_result) -> None:
        """Remove an entry; a directory with everything inside it."""
        if stat.S_ISDIR(st.st_mode):
            try:
                fd = self.open_dir(parent_fd, name)
            except NotDir:
                os.unlink(name, dir_fd=parent_fd)
                return
            try:
                self.empty_dir(fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=parent_fd)
        else:
            os.unlink(name, dir_fd=parent_fd)

    def clear(self, parent: int, name: bytes, keep_dir: bool) -> bool:
        """Make room for a new entry; return True if an existing directory is kept."""
        st = lstat(parent, name)
        if st is None:
            return False
        if keep_dir and stat.S_ISDIR(st.st_mode):
            return True
        self.remove(parent, name, st)
        return False

    def make(self, parent: int, name: bytes, make: Callable[[], _T]) -> _T:
        """Create an entry; if something is in the way, remove it and retry once."""
        try:
            return make()
        except FileExistsError:
            self.clear(parent, name, keep_dir=False)
            return make()


def lstat(parent_fd: int, name: bytes) -> os.stat_result | None:
    """The entry's own stat (a symlink's, not its target's), or None if it is missing."""
    try:
        return os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _list(fd: int) -> list[tuple[str, bool]]:
    with os.scandir(fd) as it:
        return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
