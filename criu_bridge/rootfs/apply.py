"""Apply a captured diff onto a new container's rootfs; every input is hostile.

The steps, in order: read both path lists (opaque.dirs, deleted.files),
empty the opaque directories, remove the deleted paths, then extract the
tar member by member (check, then create) and set each directory's
metadata last. Paths resolve through `tree.Tree`, never through a symlink
and never into another filesystem.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

from criu_bridge import tarstream
from criu_bridge.errors import BridgeError, InvalidInput, LimitExceeded
from criu_bridge.rootfs.common import CHUNK, OPAQUE_DIRS_NAME, Counter, DiffLimits, DiffStats, copy_blocks
from criu_bridge.rootfs.common import keep_xattr, opaque_dirs_path, oserror, show, split_path
from criu_bridge.rootfs.tree import NotDir, Tree, lstat
from criu_bridge.tarstream import DIR, FIFO, FILE, HARDLINK, SYMLINK

_MAX_LIST_BYTES = 16 << 20  # deleted.files / opaque.dirs
_MAX_XATTR_VALUE = 64 << 10
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_IMPLICIT_DIR = "implicit"  # a directory created as the parent of a member, not by one


def apply_diff(
    rootfs: str,
    tar_path: str | None,
    deleted_path: str | None,
    *,
    limits: DiffLimits = DiffLimits(),
) -> DiffStats:
    """Apply a captured diff onto the mounted rootfs of a new container.

    Opaque directories (from `opaque_dirs_path(deleted_path)`, if that file
    exists) are emptied, then the paths in deleted.files removed, then the tar
    extracted. Every input is hostile; on error the rootfs is left partly
    changed (the caller discards the container) but nothing outside it is.
    `DiffStats.skipped` lists deletions whose parent is not a directory.
    """
    try:
        root_fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise oserror(f"cannot open rootfs {rootfs}", e) from e
    tree = Tree(root_fd)
    stats = Counter()
    try:
        if deleted_path is not None:
            deleted = _read_path_list(deleted_path, "deleted.files", limits)
            opaque_path = opaque_dirs_path(deleted_path)
            opaque: list[tuple[bytes, ...]] = []
            if os.path.lexists(opaque_path):
                opaque = _read_path_list(opaque_path, OPAQUE_DIRS_NAME, limits)
            try:
                _empty_opaque(tree, stats, sorted(opaque))
                _delete(tree, stats, deleted)
            except OSError as e:
                raise oserror("applying deletions", e) from e
            finally:
                tree.close()
        if tar_path is not None:
            _Extraction(tree, stats, limits).run(tar_path)
        return stats.freeze()
    finally:
        tree.close()
        os.close(root_fd)


# --------------------------------------------------------------------------
# Path lists


def _open_input(path: str, name: str) -> tuple[int, int]:
    """(fd, size) of the regular file at `path`, which messages call `name` (followed by the path if not it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise oserror(f"cannot open {name if name == path else f'{name} {path}'}", e) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_path_list(path: str, what: str, limits: DiffLimits) -> list[tuple[bytes, ...]]:
    """A JSON list of paths (deleted.files or opaque.dirs), validated."""
    fd, size = _open_input(path, what)
    try:
        if size > _MAX_LIST_BYTES:
            raise LimitExceeded(f"{what} is larger than {_MAX_LIST_BYTES} bytes")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if total > _MAX_LIST_BYTES:
                raise LimitExceeded(f"{what} is larger than {_MAX_LIST_BYTES} bytes")
            chunks.append(chunk)
    finally:
        os.close(fd)
    import json

    try:
        value = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise InvalidInput(f"{what} is not valid JSON") from None
    if not isinstance(value, list):
        raise InvalidInput(f"{what} is not a JSON list")
    if len(value) > limits.max_entries:
        raise LimitExceeded(f"{what} has more than max_entries={limits.max_entries} paths")
    result: list[tuple[bytes, ...]] = []
    for item in value:
        if not isinstance(item, str):
            raise InvalidInput(f"{what}: {item!r:.80} is not a string")
        try:
            raw = os.fsencode(item)
        except UnicodeEncodeError:
            raise InvalidInput(f"{what}: {item!r:.80} cannot be encoded") from None
        # CRI-O and Podman write "/etc/motd"; the path is relative to the rootfs either way.
        parts = split_path(raw.lstrip(b"/") or raw, what, limits)
        if not parts:
            raise InvalidInput(f"{what}: {item!r:.80} names the rootfs itself")
        result.append(parts)
    return result


def _existing(
    tree: Tree, stats: Counter, paths: list[tuple[bytes, ...]]
) -> Iterator[tuple[tuple[bytes, ...], int, os.stat_result]]:
    """(components, parent fd, own stat) of each listed path that exists.

    A path whose parent is a symlink or not a directory is skipped, and
    recorded in the stats as skipped.
    """
    for parts in paths:
        try:
            parent = tree.dir_fd(parts[:-1], create=False)
        except NotDir:
            stats.skipped.append(f"{os.fsdecode(b'/'.join(parts))}: parent is a symlink or not a directory")
            continue
        if parent is None:
            continue
        st = lstat(parent, parts[-1])
        if st is not None:
            yield parts, parent, st


def _empty_opaque(tree: Tree, stats: Counter, paths: list[tuple[bytes, ...]]) -> None:
    """Empty each opaque directory that exists (a non-directory there is removed)."""
    for parts, parent, st in _existing(tree, stats, paths):
        tree.forget_below(parts, keep_self=True)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(parts[-1], dir_fd=parent)
        elif not tree.empty_named(parent, parts[-1]):
            continue
        stats.opaque_dirs += 1


def _delete(tree: Tree, stats: Counter, paths: list[tuple[bytes, ...]]) -> None:
    """Remove each deleted path that exists, a directory with everything in it."""
    for parts, parent, st in _existing(tree, stats, paths):
        tree.forget_below(parts, keep_self=False)
        tree.remove(parent, parts[-1], st)
        stats.deleted += 1


# --------------------------------------------------------------------------
# The tar


class _Member:
    """One tar member after its extended headers were merged in."""

    __slots__ = ("name", "kind", "mode", "uid", "gid", "size", "mtime_ns", "linkname", "xattrs", "offset")

    def __init__(self) -> None:
        self.name = b""
        self.kind = ""
        self.mode = 0
        self.uid = 0
        self.gid = 0
        self.size = 0
        self.mtime_ns = 0
        self.linkname = b""
        self.xattrs: list[tuple[str, bytes]] = []
        self.offset = 0


class _TarReader:
    """Members of a regular-file tar read by offset; content stays in place for sendfile.

    `tarstream` checks every header (its defaults refuse devices and a
    trailing slash on anything but a directory); this then reads mode,
    owner and mtime, checks max_file_bytes, and that the content lies
    inside the file, in that order.
    """

    def __init__(self, fd: int, size: int, limits: DiffLimits) -> None:
        self.source = tarstream.FileSource(fd, size)
        self.limits = limits
        self.headers = tarstream.TarStream(self.source, pax_nul_ends=True, pax_text_keys=True)

    def next(self) -> _Member | None:
        h = self.headers.next()
        if h is None:
            return None
        m = _Member()
        m.name = h.name
        m.kind = h.kind
        m.linkname = h.linkname
        m.mode = h.mode()
        m.uid, m.gid = h.owner()
        m.mtime_ns = h.mtime_ns()
        m.xattrs = [(name.decode("utf-8"), value) for name, value in h.xattrs]
        if h.kind == FILE:
            if h.size > self.limits.max_file_bytes:
                raise LimitExceeded(f"tar member {h.shown}: larger than max_file_bytes={self.limits.max_file_bytes}")
            m.size = h.size
            m.offset = self.source.pos
            if m.offset + h.size > self.source.size:
                raise InvalidInput(f"tar member {h.shown}: content runs past the end of the archive")
        return m


class _Extraction:
    """The tar's members below the rootfs: each checked against the bounds and what came before, then created."""

    def __init__(self, tree: Tree, stats: Counter, limits: DiffLimits) -> None:
        self.tree = tree
        self.stats = stats
        self.limits = limits
        self.seen: dict[bytes, str] = {}  # member path -> kind, _IMPLICIT_DIR for parents made on the way
        self.extracted: set[bytes] = set()  # regular files: the only hardlink targets
        self.dir_meta: dict[bytes, tuple[tuple[bytes, ...], _Member]] = {}
        self.entries = 0
        self.total = 0

    def run(self, tar_path: str) -> None:
        fd, size = _open_input(tar_path, tar_path)
        try:
            if size == 0:
                return
            reader = _TarReader(fd, size, self.limits)
            self.tree.close()
            while True:
                member = reader.next()
                if member is None:
                    break
                self._member(member, fd)
            self.tree.close()
            self._finish_dirs()
        finally:
            self.tree.close()
            os.close(fd)

    def _implicit(self, key: bytes) -> None:
        self.seen.setdefault(key, _IMPLICIT_DIR)

    def _member(self, m: _Member, tar_fd: int) -> None:
        checked = self._check(m)
        if checked is None:
            return  # the rootfs itself ("./")
        parts, key, target = checked
        shown = show(key)
        try:
            try:
                parent = self.tree.dir_fd(parts[:-1], create=True, opened=self._implicit)
            except NotDir:
                raise InvalidInput(
                    f"tar member {shown}: a parent directory is a symlink or not a directory"
                ) from None
            assert parent is not None
            self._create(m, parts, key, parent, target, tar_fd)
        except OSError as e:
            raise oserror(f"tar member {shown}", e) from e

    def _check(self, m: _Member) -> tuple[tuple[bytes, ...], bytes, tuple[bytes, ...]] | None:
        """(components, path, hardlink target) of a member that passes every check; None for the root."""
        limits = self.limits
        parts = split_path(m.name, "tar member", limits)
        if not parts:
            if m.kind == DIR:
                return None
            raise InvalidInput(f"tar member {show(m.name)}: empty name")
        key = b"/".join(parts)
        shown = show(key)
        self.entries += 1
        if self.entries > limits.max_entries:
            raise LimitExceeded(f"tar has more than max_entries={limits.max_entries} members at {shown}")
        previous = self.seen.get(key)
        if previous is not None and not (m.kind == DIR and previous in (DIR, _IMPLICIT_DIR)):
            raise InvalidInput(f"tar member {shown}: duplicate of an earlier {previous} member")
        target: tuple[bytes, ...] = ()
        if m.kind == HARDLINK:
            target = split_path(m.linkname, f"tar member {shown} link target", limits)
            if b"/".join(target) not in self.extracted or target == parts:
                raise InvalidInput(
                    f"tar member {shown}: hardlink target {show(m.linkname)} is not a regular file "
                    "extracted from this archive"
                )
        elif m.kind == SYMLINK:
            if not m.linkname or b"\0" in m.linkname or len(m.linkname) > limits.max_path_len:
                raise InvalidInput(f"tar member {shown}: bad symlink target")
        elif m.kind == FILE:
            if m.size > limits.max_file_bytes:
                raise LimitExceeded(f"tar member {shown}: larger than max_file_bytes={limits.max_file_bytes}")
            if self.total + m.size > limits.max_total_bytes:
                raise LimitExceeded(f"tar member {shown}: max_total_bytes={limits.max_total_bytes} exceeded")
        for xname, value in m.xattrs:
            if len(value) > _MAX_XATTR_VALUE:
                raise LimitExceeded(f"tar member {shown}: xattr {xname} is too large")
        self.seen[key] = m.kind
        return parts, key, target

    def _create(
        self, m: _Member, parts: tuple[bytes, ...], key: bytes, parent: int, target: tuple[bytes, ...], tar_fd: int
    ) -> None:
        name = parts[-1]
        if m.kind == DIR:
            self._dir(m, parts, key, parent, name)
        elif m.kind == FILE:
            self._file(m, key, parent, name, tar_fd)
        elif m.kind == SYMLINK:
            self._symlink(m, parent, name)
        elif m.kind == HARDLINK:
            self._hardlink(key, parent, name, target)
        elif m.kind == FIFO:
            self._fifo(m, key, parent, name)

    def _dir(self, m: _Member, parts: tuple[bytes, ...], key: bytes, parent: int, name: bytes) -> None:
        """A directory is made 0700; its metadata is set after its content (`_finish_dirs`)."""
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            if not self.tree.clear(parent, name, keep_dir=True):
                os.mkdir(name, 0o700, dir_fd=parent)
        if key not in self.dir_meta:
            self.stats.dirs += 1
        self.dir_meta[key] = (parts, m)

    def _file(self, m: _Member, key: bytes, parent: int, name: bytes, tar_fd: int) -> None:
        fd = self.tree.make(parent, name, lambda: os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=parent))
        try:
            self._copy(tar_fd, fd, m, key)
            _set_meta(fd, m, regular=True)
        finally:
            os.close(fd)
        self.extracted.add(key)
        self.stats.files += 1

    def _symlink(self, m: _Member, parent: int, name: bytes) -> None:
        self.tree.make(parent, name, lambda: os.symlink(m.linkname, name, dir_fd=parent))
        os.chown(name, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
        os.utime(name, ns=(m.mtime_ns, m.mtime_ns), dir_fd=parent, follow_symlinks=False)
        self.stats.symlinks += 1

    def _hardlink(self, key: bytes, parent: int, name: bytes, target: tuple[bytes, ...]) -> None:
        src_parent = self.tree.open_path(target[:-1])
        try:
            self.tree.make(
                parent,
                name,
                lambda: os.link(target[-1], name, src_dir_fd=src_parent, dst_dir_fd=parent, follow_symlinks=False),
            )
        finally:
            if src_parent != self.tree.root_fd:
                os.close(src_parent)
        self.extracted.add(key)
        self.stats.hardlinks += 1

    def _fifo(self, m: _Member, key: bytes, parent: int, name: bytes) -> None:
        self.tree.make(parent, name, lambda: os.mkfifo(name, 0o600, dir_fd=parent))
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise BridgeError(f"{show(key)} changed while it was created")
            _set_meta(fd, m)
        finally:
            os.close(fd)
        self.stats.fifos += 1

    def _copy(self, tar_fd: int, out_fd: int, m: _Member, key: bytes) -> None:
        """Stream the member's content in 1 MiB blocks, enforcing the bounds."""
        limits = self.limits
        copied = 0
        for n in copy_blocks(out_fd, tar_fd, m.offset, m.size):
            if n == 0:
                raise InvalidInput(f"tar member {show(key)}: archive is truncated")
            copied += n
            self.total += n
            if copied > limits.max_file_bytes:
                raise LimitExceeded(f"tar member {show(key)}: larger than max_file_bytes={limits.max_file_bytes}")
            if self.total > limits.max_total_bytes:
                raise LimitExceeded(
                    f"tar member {show(key)}: max_total_bytes={limits.max_total_bytes} exceeded"
                )
        self.stats.bytes += copied

    def _finish_dirs(self) -> None:
        """Set directory metadata after their content, deepest last-seen first."""
        for parts, m in reversed(self.dir_meta.values()):
            shown = show(b"/".join(parts))
            try:
                parent = self.tree.dir_fd(parts[:-1], create=False)
                if parent is None:
                    raise InvalidInput(f"directory {shown} vanished")
                fd = self.tree.open_dir(parent, parts[-1])
            except NotDir:
                raise InvalidInput(f"directory {shown} was replaced") from None
            except OSError as e:
                raise oserror(f"directory {shown}", e) from e
            try:
                _set_meta(fd, m)
            except OSError as e:
                raise oserror(f"directory {shown}", e) from e
            finally:
                os.close(fd)


def _set_meta(fd: int, m: _Member, regular: bool = False) -> None:
    """Owner, then mode (chown clears setuid), xattrs and mtime on an open fd."""
    os.chown(fd, m.uid, m.gid)
    os.chmod(fd, m.mode)
    for name, value in m.xattrs:
        if keep_xattr(name, regular):
            os.setxattr(fd, name, value)
    os.utime(fd, ns=(m.mtime_ns, m.mtime_ns))
