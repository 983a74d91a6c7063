"""What the capture and the apply of a diff share: limits, stats, paths from hostile input, the block copy."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

from criu_bridge.errors import BridgeError, InvalidInput, LimitExceeded

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Self

OPAQUE_DIRS_NAME = "opaque.dirs"
CHUNK = 1 << 20  # copy unit for file content
NAME_MAX = 255
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Frozen:
    """Small immutable record: equality, hash, repr, replace()."""

    __slots__: tuple[str, ...] = ()

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Frozen)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._values())

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed."""
        values = {name: getattr(self, name) for name in self.__slots__}
        values.update(changes)
        return type(self)(**values)

    def as_dict(self) -> dict[str, object]:
        """The fields as a dict."""
        return {name: getattr(self, name) for name in self.__slots__}


class DiffLimits(_Frozen):
    """Bounds for capturing and applying a diff (bytes, entries, path length)."""

    __slots__ = ("max_total_bytes", "max_entries", "max_path_len", "max_file_bytes")
    __match_args__ = ("max_total_bytes", "max_entries", "max_path_len", "max_file_bytes")
    max_total_bytes: int
    max_entries: int
    max_path_len: int
    max_file_bytes: int

    def __init__(
        self,
        max_total_bytes: int = 8 * 2**30,
        max_entries: int = 200_000,
        max_path_len: int = 4096,
        max_file_bytes: int = 4 * 2**30,
    ) -> None:
        for name, value in (
            ("max_total_bytes", max_total_bytes),
            ("max_entries", max_entries),
            ("max_path_len", max_path_len),
            ("max_file_bytes", max_file_bytes),
        ):
            if type(value) is not int or value < 0:
                raise ValueError(f"DiffLimits.{name} must be a non-negative int, not {value!r}")
            object.__setattr__(self, name, value)


class DiffStats(_Frozen):
    """What a capture or an apply did; `skipped` holds "path: reason" strings."""

    __slots__ = ("files", "dirs", "symlinks", "hardlinks", "deleted", "opaque_dirs", "bytes", "skipped", "fifos")
    __match_args__ = ("files", "dirs", "symlinks", "hardlinks", "deleted", "opaque_dirs", "bytes", "skipped", "fifos")
    files: int
    dirs: int
    symlinks: int
    hardlinks: int
    deleted: int
    opaque_dirs: int
    bytes: int
    skipped: tuple[str, ...]
    fifos: int

    def __init__(
        self,
        files: int,
        dirs: int,
        symlinks: int,
        hardlinks: int,
        deleted: int,
        opaque_dirs: int,
        bytes: int,
        skipped: tuple[str, ...],
        fifos: int = 0,
    ) -> None:
        for name, value in (
            ("files", files),
            ("dirs", dirs),
            ("symlinks", symlinks),
            ("hardlinks", hardlinks),
            ("deleted", deleted),
            ("opaque_dirs", opaque_dirs),
            ("bytes", bytes),
            ("skipped", tuple(skipped)),
            ("fifos", fifos),
        ):
            object.__setattr__(self, name, value)


class Counter:
    """Mutable counters behind a DiffStats."""

    def __init__(self) -> None:
        self.files = self.dirs = self.symlinks = self.hardlinks = 0
        self.deleted = self.opaque_dirs = self.bytes = self.fifos = 0
        self.skipped: list[str] = []

    def freeze(self) -> DiffStats:
        return DiffStats(
            files=self.files,
            dirs=self.dirs,
            symlinks=self.symlinks,
            hardlinks=self.hardlinks,
            deleted=self.deleted,
            opaque_dirs=self.opaque_dirs,
            bytes=self.bytes,
            skipped=tuple(self.skipped),
            fifos=self.fifos,
        )


def opaque_dirs_path(deleted_path: str) -> str:
    """Where the opaque-directory list lives: `opaque.dirs` next to deleted.files."""
    return os.path.join(os.path.dirname(deleted_path), OPAQUE_DIRS_NAME)


def show(path: bytes) -> str:
    """A path for messages: decoded, quoted, control characters escaped."""
    return repr(path.decode("utf-8", "backslashreplace"))


def oserror(what: str, e: OSError) -> BridgeError:
    """An OSError as a BridgeError saying what was being done, and on which path."""
    detail = e.strerror or str(e)
    name = e.filename
    if isinstance(name, bytes):
        detail += f" ({show(name)})"
    elif isinstance(name, str):
        detail += f" ({name!r})"
    return BridgeError(f"{what}: {detail}")


def split_path(raw: bytes, what: str, limits: DiffLimits) -> tuple[bytes, ...]:
    """Validate a relative path; return its components ("." and empty ones dropped)."""
    if not raw:
        raise InvalidInput(f"{what}: empty path")
    if b"\0" in raw:
        raise InvalidInput(f"{what}: NUL byte in path {show(raw)}")
    if len(raw) > limits.max_path_len:
        raise LimitExceeded(f"{what}: path longer than max_path_len={limits.max_path_len}: {show(raw[:200])}...")
    if raw.startswith(b"/"):
        raise InvalidInput(f"{what}: absolute path {show(raw)}")
    parts: list[bytes] = []
    for comp in raw.split(b"/"):
        if comp == b"" or comp == b".":
            continue
        if comp == b"..":
            raise InvalidInput(f"{what}: '..' in path {show(raw)}")
        if len(comp) > NAME_MAX:
            raise InvalidInput(f"{what}: name longer than {NAME_MAX} bytes in {show(raw)}")
        parts.append(comp)
    return tuple(parts)


def keep_xattr(name: str, regular: bool) -> bool:
    """Whether an xattr travels in the diff: `user.*` but `user.overlay.*`; `security.capability` on files."""
    if name.startswith("user."):
        return not name.startswith("user.overlay.")
    return regular and name == "security.capability"


def copy_blocks(out_fd: int, src_fd: int, offset: int, size: int) -> Iterator[int]:
    """Copy ``size`` bytes of ``src_fd`` from ``offset`` to ``out_fd`` in blocks of up to 1 MiB.

    Uses sendfile, falling back to pread and write where the files do not
    allow it. Yields each block's length; a 0 means the source ended early
    (the caller says what that means) and ends the copy.
    """
    end = offset + size
    use_sendfile = True
    while offset < end:
        count = min(CHUNK, end - offset)
        if use_sendfile:
            try:
                n = os.sendfile(out_fd, src_fd, offset, count)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                use_sendfile = False
                continue
        else:
            data = os.pread(src_fd, count, offset)
            n = len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(out_fd, view) :]
        yield n
        if n == 0:
            return
        offset += n
