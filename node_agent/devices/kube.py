"""A small Kubernetes REST client on the standard library (http.client, TLS from ``node_agent.tls``).

Credentials come from a kubeconfig (its current context: server, CA,
bearer token or token file, client certificate) or from the in-cluster
service account. Only what the device taints need: list ResourceSlices by
node, and list, create, replace and delete DeviceTaintRules
(resource.k8s.io/v1). HTTP statuses become the agent's errors here.
Blocking; callers run it in a thread with a deadline.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, Mapping

from node_agent import errors, tls

API = "/apis/resource.k8s.io/v1"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_BODY = 32 << 20
PAGE = 500


@dataclass(frozen=True)
class Credentials:
    server: str  # https://host:port (http:// for a local proxy)
    ca_file: str = ""
    ca_data: bytes = b""
    insecure: bool = False
    token: str = ""
    token_file: str = ""  # re-read on every request (projected tokens rotate)
    cert_file: str = ""
    key_file: str = ""
    cert_data: bytes = b""
    key_data: bytes = b""


def in_cluster(env: Mapping[str, str] = os.environ, sa_dir: str = SA_DIR) -> Credentials | None:
    """The pod's service account, when the agent runs in a pod that has one."""
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    token = os.path.join(sa_dir, "token")
    if not host or not port or not os.path.exists(token):
        return None
    if ":" in host:
        host = f"[{host}]"
    return Credentials(server=f"https://{host}:{port}", ca_file=os.path.join(sa_dir, "ca.crt"), token_file=token)


