"""A real OCI registry for tests: Debian's ``docker-registry`` (distribution 2.8) on loopback.

``Registry(workdir, ...)`` runs one registry on 127.0.0.1 with a free port and
its own filesystem root under ``workdir``, optionally with htpasswd basic auth,
TLS (a fresh CA and a server certificate for 127.0.0.1, made with the
``openssl`` CLI) or token auth (a small token server on loopback that checks
basic credentials and signs RS256 JWTs with a key whose certificate is the
registry's ``rootcertbundle``). Use it as a context manager.

With token auth the token server is, by default, on the registry's own
origin, as in most real deployments: it listens on the registry's address,
answers ``/token`` itself and forwards everything else to ``docker-registry``
on a private loopback port (TLS, when asked for, ends there). The client
asks a token realm elsewhere only when it is trusted (docs/registry.md), so
``separate_token_server=True`` puts it on a port of its own instead.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Collection, Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qs, urlsplit

from testbed.httpanswers import LoopbackServer


REGISTRY_BINARY = "/usr/bin/docker-registry"
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade",
})
SERVICE = "node-agent-test-registry"
ISSUER = "node-agent-test-issuer"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str, cwd: Path, stdin: bytes | None = None) -> bytes:
    cp = subprocess.run(["openssl", *args], cwd=cwd, input=stdin, capture_output=True, timeout=60, check=False)
    if cp.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {cp.stderr.decode(errors='replace')}")
    return cp.stdout


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


_WRITTEN = re.compile(r"http\.response\.written=(\d+)")


class Certificates:
    """A test CA, a server certificate for 127.0.0.1 and localhost, and an RSA token-signing certificate."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _openssl(
            "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=node-agent test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=directory,
        )
        _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=directory)
        (directory / "server.ext").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n"
        )
        _openssl(
            "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", "2",
            "-out", "server.pem", "-days", "2", "-extfile", "server.ext",
            cwd=directory,
        )
        self.ca_file = str(directory / "ca.pem")
        self.server_cert = str(directory / "server.pem")
        self.server_key = str(directory / "server.key")
        self._signers = 0
        self.token_cert = self.token_key = ""
        self.token_cert_der = b""
        self.new_token_signer()

    def new_token_signer(self) -> None:
        """Make a fresh RSA key and self-signed certificate for signing tokens, and use it from now on."""
        self._signers += 1
        key, cert = f"token-{self._signers}.key", f"token-{self._signers}.pem"
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
            "-days", "2", "-subj", f"/CN=node-agent test token signer {self._signers}",
            cwd=self.dir,
        )
        self.token_cert = str(self.dir / cert)
        self.token_key = str(self.dir / key)
        self.token_cert_der = ssl.PEM_cert_to_DER_cert((self.dir / cert).read_text())

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.server_cert, self.server_key)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_file)


