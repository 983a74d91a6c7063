"""PodCheckpoint objects: a checkpoint asked for with kubectl, taken by the agent on the source pod's node."""
