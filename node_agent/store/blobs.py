"""Content-addressed blobs: the ``blobs/sha256`` directory.

Rule: a blob is verified before it becomes visible, and verified again when
it is read. Blobs live at ``blobs/sha256/<hex>`` and never change once linked
there. This module knows bytes and digests, not encodings, keys or
checkpoints: decoding and opening what a blob holds is ``chunk_reader``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterable, Iterator

from node_agent.errors import DataLoss
from node_agent.oci import digest_hex, is_hex_digest
from node_agent.store.files import O_CLOEXEC, O_NOFOLLOW, ensure_dir, fsync_dir, read_upto


class BlobStore:
    """The ``blobs/sha256`` directory: paths, verified reads, sizes, linking, deletion."""

    def __init__(self, root: str) -> None:
        self.parent = os.path.join(root, "blobs")
        self.dir = os.path.join(self.parent, "sha256")

    def setup(self) -> None:
        """Create or tighten the blob directories."""
        ensure_dir(self.parent)
        ensure_dir(self.dir)

    def path(self, digest: str) -> str:
        """Filesystem path of a blob (validated digest, no existence check)."""
        return os.path.join(self.dir, digest_hex(digest))

    def size_of(self, digest: str) -> int | None:
        """Size of a stored blob, or None if it is missing or not a regular file."""
        try:
            st = os.lstat(self.path(digest))
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def read(self, digest: str, size: int) -> bytes:
        """Read a whole blob and verify its size and digest; DataLoss otherwise."""
        problem, data = self.load(digest, size)
        if problem is not None:
            raise DataLoss(f"blob {digest}: {problem}")
        return data

    def load(self, digest: str, size: int) -> tuple[str | None, bytes]:
        """A blob's bytes once verified: (None, data), or (the reason it is bad, b"")."""
        path = self.path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        except FileNotFoundError:
            return "missing", b""
        except OSError as exc:
            return f"unreadable ({exc.strerror})", b""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "not a regular file", b""
            if st.st_size != size:
                return f"size mismatch (expected {size} bytes, found {st.st_size})", b""
            data = read_upto(fd, size + 1)
        except OSError as exc:
            return f"unreadable ({exc.strerror})", b""
        finally:
            os.close(fd)
        if len(data) != size:
            return f"size mismatch (expected {size} bytes, read {len(data) if len(data) <= size else 'more'})", b""
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest:
            return f"digest mismatch (content hashes to {actual})", b""
        return None, data

    def digests(self) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Every well-named entry of the blob directory."""
        with os.scandir(self.dir) as it:
            for entry in it:
                if is_hex_digest(entry.name):
                    yield "sha256:" + entry.name, entry

    def sizes(self) -> dict[str, int]:
        """Size of every well-named regular blob."""
        out: dict[str, int] = {}
        for digest, entry in self.digests():
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                out[digest] = st.st_size
        return out

    def link_in(self, temp: str, digest: str) -> None:
        """Make the verified file ``temp`` the blob ``digest`` (renamed into place).

        A blob of that name already there holds the same bytes or is damaged;
        either way the verified copy may replace it (readers that have the old
        file open keep reading it). The caller fsyncs the blob directory.
        """
        os.replace(temp, self.path(digest))

    def sync(self) -> None:
        """Flush the blob directories' entries to disk."""
        fsync_dir(self.dir)
        fsync_dir(self.parent)

    def delete(self, digests: Iterable[str]) -> tuple[list[str], int]:
        """Unlink blobs; return the digests removed and the bytes freed."""
        removed: list[str] = []
        freed = 0
        for digest in sorted(digests):
            path = self.path(digest)
            try:
                size = os.lstat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(digest)
            freed += size
        if removed:
            fsync_dir(self.dir)
        return removed, freed