class TokenServer:
    """The token endpoint of the distribution token spec, on 127.0.0.1.

    ``users`` maps user -> password, ``grants`` user -> the actions they may
    have on every repository (``{"pull", "push"}``); anonymous requests get a
    token with no access. ``poison`` > 0 makes that many next tokens carry a
    wrong issuer, which the registry rejects. ``issued`` lists
    ``(user, scopes)`` of every token given out, ``requests`` the target
    (path and query) and Authorization header of every request answered
    here. With ``upstream`` set (a
    port on 127.0.0.1), every request but ``/token`` is forwarded there: the
    token server is then the front of a registry, on the registry's origin.
    """

    def __init__(
        self,
        certs: Certificates,
        users: Mapping[str, str],
        grants: Mapping[str, set[str]],
        *,
        tls: bool = False,
        expires_in: int = 300,
    ) -> None:
        self.certs = certs
        self.users = dict(users)
        self.grants = {user: set(actions) for user, actions in grants.items()}
        self.expires_in = expires_in
        self.poison = 0
        self.issued: list[tuple[str, list[str]]] = []
        self.requests: list[tuple[str, str | None]] = []
        self.refused = 0
        self.upstream = 0
        self._lock = threading.Lock()
        self._server = LoopbackServer(self._respond, tls=certs if tls else None, name="test-token-server")
        self.port = self._server.port
        self.realm = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/token"

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def _respond(self, handler: BaseHTTPRequestHandler) -> None:
        """``GET /token`` (any GET without an upstream) here; everything else to the registry behind."""
        if handler.command == "GET" and (urlsplit(handler.path).path == "/token" or not self.upstream):
            self._handle(handler)
        else:
            self._forward(handler)

    def _answer(self, handler: BaseHTTPRequestHandler, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        if status == 401:
            handler.send_header("WWW-Authenticate", 'Basic realm="token"')
        handler.end_headers()
        handler.wfile.write(body)

    def _forward(self, handler: BaseHTTPRequestHandler) -> None:
        """The registry's answer to this request, read whole and passed on (bodies are small enough here)."""
        if not self.upstream:
            self._answer(handler, 404, {"error": "not found"})
            return
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=60)
        try:
            conn.request(handler.command, handler.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, answer = resp.status, resp.getheaders()
        except (OSError, http.client.HTTPException):
            self._answer(handler, 502, {"error": "the registry behind the front did not answer"})
            return
        finally:
            conn.close()
        handler.send_response(status)
        declared = str(len(data))
        for name, value in answer:
            if name.lower() == "content-length":
                declared = value
            elif name.lower() not in _HOP_BY_HOP and name.lower() not in ("server", "date"):
                handler.send_header(name, value)
        handler.send_header("Content-Length", declared if handler.command == "HEAD" else str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.requests.append((handler.path, handler.headers.get("Authorization")))
        parts = urlsplit(handler.path)
        if parts.path != "/token":
            self._answer(handler, 404, {"error": "not found"})
            return
        query = parse_qs(parts.query)
        if query.get("service") != [SERVICE]:
            self._answer(handler, 400, {"error": "unknown service"})
            return
        user = ""
        auth = handler.headers.get("Authorization", "")
        if auth:
            try:
                scheme, _, encoded = auth.partition(" ")
                name, _, password = base64.b64decode(encoded).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                scheme, name, password = "", "", ""
            if scheme != "Basic" or self.users.get(name) != password or not name:
                with self._lock:
                    self.refused += 1
                self._answer(handler, 401, {"error": "bad credentials"})
                return
            user = name
        scopes = [s for value in query.get("scope", []) for s in value.split(" ") if s]
        access: list[dict[str, object]] = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            if kind != "repository" or not name:
                continue
            allowed = sorted(set(actions.split(",")) & self.grants.get(user, set()))
            access.append({"type": "repository", "name": name, "actions": allowed})
        with self._lock:
            poisoned = self.poison > 0
            if poisoned:
                self.poison -= 1
            self.issued.append((user, scopes))
        token = self.sign(user, access, issuer="someone-else" if poisoned else ISSUER)
        self._answer(handler, 200, {"token": token, "access_token": token, "expires_in": self.expires_in})

    def sign(self, user: str, access: list[dict[str, object]], *, issuer: str = ISSUER) -> str:
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(self.certs.token_cert_der).decode()]}
        claims = {
            "iss": issuer, "sub": user, "aud": SERVICE, "exp": now + self.expires_in, "nbf": now - 10,
            "iat": now, "jti": uuid.uuid4().hex, "access": access,
        }
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = _openssl("dgst", "-sha256", "-sign", self.certs.token_key, cwd=self.certs.dir, stdin=signing_input.encode())
        return f"{signing_input}.{_b64url(signature)}"


