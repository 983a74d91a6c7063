"""The test bed: private containerd nodes on this machine, the agent on them, and pods.

End-to-end tests, benchmarks, the demo and the fault suite all stand on it.
"""
