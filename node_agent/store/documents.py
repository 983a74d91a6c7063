"""The store's documents: the OCI index, checkpoint manifests and their config blobs.

Rule: a document is data, never trusted. Everything read from disk or handed
in by an importer goes through ``decode_index``, ``decode_manifest`` and
``decode_config``, which check the schema, the types, every path (relative,
normalized, no ``..``, no duplicates, no file used as a directory), every
chunk list (contiguous offsets summing to the file size, well-formed
digests, consistent sizes and encodings) and the size bounds; and through
``check_layers``, which ties a manifest's layers to its config's file table.
Encoding is canonical JSON, so the same content always gives the same bytes.
Descriptors, digests and the OCI media types are ``node_agent.oci``'s. This
module does no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal

from node_agent import strictjson
from node_agent.errors import DataLoss, InvalidArgument
from node_agent.names import KEY_ID_RE
from node_agent.oci import (
    ARTIFACT_TYPE,
    DESCRIPTOR_KEYS,
    EMPTY_DESCRIPTOR,
    MAX_MANIFEST_BYTES,
    OCI_INDEX_MEDIA_TYPE,
    OCI_MANIFEST_MEDIA_TYPE,
    Descriptor,
    DescriptorError,
    DocumentError,
    canonical_json,
    digest_hex,
    read_index,
    read_manifest,
)

# -- media types and names ----------------------------------------------------------------

OCI_LAYOUT_VERSION: Final = "1.0.0"
CONFIG_MEDIA_TYPE: Final = "application/vnd.node-agent.checkpoint.config.v1+json"
CHUNK_MEDIA_TYPE: Final = "application/vnd.node-agent.chunk.v1"
CHUNK_ZSTD_MEDIA_TYPE: Final = "application/vnd.node-agent.chunk.v1+zstd"
# Sealed (encrypted) chunks and config blobs: store/sealing.py. One media type
# for every sealed chunk, compressed or not: the encoding is in the sealed config.
CHUNK_SEALED_MEDIA_TYPE: Final = "application/vnd.node-agent.chunk.v1+encrypted"
CONFIG_SEALED_MEDIA_TYPE: Final = "application/vnd.node-agent.checkpoint.config.v1+json+encrypted"
# The key id a sealed checkpoint's blobs are sealed under (also in each blob's header).
KEY_ID_ANNOTATION: Final = "io.node-agent.key-id"
CREATED_ANNOTATION: Final = "org.opencontainers.image.created"

IDENTITY: Final = "identity"
ZSTD: Final = "zstd"
SEALED: Final = "sealed"
SEALED_ZSTD: Final = "sealed+zstd"
SUPPORTED_ENCODINGS: Final = frozenset({IDENTITY, ZSTD, SEALED, SEALED_ZSTD})
SEALED_ENCODINGS: Final = MappingProxyType({IDENTITY: SEALED, ZSTD: SEALED_ZSTD})
CHUNK_MEDIA_TYPES: Final = MappingProxyType({IDENTITY: CHUNK_MEDIA_TYPE, ZSTD: CHUNK_ZSTD_MEDIA_TYPE,
                                             SEALED: CHUNK_SEALED_MEDIA_TYPE, SEALED_ZSTD: CHUNK_SEALED_MEDIA_TYPE})
CONFIG_MEDIA_TYPES: Final = frozenset({CONFIG_MEDIA_TYPE, CONFIG_SEALED_MEDIA_TYPE})

# -- bounds --------------------------------------------------------------------------------

MAX_CONFIG_BYTES: Final = 64 << 20
MAX_INDEX_BYTES: Final = 64 << 20
MAX_ENTRIES: Final = 1_000_000
MAX_INDEX_ENTRIES: Final = 1_000_000
MAX_CHUNK_SIZE: Final = 16 << 20
MAX_STORED_CHUNK_SIZE: Final = MAX_CHUNK_SIZE + (1 << 20)
MAX_BLOB_SIZE: Final = max(MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES, MAX_STORED_CHUNK_SIZE)
MAX_PATH_BYTES: Final = 4096
MAX_NAME_BYTES: Final = 255
MAX_MODE: Final = 0o7777
MAX_ANNOTATIONS: Final = 1024
MAX_ANNOTATION_BYTES: Final = 64 << 10

_CREATED_RE: Final = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?Z")
_MANIFEST_KEYS: Final = frozenset({"schemaVersion", "mediaType", "artifactType", "config", "layers", "annotations"})
_CONFIG_KEYS: Final = frozenset({"metadata", "files"})
_FILE_KEYS: Final = frozenset({"path", "type", "mode", "size", "chunks"})
_DIR_KEYS: Final = frozenset({"path", "type", "mode"})
_CHUNK_KEYS: Final = frozenset({"digest", "offset", "size", "stored_size", "encoding"})
_SEALED_CHUNK_KEYS: Final = _CHUNK_KEYS | {"plain"}
_INDEX_KEYS: Final = frozenset({"schemaVersion", "mediaType", "manifests", "annotations", "artifactType", "subject"})

EntryType = Literal["file", "dir"]


# -- values ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """A byte range ``[offset, offset + size)`` of a file, stored as one blob.

    ``digest`` and ``stored_size`` describe the stored bytes (compressed when
    ``encoding`` is ``"zstd"``, sealed and perhaps compressed when it is
    ``"sealed"`` or ``"sealed+zstd"``); ``size`` is the uncompressed length.
    ``plain`` is a sealed chunk's plaintext digest (kept in the sealed
    config only; its key derives from it).
    """

    digest: str
    size: int
    offset: int
    encoding: str = IDENTITY
    stored_size: int = -1
    plain: str = ""

    @property
    def sealed(self) -> bool:
        """Whether the blob is sealed (store/sealing.py)."""
        return self.encoding in (SEALED, SEALED_ZSTD)

    @property
    def inner_encoding(self) -> str:
        """How the bytes inside the seal are encoded: identity or zstd."""
        return ZSTD if self.encoding in (ZSTD, SEALED_ZSTD) else IDENTITY

    def __post_init__(self) -> None:
        if self.stored_size < 0:
            if self.encoding != IDENTITY:
                raise InvalidArgument(f"chunk {self.digest}: a {self.encoding} chunk needs its stored size")
            object.__setattr__(self, "stored_size", self.size)

    @property
    def media_type(self) -> str:
        """The layer media type of the chunk's blob."""
        return CHUNK_MEDIA_TYPES[self.encoding]

    def to_json(self) -> dict[str, Any]:
        """The chunk's record in the config's file table."""
        out = {"digest": self.digest, "offset": self.offset, "size": self.size, "stored_size": self.stored_size,
               "encoding": self.encoding}
        return {**out, "plain": self.plain} if self.sealed else out


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
        """The entry's record in the config's file table."""
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
class CheckpointConfig:
    """A decoded, validated config blob: the caller's metadata and the file table."""

    metadata: Mapping[str, Any]
    files: tuple[FileEntry, ...]


