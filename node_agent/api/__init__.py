"""gRPC edges: the servicers are the only importers of the agent's API stubs.

They turn requests into dataclasses, call `checkpointing`/`restoring`/the
store, and map `node_agent.errors` to status codes in exactly one place.
"""
