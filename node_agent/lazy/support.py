"""Whether this node can restore lazily: `criu check --feature uffd-noncoop`."""

from __future__ import annotations

import os
import shutil
import subprocess

CHECK = ("check", "--feature", "uffd-noncoop")


def lazy_restore_support(criu: str, timeout: float = 60.0) -> tuple[bool, str]:
    """(True, "") when CRIU and the kernel can restore lazily, else (False, why: CRIU's last line)."""
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