@dataclass(frozen=True)
class CheckpointManifest:
    """A decoded, validated checkpoint manifest."""

    config: Descriptor
    layers: tuple[Descriptor, ...]
    annotations: Mapping[str, str]

    @property
    def created(self) -> str:
        """The RFC 3339 creation time (from the ``org.opencontainers.image.created`` annotation)."""
        return self.annotations[CREATED_ANNOTATION]

    @property
    def key_id(self) -> str:
        """The key a sealed checkpoint's blobs are sealed under; "" when it is not sealed."""
        return self.annotations[KEY_ID_ANNOTATION] if self.config.media_type == CONFIG_SEALED_MEDIA_TYPE else ""


# -- small helpers ----------------------------------------------------------------------------


def is_created(value: object) -> bool:
    """Whether ``value`` is an RFC 3339 UTC timestamp as the store writes them."""
    return isinstance(value, str) and _CREATED_RE.fullmatch(value) is not None


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


def check_annotations(annotations: object) -> dict[str, str]:
    """Validate a string-to-string annotation map; InvalidArgument otherwise."""
    if not isinstance(annotations, Mapping):
        raise InvalidArgument("annotations must be a mapping of strings to strings")
    if len(annotations) > MAX_ANNOTATIONS:
        raise InvalidArgument(f"{len(annotations)} annotations exceeds the limit of {MAX_ANNOTATIONS}")
    out: dict[str, str] = {}
    for key, value in annotations.items():
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise InvalidArgument(f"annotation {key!r}: keys must be non-empty strings and values strings")
        if len(key) + len(value) > MAX_ANNOTATION_BYTES:
            raise InvalidArgument(f"annotation {key!r} is longer than {MAX_ANNOTATION_BYTES} characters")
        out[key] = value
    return out


# -- encoding ----------------------------------------------------------------------------------


