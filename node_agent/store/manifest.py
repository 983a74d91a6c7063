"""The checkpoint manifest: schema, canonical encoding and validation.

Rule: a manifest is data, never trusted. Everything loaded from disk goes
through ``decode_manifest``, which checks the schema, the types, every path
(relative, normalized, no ``..``, no duplicates, no file used as a directory),
every chunk list (contiguous offsets summing to the file size, well-formed
digests) and the size bounds. This module does no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from node_agent.errors import DataLoss, InvalidArgument

SCHEMA_VERSION: Final = 1
MEDIA_TYPE: Final = "application/vnd.node-agent.checkpoint.manifest.v1+json"
IDENTITY: Final = "identity"
SUPPORTED_ENCODINGS: Final = frozenset({IDENTITY})

MAX_MANIFEST_BYTES: Final = 64 << 20
MAX_ENTRIES: Final = 1_000_000
MAX_CHUNK_SIZE: Final = 64 << 20
MAX_PATH_BYTES: Final = 4096
MAX_NAME_BYTES: Final = 255
MAX_MODE: Final = 0o7777

_HEX_RE: Final = re.compile(r"[0-9a-f]{64}")
_CREATED_RE: Final = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?Z")
_TOP_KEYS: Final = frozenset({"schemaVersion", "mediaType", "created", "metadata", "files"})
_FILE_KEYS: Final = frozenset({"path", "type", "mode", "size", "chunks"})
_DIR_KEYS: Final = frozenset({"path", "type", "mode"})
_CHUNK_KEYS: Final = frozenset({"digest", "size", "offset", "encoding"})
_CHUNK_REQUIRED: Final = frozenset({"digest", "size", "offset"})

EntryType = Literal["file", "dir"]


@dataclass(frozen=True)
class Chunk:
    """A byte range ``[offset, offset + size)`` of a file, stored as one blob."""

    digest: str
    size: int
    offset: int
    encoding: str = IDENTITY

    def to_json(self) -> dict[str, Any]:
        """The chunk's manifest record; ``encoding`` is omitted when identity."""
        out: dict[str, Any] = {"digest": self.digest, "size": self.size, "offset": self.offset}
        if self.encoding != IDENTITY:
            out["encoding"] = self.encoding
        return out


@dataclass(frozen=True)
class FileEntry:
    """One path of a checkpoint: a regular file (with chunks) or a directory."""

    path: str
    type: EntryType
    mode: int
    size: int = 0
    chunks: tuple[Chunk, ...] = field(default=())

    @property
    def is_dir(self) -> bool:
        """Whether the entry is a directory."""
        return self.type == "dir"

    def to_json(self) -> dict[str, Any]:
        """The entry's manifest record."""
        if self.type == "dir":
            return {"path": self.path, "type": "dir", "mode": self.mode}
        return {
            "path": self.path,
            "type": "file",
            "mode": self.mode,
            "size": self.size,
            "chunks": [c.to_json() for c in self.chunks],
        }


@dataclass(frozen=True)
class Manifest:
    """A decoded, validated manifest."""

    created: str
    metadata: Mapping[str, Any]
    files: tuple[FileEntry, ...]


def digest_hex(digest: str) -> str:
    """Return the hex part of ``sha256:<hex>``; InvalidArgument if malformed."""
    if not isinstance(digest, str) or not digest.startswith("sha256:"):
        raise InvalidArgument(f"malformed digest {digest!r}: want sha256:<64 hex>")
    hexpart = digest[len("sha256:") :]
    if not _HEX_RE.fullmatch(hexpart):
        raise InvalidArgument(f"malformed digest {digest!r}: want sha256:<64 hex>")
    return hexpart


def is_hex_digest(hexpart: str) -> bool:
    """Whether ``hexpart`` is 64 lowercase hex characters."""
    return _HEX_RE.fullmatch(hexpart) is not None


def sha256_digest(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def normalize_path(path: str) -> str:
    """Validate a relative, "/"-separated path; return it unchanged.

    A path must already be normal: no leading or trailing "/", no empty,
    "." or ".." component, no NUL, valid UTF-8, bounded length.
    """
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"invalid path {path!r}: must be a non-empty string")
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"invalid path {path!r}: not valid UTF-8") from None
    if len(raw) > MAX_PATH_BYTES:
        raise InvalidArgument(f"invalid path {path!r}: longer than {MAX_PATH_BYTES} bytes")
    if "\x00" in path:
        raise InvalidArgument(f"invalid path {path!r}: contains NUL")
    if path.startswith("/"):
        raise InvalidArgument(f"invalid path {path!r}: must be relative")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise InvalidArgument(f"invalid path {path!r}: must be normalized (no '', '.', '..')")
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise InvalidArgument(f"invalid path {path!r}: component longer than {MAX_NAME_BYTES} bytes")
    return path


def join_path(prefix: str, name: str) -> str:
    """Join a (possibly empty) prefix and a relative path."""
    return f"{prefix}/{name}" if prefix else name


def encode_manifest(created: str, metadata: Mapping[str, Any], files: Sequence[FileEntry]) -> bytes:
    """Canonical bytes of a manifest (sorted keys, no whitespace, ASCII)."""
    doc = {
        "schemaVersion": SCHEMA_VERSION,
        "mediaType": MEDIA_TYPE,
        "created": created,
        "metadata": dict(metadata),
        "files": [f.to_json() for f in files],
    }
    try:
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"metadata is not a JSON object: {exc}") from exc
    return text.encode("utf-8")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Invalid(Exception):
    """Internal: a validation failure, turned into the caller's error class."""


