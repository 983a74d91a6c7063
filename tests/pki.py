"""Test certificates for the mutual-TLS listener, made with the ``openssl`` CLI.

``Pki(directory)`` makes a CA; ``server()`` and ``client()`` issue leaf
certificates from it (a fresh serial each time, so a renewed certificate is
told apart by its fingerprint). ``Pki(other_directory)`` is an unrelated CA.
"""

from __future__ import annotations

import itertools
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> bytes:
    cp = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, timeout=60, check=False)
    if cp.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {cp.stderr.decode(errors='replace')}")
    return cp.stdout


@dataclass(frozen=True)
class Leaf:
    cert: str
    key: str

    def pem(self) -> tuple[bytes, bytes]:
        return Path(self.key).read_bytes(), Path(self.cert).read_bytes()


class Pki:
    def __init__(self, directory: Path, name: str = "node-agent test CA") -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=directory,
        )
        self.ca = str(directory / "ca.pem")
        self._serial = itertools.count(100)

    def ca_pem(self) -> bytes:
        return Path(self.ca).read_bytes()

    def _issue(self, stem: str, subject: str, ext: list[str]) -> Leaf:
        serial = next(self._serial)
        _openssl("req", *_EC, "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj", subject, cwd=self.dir)
        (self.dir / f"{stem}.ext").write_text("\n".join(ext) + "\n")
        _openssl(
            "x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", str(serial),
            "-out", f"{stem}.pem", "-days", "2", "-extfile", f"{stem}.ext",
            cwd=self.dir,
        )
        return Leaf(str(self.dir / f"{stem}.pem"), str(self.dir / f"{stem}.key"))

    def server(self, stem: str = "server") -> Leaf:
        return self._issue(stem, "/CN=node-agent", [
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature",
            "extendedKeyUsage=serverAuth",
        ])

    def client(self, stem: str, cn: str, *sans: str) -> Leaf:
        ext = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature", "extendedKeyUsage=clientAuth"]
        if sans:
            ext.insert(0, "subjectAltName=" + ",".join(sans))
        return self._issue(stem, f"/CN={cn}", ext)