def encode_config(metadata: Mapping[str, Any], files: Sequence[FileEntry]) -> bytes:
    """Canonical bytes of a config blob."""
    doc = {"metadata": dict(metadata), "files": [f.to_json() for f in files]}
    try:
        return canonical_json(doc)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"metadata is not a JSON object: {exc}") from exc


def layers_for(files: Sequence[FileEntry]) -> tuple[Descriptor, ...]:
    """The layer list of a file table: one descriptor per distinct chunk blob, in order of first use.

    A checkpoint without chunks has the single empty descriptor, as OCI
    artifacts without content should.
    """
    seen: set[str] = set()
    layers: list[Descriptor] = []
    for entry in files:
        for chunk in entry.chunks:
            if chunk.digest not in seen:
                seen.add(chunk.digest)
                layers.append(Descriptor(chunk.media_type, chunk.digest, chunk.stored_size))
    return tuple(layers) if layers else (EMPTY_DESCRIPTOR,)


def encode_manifest(config: Descriptor, layers: Sequence[Descriptor], annotations: Mapping[str, str]) -> bytes:
    """Canonical bytes of a checkpoint manifest."""
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": config.to_json(),
        "layers": [layer.to_json() for layer in layers],
        "annotations": dict(annotations),
    }
    return canonical_json(doc)


def index_entry(manifest_digest: str, manifest_size: int, annotations: Mapping[str, str]) -> dict[str, Any]:
    """The index.json record of a published checkpoint manifest."""
    return {
        "mediaType": OCI_MANIFEST_MEDIA_TYPE,
        "digest": manifest_digest,
        "size": manifest_size,
        "artifactType": ARTIFACT_TYPE,
        "annotations": dict(annotations),
    }


def encode_index(entries: Sequence[Mapping[str, Any]]) -> bytes:
    """Canonical bytes of an OCI image index listing ``entries``."""
    return canonical_json({"schemaVersion": 2, "mediaType": OCI_INDEX_MEDIA_TYPE, "manifests": [dict(e) for e in entries]})


def oci_layout() -> bytes:
    """Bytes of the ``oci-layout`` marker file."""
    return canonical_json({"imageLayoutVersion": OCI_LAYOUT_VERSION})


# -- decoding ----------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Invalid(Exception):
    """Internal: a validation failure, turned into the caller's error class."""