def decode_manifest(data: bytes, *, error: type[Exception] = DataLoss, what: str = "manifest") -> Manifest:
    """Parse and validate manifest bytes.

    ``error`` is the class raised on any problem (DataLoss for stored
    manifests, InvalidArgument for caller input); ``what`` names the
    manifest in messages.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise error(f"{what}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        doc = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_reject_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what}: not valid JSON: {exc}") from exc
    try:
        return _validate(doc)
    except (_Invalid, InvalidArgument) as exc:
        raise error(f"{what}: {exc}") from exc


def _validate(doc: object) -> Manifest:
    if not isinstance(doc, dict):
        raise _Invalid("top level is not an object")
    keys = set(doc)
    if keys != _TOP_KEYS:
        missing, extra = sorted(_TOP_KEYS - keys), sorted(keys - _TOP_KEYS)
        raise _Invalid(f"wrong top-level keys (missing {missing}, unexpected {extra})")
    if not _is_int(doc["schemaVersion"]) or doc["schemaVersion"] != SCHEMA_VERSION:
        raise _Invalid(f"unsupported schemaVersion {doc['schemaVersion']!r}")
    if doc["mediaType"] != MEDIA_TYPE:
        raise _Invalid(f"unsupported mediaType {doc['mediaType']!r}")
    created = doc["created"]
    if not isinstance(created, str) or not _CREATED_RE.fullmatch(created):
        raise _Invalid(f"created {created!r} is not an RFC 3339 UTC timestamp")
    metadata = doc["metadata"]
    if not isinstance(metadata, dict):
        raise _Invalid("metadata is not an object")
    files = doc["files"]
    if not isinstance(files, list):
        raise _Invalid("files is not a list")
    if len(files) > MAX_ENTRIES:
        raise _Invalid(f"{len(files)} entries exceeds the limit of {MAX_ENTRIES}")
    entries = tuple(_validate_entry(i, raw) for i, raw in enumerate(files))
    check_tree(entries)
    return Manifest(created=created, metadata=metadata, files=entries)


def _validate_entry(index: int, raw: object) -> FileEntry:
    if not isinstance(raw, dict):
        raise _Invalid(f"files[{index}] is not an object")
    path = raw.get("path")
    where = f"files[{index}] ({path!r})"
    if not isinstance(path, str):
        raise _Invalid(f"{where}: path is not a string")
    normalize_path(path)
    kind = raw.get("type")
    mode = raw.get("mode")
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= MAX_MODE:
        raise _Invalid(f"{where}: mode {mode!r} is not an integer in [0, 0o7777]")
    if kind == "dir":
        if set(raw) != _DIR_KEYS:
            raise _Invalid(f"{where}: a dir entry has exactly the keys {sorted(_DIR_KEYS)}")
        return FileEntry(path=path, type="dir", mode=mode)
    if kind != "file":
        raise _Invalid(f"{where}: unsupported type {kind!r} (only 'file' and 'dir')")
    if set(raw) != _FILE_KEYS:
        raise _Invalid(f"{where}: a file entry has exactly the keys {sorted(_FILE_KEYS)}")
    size = raw["size"]
    if not _is_int(size) or size < 0:
        raise _Invalid(f"{where}: size {size!r} is not a non-negative integer")
    raw_chunks = raw["chunks"]
    if not isinstance(raw_chunks, list):
        raise _Invalid(f"{where}: chunks is not a list")
    chunks: list[Chunk] = []
    offset = 0
    for j, rc in enumerate(raw_chunks):
        chunk = _validate_chunk(f"{where} chunks[{j}]", rc)
        if chunk.offset != offset:
            raise _Invalid(f"{where} chunks[{j}]: offset {chunk.offset} is not contiguous (expected {offset})")
        offset += chunk.size
        chunks.append(chunk)
    if offset != size:
        raise _Invalid(f"{where}: chunk sizes sum to {offset}, file size is {size}")
    return FileEntry(path=path, type="file", mode=mode, size=size, chunks=tuple(chunks))


def _validate_chunk(where: str, raw: object) -> Chunk:
    if not isinstance(raw, dict):
        raise _Invalid(f"{where}: not an object")
    keys = set(raw)
    if not _CHUNK_REQUIRED <= keys <= _CHUNK_KEYS:
        raise _Invalid(f"{where}: wrong keys {sorted(keys)}")
    digest = raw["digest"]
    try:
        digest_hex(digest)
    except InvalidArgument as exc:
        raise _Invalid(f"{where}: {exc}") from None
    size, offset = raw["size"], raw["offset"]
    if not _is_int(size) or not 0 < size <= MAX_CHUNK_SIZE:
        raise _Invalid(f"{where}: size {size!r} is not an integer in [1, {MAX_CHUNK_SIZE}]")
    if not _is_int(offset) or offset < 0:
        raise _Invalid(f"{where}: offset {offset!r} is not a non-negative integer")
    encoding = raw.get("encoding", IDENTITY)
    if not isinstance(encoding, str) or encoding not in SUPPORTED_ENCODINGS:
        raise _Invalid(f"{where}: unsupported encoding {encoding!r}")
    return Chunk(digest=digest, size=size, offset=offset, encoding=encoding)


def check_tree(entries: Sequence[FileEntry]) -> None:
    """Reject duplicate paths and files that are also used as a directory."""
    seen: set[str] = set()
    files: set[str] = set()
    for entry in entries:
        if entry.path in seen:
            raise InvalidArgument(f"duplicate path {entry.path!r}")
        seen.add(entry.path)
        if entry.type == "file":
            files.add(entry.path)
    for entry in entries:
        parent = entry.path
        while "/" in parent:
            parent = parent.rsplit("/", 1)[0]
            if parent in files:
                raise InvalidArgument(f"path {entry.path!r} lies under the regular file {parent!r}")
