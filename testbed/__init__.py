"""The test bed: private containerd nodes on this machine, the agent on them, and pods.

End-to-end tests, benchmarks, the demo and the fault suite all stand on it.

Rule: the provisioning modules (cli.py and all it imports: scripts/testbed
runs them with the system python3) are standard library only, with
node_agent/containerd.py (containerd's config layout) and
criu_bridge/mountinfo.py (the mount table), which are too; bed.py, faults.py
and registry.py, which build on a running bed, may use the agent's packages.
"""
