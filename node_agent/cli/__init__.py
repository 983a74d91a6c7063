"""The `node-agent` command line: one module per command group.

Commands that act on the daemon talk to it over the local socket
(`client.py`); `serve`, `doctor` and `containerd-config` work without one.
Errors become one clear line on stderr and a non-zero exit code here.
"""
