"""Name rules shared across layers: what a key id (a key domain's name) and an environment variable name look like.

The config (domain names), the store (a sealed blob's key id) and the
keyring (key ids) all check names against these, so that one rule holds
everywhere. Standard library only; the bottom layer.
"""

from __future__ import annotations

import re
from typing import Final

# A key id, and a key domain's name: what the store records for sealed data.
KEY_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# An environment variable name (what a key plugin may be passed).
ENV_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
