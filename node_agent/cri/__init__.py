"""The CRI client: the only place that imports the CRI stubs.

It talks to containerd's RuntimeService and ImageService and returns plain
frozen dataclasses. Pod and container configs travel as JSON-shaped dicts
(snake_case CRI field names, as containerd's verbose status reports them).
gRPC errors become `node_agent.errors` classes here.
"""

from node_agent.cri.client import CriClient
from node_agent.cri.types import Container, ContainerDetail, Pod, PodDetail

__all__ = ["CriClient", "Container", "ContainerDetail", "Pod", "PodDetail"]
