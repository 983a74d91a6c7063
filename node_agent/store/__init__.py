"""The node's content-addressed checkpoint store.

Rule: the store sees files and digests, never pods. Callers hand in a tree of
files and an opaque JSON metadata object; the store chunks, deduplicates,
verifies and publishes them, and gives them back by checkpoint id. It is
synchronous: async callers run it in worker threads.
"""

from node_agent.store.checkpoints import (
    DEFAULT_CHUNK_SIZE,
    BadBlob,
    CheckpointRecord,
    CheckpointWriter,
    FileReader,
    RecoveryReport,
    Store,
)
from node_agent.store.manifest import MEDIA_TYPE, SCHEMA_VERSION, Chunk, FileEntry

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MEDIA_TYPE",
    "SCHEMA_VERSION",
    "BadBlob",
    "CheckpointRecord",
    "CheckpointWriter",
    "Chunk",
    "FileEntry",
    "FileReader",
    "RecoveryReport",
    "Store",
]