def parse_json(data: bytes, limit: int, *, error: type[Exception], what: str) -> Any:
    """Parse bounded, strict JSON: UTF-8, no duplicate keys, no NaN; ``error`` otherwise."""
    if len(data) > limit:
        raise error(f"{what}: {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        return strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise error(f"{what} {exc}") from exc


def decode_config(data: bytes, *, error: type[Exception] = DataLoss, what: str = "config") -> CheckpointConfig:
    """Parse and validate config blob bytes.

    ``error`` is the class raised on any problem (DataLoss for stored
    blobs, InvalidArgument for caller input); ``what`` names the blob in
    messages.
    """
    doc = parse_json(data, MAX_CONFIG_BYTES, error=error, what=what)
    try:
        return _validate_config(doc)
    except (_Invalid, InvalidArgument) as exc:
        raise error(f"{what}: {exc}") from exc


def decode_manifest(data: bytes, *, error: type[Exception] = DataLoss, what: str = "manifest") -> CheckpointManifest:
    """Parse and validate checkpoint manifest bytes (see ``decode_config`` for the arguments)."""
    doc = parse_json(data, MAX_MANIFEST_BYTES, error=error, what=what)
    try:
        return _validate_manifest(doc)
    except (_Invalid, InvalidArgument) as exc:
        raise error(f"{what}: {exc}") from exc


def decode_index(data: bytes, *, error: type[Exception] = DataLoss, what: str = "index.json") -> list[dict[str, Any]]:
    """Parse and validate an OCI image index; return its manifest records.

    Records of other kinds (images, indexes, other artifacts) are kept as
    they are, so a rewrite of the index preserves them; each must still be a
    descriptor with a well-formed digest and size.
    """
    doc = parse_json(data, MAX_INDEX_BYTES, error=error, what=what)
    try:
        try:
            manifests = read_index(doc, allowed=_INDEX_KEYS, strict_version=True, max_entries=MAX_INDEX_ENTRIES)
        except DocumentError as exc:
            raise _Invalid(_index_fault(exc)) from None
        seen: set[str] = set()
        for i, raw in enumerate(manifests):
            if is_checkpoint_entry(raw):
                if raw["digest"] in seen:
                    raise _Invalid(f"manifests[{i}]: checkpoint {raw['digest']} is listed twice")
                seen.add(raw["digest"])
                if raw.get("mediaType") != OCI_MANIFEST_MEDIA_TYPE:
                    raise _Invalid(f"manifests[{i}]: a checkpoint must be an OCI image manifest")
                check_annotations(raw.get("annotations", {}))
        return manifests
    except (_Invalid, InvalidArgument) as exc:
        raise error(f"{what}: {exc}") from exc


def _index_fault(exc: DocumentError) -> str:
    """The index reader's complaint in the store's words."""
    if exc.field == "keys":
        return f"unexpected keys {exc.value[1]}" if isinstance(exc.value, tuple) else exc.detail
    if exc.descriptor is not None and exc.descriptor.field == "object":
        return f"{exc.where} is not an object"
    if exc.descriptor is not None:
        return _descriptor_fault(exc.where, exc.descriptor, exact=False)
    return exc.detail


def is_checkpoint_entry(raw: Mapping[str, Any]) -> bool:
    """Whether an index record names a checkpoint manifest of this store."""
    return raw.get("artifactType") == ARTIFACT_TYPE


def _descriptor_fault(where: str, exc: DescriptorError, *, exact: bool = True) -> str:
    """A descriptor the reader refused, in the store's words."""
    detail = exc.detail
    if exc.field == "keys" and exact:
        detail = f"a descriptor has exactly the keys {sorted(DESCRIPTOR_KEYS)}, not {exc.value}"
    elif exc.field == "keys":
        detail = f"a descriptor needs the keys {sorted(DESCRIPTOR_KEYS)}"
    elif exc.field == "size":
        detail += " is not a non-negative integer"
    return f"{where}: {detail}"


def _validate_manifest(doc: object) -> CheckpointManifest:
    try:
        read = read_manifest(doc, required=_MANIFEST_KEYS, allowed=_MANIFEST_KEYS, strict_version=True,
                             artifact_type=lambda kind: kind == ARTIFACT_TYPE)
    except DocumentError as exc:
        raise _Invalid(_descriptor_fault(exc.where, exc.descriptor) if exc.descriptor is not None else exc.detail) from None
    config = read.config
    if config.media_type not in CONFIG_MEDIA_TYPES:
        raise _Invalid(f"config: unsupported mediaType {config.media_type!r}")
    if config.size > MAX_CONFIG_BYTES:
        raise _Invalid(f"config: {config.size} bytes exceeds the {MAX_CONFIG_BYTES}-byte limit")
    if not read.layers:
        raise _Invalid("layers is not a non-empty list")
    try:
        annotations = check_annotations(read.annotations)
    except InvalidArgument as exc:
        raise _Invalid(str(exc)) from None
    if not is_created(annotations.get(CREATED_ANNOTATION)):
        raise _Invalid(f"annotation {CREATED_ANNOTATION} is missing or not an RFC 3339 UTC timestamp")
    if config.media_type == CONFIG_SEALED_MEDIA_TYPE and not KEY_ID_RE.fullmatch(annotations.get(KEY_ID_ANNOTATION, "")):
        raise _Invalid(f"a sealed checkpoint needs the annotation {KEY_ID_ANNOTATION} (a key id)")
    return CheckpointManifest(config=config, layers=read.layers, annotations=MappingProxyType(annotations))


def check_layers(manifest: CheckpointManifest, config: CheckpointConfig) -> None:
    """Require the manifest's layers to be exactly the config's distinct chunk blobs, in order.

    A sealed checkpoint's chunks are all sealed, and an unsealed one's none.
    """
    sealed = manifest.config.media_type == CONFIG_SEALED_MEDIA_TYPE
    for entry in config.files:
        for chunk in entry.chunks:
            if chunk.sealed != sealed:
                state = "sealed" if sealed else "not sealed"
                raise _Invalid(f"{entry.path}: chunk at {chunk.offset} is {chunk.encoding}, the checkpoint is {state}")
    want = layers_for(config.files)
    if manifest.layers != want:
        if len(manifest.layers) != len(want):
            raise _Invalid(f"manifest lists {len(manifest.layers)} layers, the file table uses {len(want)} blobs")
        for i, (got, exp) in enumerate(zip(manifest.layers, want, strict=True)):
            if got != exp:
                raise _Invalid(f"layers[{i}] is {got.to_json()}, the file table says {exp.to_json()}")


def check_manifest_matches(
    manifest: CheckpointManifest, config: CheckpointConfig, *, error: type[Exception], what: str
) -> None:
    """``check_layers`` raising ``error`` (DataLoss for stored data, InvalidArgument for imports)."""
    try:
        check_layers(manifest, config)
    except _Invalid as exc:
        raise error(f"{what}: {exc}") from exc


def _validate_config(doc: object) -> CheckpointConfig:
    if not isinstance(doc, dict):
        raise _Invalid("top level is not an object")
    keys = set(doc)
    if keys != _CONFIG_KEYS:
        missing, extra = sorted(_CONFIG_KEYS - keys), sorted(keys - _CONFIG_KEYS)
        raise _Invalid(f"wrong top-level keys (missing {missing}, unexpected {extra})")
    metadata = doc["metadata"]
    if not isinstance(metadata, dict):
        raise _Invalid("metadata is not an object")
    files = doc["files"]
    if not isinstance(files, list):
        raise _Invalid("files is not a list")
    if len(files) > MAX_ENTRIES:
        raise _Invalid(f"{len(files)} entries exceeds the limit of {MAX_ENTRIES}")
    blobs: dict[str, tuple[int, int, str, str]] = {}
    entries = tuple(_validate_entry(i, raw, blobs) for i, raw in enumerate(files))
    check_tree(entries)
    return CheckpointConfig(metadata=MappingProxyType(metadata), files=entries)


def _validate_entry(index: int, raw: object, blobs: dict[str, tuple[int, int, str, str]]) -> FileEntry:
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
        shape = (chunk.size, chunk.stored_size, chunk.encoding, chunk.plain)
        if blobs.setdefault(chunk.digest, shape) != shape:
            raise _Invalid(f"{where} chunks[{j}]: blob {chunk.digest} is used with different sizes or encodings")
        offset += chunk.size
        chunks.append(chunk)
    if offset != size:
        raise _Invalid(f"{where}: chunk sizes sum to {offset}, file size is {size}")
    return FileEntry(path=path, type="file", mode=mode, size=size, chunks=tuple(chunks))


def _validate_chunk(where: str, raw: object) -> Chunk:
    if not isinstance(raw, dict):
        raise _Invalid(f"{where}: not an object")
    keys = _SEALED_CHUNK_KEYS if raw.get("encoding") in (SEALED, SEALED_ZSTD) else _CHUNK_KEYS
    if set(raw) != keys:
        raise _Invalid(f"{where}: a chunk has exactly the keys {sorted(keys)}, not {sorted(raw)}")
    digest = raw["digest"]
    try:
        digest_hex(digest)
    except InvalidArgument as exc:
        raise _Invalid(f"{where}: {exc}") from None
    size, offset, stored, encoding = raw["size"], raw["offset"], raw["stored_size"], raw["encoding"]
    if not _is_int(size) or not 0 < size <= MAX_CHUNK_SIZE:
        raise _Invalid(f"{where}: size {size!r} is not an integer in [1, {MAX_CHUNK_SIZE}]")
    if not _is_int(offset) or offset < 0:
        raise _Invalid(f"{where}: offset {offset!r} is not a non-negative integer")
    if not isinstance(encoding, str) or encoding not in SUPPORTED_ENCODINGS:
        raise _Invalid(f"{where}: unsupported encoding {encoding!r}")
    if not _is_int(stored) or not 0 < stored <= MAX_STORED_CHUNK_SIZE:
        raise _Invalid(f"{where}: stored_size {stored!r} is not an integer in [1, {MAX_STORED_CHUNK_SIZE}]")
    if encoding == IDENTITY and stored != size:
        raise _Invalid(f"{where}: an identity chunk's stored_size {stored} differs from its size {size}")
    if encoding == SEALED and stored <= size:
        raise _Invalid(f"{where}: a sealed chunk's stored_size {stored} is not above its size {size}")
    plain = raw.get("plain", "")
    try:
        digest_hex(plain) if plain else None
    except InvalidArgument as exc:
        raise _Invalid(f"{where}: plain: {exc}") from None
    return Chunk(digest=digest, size=size, offset=offset, encoding=encoding, stored_size=stored, plain=plain)


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


ChunkFetch = Callable[[Chunk], "bytes | None"]
"""``fetch(chunk)``: bring a chunk's blob that is not in the store yet from where it still is, verified, into the
store; it returns the blob's stored bytes when it has them at hand (None: read them from the store), so that a
reader need not read and hash again what was just fetched and verified."""