class Registry:
    """One ``docker-registry serve`` on 127.0.0.1 with a fresh root.

    ``users`` (user -> password) turns on htpasswd basic auth, or with
    ``token=True`` token auth through a ``TokenServer`` (``grants``: user ->
    actions; everyone gets pull and push by default), on the registry's own
    origin unless ``separate_token_server``. ``tls=True`` serves HTTPS with
    a certificate from a fresh test CA (``ca_file``).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        users: Mapping[str, str] | None = None,
        tls: bool = False,
        token: bool = False,
        grants: Mapping[str, set[str]] | None = None,
        certs: Certificates | None = None,
        separate_token_server: bool = False,
        proxy: str = "",
    ) -> None:
        self.workdir = workdir
        self.proxy = proxy
        self.users = dict(users or {})
        self.tls = tls
        self.token = token
        # The token server in front of docker-registry, which then listens on a private port.
        self.fronted = token and not separate_token_server
        self.grants = dict(grants) if grants is not None else {u: {"pull", "push"} for u in self.users}
        self.root = workdir / "storage"
        self.log_path = workdir / "registry.log"
        self.certs = certs if certs is not None or not (tls or token) else Certificates(workdir / "certs")
        self.token_server: TokenServer | None = None
        self.port = 0
        self._backend_port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    # -- addresses and client settings ----------------------------------------------------

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> str:
        return self.certs.ca_file if self.certs is not None else ""

    def ref(self, rest: str) -> str:
        """``127.0.0.1:PORT/<rest>``."""
        return f"{self.host}/{rest}"

    def cpu_seconds(self) -> float:
        """The CPU time (user and system, all its threads) the running registry has used so far, from /proc."""
        assert self._proc is not None, "the registry is not running"
        with open(f"/proc/{self._proc.pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def blob_data(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (manifests are blobs too)."""
        hexpart = digest.split(":", 1)[1]
        return self.root / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexpart[:2] / hexpart / "data"

    def request(
        self,
        method: str,
        path: str,
        *,
        user: str = "",
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> tuple[int, bytes]:
        """A raw request to the registry (basic auth or a token for ``user``, who gets every action)."""
        send = dict(headers or {})
        if user and self.token_server is not None:
            name = path.split("/v2/", 1)[1].rsplit("/blobs/", 1)[0].rsplit("/manifests/", 1)[0]
            access: list[dict[str, object]] = [{"type": "repository", "name": name, "actions": ["pull", "push", "delete", "*"]}]
            send["Authorization"] = "Bearer " + self.token_server.sign(user, access)
        elif user:
            raw = f"{user}:{self.users[user]}".encode()
            send["Authorization"] = "Basic " + base64.b64encode(raw).decode()
        conn = self._connection()
        try:
            conn.request(method, path, body=body, headers=send)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _connection(self, *, backend: bool = False) -> http.client.HTTPConnection:
        if backend and self.fronted:
            return http.client.HTTPConnection("127.0.0.1", self._backend_port, timeout=10)
        if self.tls:
            assert self.certs is not None
            return http.client.HTTPSConnection("127.0.0.1", self.port, timeout=10, context=self.certs.client_context())
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    # -- life cycle ---------------------------------------------------------------------

    def __enter__(self) -> Registry:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _config(self) -> dict[str, object]:
        http_section: dict[str, object] = {"addr": f"127.0.0.1:{self._backend_port}", "secret": uuid.uuid4().hex}
        if self.fronted:
            http_section["relativeurls"] = True  # Locations that hold behind the front (and its TLS)
        elif self.tls:
            assert self.certs is not None
            http_section["tls"] = {"certificate": self.certs.server_cert, "key": self.certs.server_key}
        config: dict[str, object] = {
            "version": 0.1,
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.root)},
                "delete": {"enabled": True},
                "maintenance": {"uploadpurging": {"enabled": False}},
            },
            "http": http_section,
            "health": {"storagedriver": {"enabled": False}},
        }
        if self.proxy:
            # A pull-through cache of another registry (distribution's proxy mode): read-only, it fetches
            # what it lacks from `remoteurl` and keeps it.
            config["proxy"] = {"remoteurl": self.proxy}
        if self.token:
            assert self.token_server is not None and self.certs is not None
            config["auth"] = {
                "token": {
                    "realm": self.token_server.realm,
                    "service": SERVICE,
                    "issuer": ISSUER,
                    "rootcertbundle": self.certs.token_cert,
                }
            }
        elif self.users:
            import bcrypt

            lines = [
                f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4, prefix=b'2a')).decode()}\n"
                for user, password in self.users.items()
            ]
            htpasswd = self.workdir / "htpasswd"
            htpasswd.write_text("".join(lines))
            config["auth"] = {"htpasswd": {"realm": "node-agent-test", "path": str(htpasswd)}}
        return config

    def kill(self) -> None:
        """SIGKILL docker-registry, as a registry that dies mid-transfer; ``restart`` brings it back."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def restart(self) -> None:
        """Start docker-registry again after ``kill``: the same port, the same storage."""
        self._launch()
        if not self._wait_ready():
            self.stop()
            raise RuntimeError(f"docker-registry did not restart; its log:\n{self.log_tail()}")

    def rotate_token_key(self) -> None:
        """Restart the registry (same port, same storage) trusting only a new token-signing key.

        Tokens issued before are rejected from then on, as after a key rotation.
        """
        assert self.certs is not None and self.token_server is not None
        self._terminate()
        self.certs.new_token_signer()
        self._launch()
        if not self._wait_ready():
            self.stop()
            raise RuntimeError(f"docker-registry did not restart; its log:\n{self.log_tail()}")

    def _launch(self) -> None:
        config_path = self.workdir / "config.yml"
        # JSON is YAML: no YAML writer needed.
        config_path.write_text(json.dumps(self._config(), indent=2))
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [REGISTRY_BINARY, "serve", str(config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(exist_ok=True)
        if self.token:
            assert self.certs is not None
            self.token_server = TokenServer(self.certs, self.users, self.grants, tls=self.tls)
            self.token_server.start()
        for _ in range(5):
            self._backend_port = _free_port()
            self.port = self._backend_port
            if self.fronted:
                assert self.token_server is not None
                self.token_server.upstream = self._backend_port
                self.port = self.token_server.port
            self._launch()
            if self._wait_ready():
                return
            self._terminate()
            if "address already in use" not in self.log_path.read_text(errors="replace"):
                break
        self.stop()
        raise RuntimeError(f"docker-registry did not start; its log:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                return False
            try:
                conn = self._connection(backend=True)
                try:
                    conn.request("GET", "/v2/")
                    conn.getresponse().read()
                    return True
                finally:
                    conn.close()
            except (OSError, http.client.HTTPException):
                time.sleep(0.05)
        return False

    def manifest_blobs(self, repository: str, reference: str) -> dict[str, int]:
        """The blobs an OCI manifest here lists (its config, then its layers), by digest, with their sizes."""
        status, body = self.request("GET", f"/v2/{repository}/manifests/{reference}",
                                    headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        if status != 200:
            raise AssertionError(f"manifest {repository}:{reference}: HTTP {status}")
        manifest = json.loads(body)
        return {str(d["digest"]): int(d["size"]) for d in [manifest["config"], *manifest["layers"]]}

    def blob_bytes_served(self, digests: Collection[str] | None = None) -> int:
        """Bytes of blob bodies this registry has sent so far (GET .../blobs/...; of ``digests`` only, when
        given), from its log."""
        total = 0
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return 0
        for line in lines:
            if "response completed" not in line or 'http.request.method=GET' not in line or "/blobs/" not in line:
                continue
            if digests is not None and not any(f"/blobs/{d}" in line for d in digests):
                continue
            written = _WRITTEN.search(line)
            if written:
                total += int(written.group(1))
        return total

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def stop(self) -> None:
        self._terminate()
        if self.token_server is not None:
            self.token_server.stop()
            self.token_server = None
