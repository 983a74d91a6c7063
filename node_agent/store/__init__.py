"""The node's checkpoint store: an OCI image layout of content-defined, compressed chunks.

Rule: the store sees files and digests, never pods. Callers hand in a tree of
files, an opaque JSON metadata object and string annotations; the store
chunks, compresses, deduplicates, verifies and publishes them as an OCI
artifact manifest, and gives them back by checkpoint id. It is synchronous
(async callers run it in worker threads) and spreads chunk work over its
own thread pools. See docs/store.md.
"""

from node_agent.store.checkpoints import DEFAULT_CHUNK_SIZE, Store
from node_agent.store.gc import GcReport, RetentionPolicy
from node_agent.store.blob_import import BlobImporter
from node_agent.store.documents import (
    CHUNK_MEDIA_TYPE,
    CHUNK_ZSTD_MEDIA_TYPE,
    CONFIG_MEDIA_TYPE,
    Chunk,
    FileEntry,
)
from node_agent.store.reading import FileReader
from node_agent.store.records import BadBlob, CheckpointRecord, RecoveryReport
from node_agent.store.writer import CheckpointWriter, WriterHooks

__all__ = [
    "CHUNK_MEDIA_TYPE",
    "CHUNK_ZSTD_MEDIA_TYPE",
    "CONFIG_MEDIA_TYPE",
    "DEFAULT_CHUNK_SIZE",
    "BadBlob",
    "BlobImporter",
    "CheckpointRecord",
    "CheckpointWriter",
    "Chunk",
    "FileEntry",
    "FileReader",
    "GcReport",
    "RecoveryReport",
    "RetentionPolicy",
    "Store",
    "WriterHooks",
]
