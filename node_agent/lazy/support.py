"""Whether this node can restore lazily: one verdict, from CRIU.

A lazy restore needs CRIU's lazy-pages support and a kernel whose
userfaultfd follows the restored processes (fork, mremap, exit):
`criu check --feature uffd-noncoop` checks both, and the restorer goes by
it. `node-agent doctor` also has CRIU's feature report
(`criu_bridge.rpc.CriuClient.features`, whose `lazy_pages` asks about the
same support over RPC) and folds it into this verdict: the node has one
answer, not two.
"""

from __future__ import annotations

import os
import shutil
import subprocess

CHECK = ("check", "--feature", "uffd-noncoop")


def lazy_restore_support(criu: str, timeout: float = 60.0, *, reported: bool | None = None) -> tuple[bool, str]:
    """(True, "") when CRIU and the kernel can restore lazily, else (False, why: CRIU's last line).

    `reported`: CRIU's feature report on lazy pages, where the caller has
    one; a report that says no makes the verdict no even where the check
    passes.
    """
    ok, why = _check(criu, timeout)
    if ok and reported is False:
        return False, "CRIU's feature report has no userfaultfd lazy pages"
    return ok, why


def _check(criu: str, timeout: float) -> tuple[bool, str]:
    path = criu if os.path.isabs(criu) else shutil.which(criu)
    if not path:
        return False, f"no {criu} found"
    try:
        cp = subprocess.run([path, *CHECK], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if cp.returncode == 0:
        return True, ""
    lines = [ln for ln in (cp.stdout + cp.stderr).splitlines() if ln.strip()]
    return False, lines[-1].strip() if lines else f"exit status {cp.returncode}"