def _b64(value: Any, what: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError as exc:
        raise errors.InvalidArgument(f"kubeconfig: {what} is not base64") from exc


def from_kubeconfig(path: str, context: str = "") -> Credentials:
    """The credentials of a kubeconfig's current (or named) context."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh.read(1 << 20))
    except OSError as exc:
        raise errors.FailedPrecondition(f"cannot read kubeconfig {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise errors.InvalidArgument(f"kubeconfig {path} is not valid YAML") from exc
    if not isinstance(doc, Mapping):
        raise errors.InvalidArgument(f"kubeconfig {path} is not a mapping")
    base = os.path.dirname(os.path.abspath(path))

    def named(section: str, name: str) -> Mapping[str, Any]:
        for item in doc.get(section) or []:
            if isinstance(item, Mapping) and item.get("name") == name:
                inner = item.get(section[:-1])
                if isinstance(inner, Mapping):
                    return inner
        raise errors.InvalidArgument(f"kubeconfig {path}: no {section[:-1]} named {name!r}")

    ctx = named("contexts", context or str(doc.get("current-context") or ""))
    cluster = named("clusters", str(ctx.get("cluster") or ""))
    user = named("users", str(ctx.get("user") or "")) if ctx.get("user") else {}

    def file(v: Any) -> str:
        return os.path.join(base, str(v)) if v else ""

    server = str(cluster.get("server") or "")
    if not server.startswith(("https://", "http://")):
        raise errors.InvalidArgument(f"kubeconfig {path}: cluster server {server!r} is not an http(s) URL")
    return Credentials(
        server=server.rstrip("/"),
        ca_file=file(cluster.get("certificate-authority")),
        ca_data=_b64(cluster["certificate-authority-data"], "certificate-authority-data")
        if cluster.get("certificate-authority-data") else b"",
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=str(user.get("token") or ""),
        token_file=file(user.get("tokenFile")),
        cert_file=file(user.get("client-certificate")),
        key_file=file(user.get("client-key")),
        cert_data=_b64(user["client-certificate-data"], "client-certificate-data")
        if user.get("client-certificate-data") else b"",
        key_data=_b64(user["client-key-data"], "client-key-data") if user.get("client-key-data") else b"",
    )


def _status_error(status: int, method: str, path: str, body: Any) -> errors.AgentError:
    message = body.get("message") if isinstance(body, Mapping) else None
    text = f"{method} {path}: HTTP {status}" + (f": {str(message)[:300]}" if message else "")
    cls: type[errors.AgentError] = {
        400: errors.InvalidArgument, 401: errors.Unauthenticated, 403: errors.PermissionDenied,
        404: errors.NotFound, 409: errors.AlreadyExists, 410: errors.Aborted, 422: errors.InvalidArgument,
        429: errors.ResourceExhausted,
    }.get(status, errors.Unavailable if status >= 500 else errors.Internal)
    if status == 409 and isinstance(body, Mapping) and body.get("reason") == "Conflict":
        cls = errors.Aborted
    return cls(text)


class KubeClient:
    """Blocking calls to one API server, one connection per request."""

    def __init__(self, creds: Credentials, timeout: float = 10.0) -> None:
        self.creds = creds
        self.timeout = timeout
        url = urllib.parse.urlsplit(creds.server)
        self.tls = url.scheme == "https"
        self.host = url.hostname or ""
        self.port = url.port or (443 if self.tls else 80)
        self.prefix = url.path.rstrip("/")
        trust = tls.Trust(
            ca_file=creds.ca_file, ca_pem=creds.ca_data.decode("ascii", "replace"), insecure=creds.insecure,
            cert_file=creds.cert_file, key_file=creds.key_file, cert_pem=creds.cert_data, key_pem=creds.key_data,
        )
        try:
            self.context = tls.client_context(trust, "API server") if self.tls else None
        except tls.TrustError as exc:
            raise errors.FailedPrecondition(f"TLS settings for {creds.server} are unusable: {exc.reason}") from exc.reason

    def _token(self) -> str:
        if self.creds.token:
            return self.creds.token
        if self.creds.token_file:
            try:
                with open(self.creds.token_file, encoding="utf-8") as fh:
                    return fh.read(64 << 10).strip()
            except OSError as exc:
                raise errors.Unauthenticated(f"cannot read token {self.creds.token_file}: {exc.strerror}") from exc
        return ""

    def request(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None) -> Any:
        """One call; the decoded JSON answer. Errors are the agent's, by HTTP status."""
        target = self.prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json", "User-Agent": "node-agent"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        conn: http.client.HTTPConnection
        if self.tls:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.context)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, target, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read(MAX_BODY + 1)
            status = resp.status
        except socket.timeout as exc:
            raise errors.DeadlineExceeded(f"{method} {path}: no answer from {self.creds.server} in {self.timeout:g}s") from exc
        except ssl.SSLError as exc:
            raise tls.failure(exc, f"{method} {path}", self.creds.server, verbatim=True) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise errors.Unavailable(f"{method} {path}: cannot reach {self.creds.server}: {exc}") from exc
        finally:
            conn.close()
        if len(raw) > MAX_BODY:
            raise errors.ResourceExhausted(f"{method} {path}: answer larger than {MAX_BODY} bytes")
        try:
            decoded = json.loads(raw) if raw else {}
        except ValueError:
            decoded = {}
        if not 200 <= status < 300:
            raise _status_error(status, method, path, decoded)
        return decoded

    def _list(self, path: str, query: dict[str, str]) -> list[Any]:
        items: list[Any] = []
        token = ""
        for _ in range(1000):
            q = dict(query, limit=str(PAGE))
            if token:
                q["continue"] = token
            page = self.request("GET", path, query=q)
            got = page.get("items") if isinstance(page, Mapping) else None
            items += got if isinstance(got, list) else []
            meta = page.get("metadata") if isinstance(page, Mapping) else None
            token = str(meta.get("continue") or "") if isinstance(meta, Mapping) else ""
            if not token:
                break
        return items

    # ---- the calls the device taints make ---------------------------------

    def list_resource_slices(self, node: str) -> list[Any]:
        return self._list(f"{API}/resourceslices", {"fieldSelector": f"spec.nodeName={node}"})

    def list_taint_rules(self, label_selector: str) -> list[Any]:
        return self._list(f"{API}/devicetaintrules", {"labelSelector": label_selector})

    def create_taint_rule(self, rule: Mapping[str, Any]) -> Any:
        return self.request("POST", f"{API}/devicetaintrules", body=rule)

    def replace_taint_rule(self, name: str, rule: Mapping[str, Any]) -> Any:
        return self.request("PUT", f"{API}/devicetaintrules/{urllib.parse.quote(name, safe='')}", body=rule)

    def delete_taint_rule(self, name: str) -> None:
        self.request("DELETE", f"{API}/devicetaintrules/{urllib.parse.quote(name, safe='')}")
