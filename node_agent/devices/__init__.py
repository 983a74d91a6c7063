"""Device inventory, health and DRA device taints.

The chain: `sysfs` and `nvml` read the hardware into plain dataclasses
(`types`); `health` turns readings into conditions with hysteresis; `dra`
matches devices to the node's ResourceSlices; `taints` derives the
DeviceTaintRules and applies them through `kube` (a small REST client) at a
rate that `ratelimit` bounds; `monitor` runs the loop and hands complete
snapshots to the API.

Rule: nothing here imports gRPC or the agent's API stubs. Only `sysfs`,
`nvml` and `kube` do I/O, and all of it is blocking, so the monitor runs it in
threads. Hardware and API-server content is untrusted input: reads are
bounded and malformed values are skipped, never raised.
"""
