"""Container checkpoint archives in and out of the store (CRI-O, Podman, checkpointctl layout).

`export_container` writes one container of a pod checkpoint as an archive
that other engines and tools read; `import_archive` takes such an archive,
node-agent's own or another engine's, as hostile input and stores it as a
pod checkpoint that `restoring.py` restores unchanged. docs/interop.md has
the layout and the rules.
"""

from node_agent.interop.common import ImportLimits
from node_agent.interop.exporting import ExportReport, compression_for, export_container
from node_agent.interop.archive_import import import_archive

__all__ = ["ExportReport", "ImportLimits", "compression_for", "export_container", "import_archive"]
