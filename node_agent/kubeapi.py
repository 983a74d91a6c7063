"""A small Kubernetes REST client on the standard library (http.client, TLS from ``node_agent.tls``).

Credentials come from a kubeconfig (its current context: server, CA,
bearer token or token file, client certificate) or from the in-cluster
service account. Calls (`request`), paged lists that also say the
collection's resourceVersion (`list_all`), and watches from one
(`watch`: each event as it comes; `Gone` when the server no longer has that
version, and the caller lists again). HTTP statuses become the agent's
errors here. Blocking; callers run it in a thread with a deadline.
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
from typing import Any, Iterator, Mapping

from node_agent import errors, tls

API = "/apis/resource.k8s.io/v1"
WATCH_EVENTS = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")
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


def _event(line: bytes, path: str) -> tuple[str, dict[str, Any]]:
    """One watch event, checked; an ERROR event becomes the error it reports (`Gone` for 410)."""
    try:
        event = json.loads(line)
    except ValueError:
        raise errors.Internal(f"watch {path}: the server sent a line that is not JSON") from None
    kind = event.get("type") if isinstance(event, dict) else None
    obj = event.get("object") if isinstance(event, dict) else None
    if not isinstance(obj, dict):
        raise errors.Internal(f"watch {path}: an event without an object")
    if kind == "ERROR":
        code = obj.get("code")
        if code == 410:
            raise Gone(f"watch {path}: {obj.get('message') or 'resourceVersion too old'}")
        raise _status_error(code if isinstance(code, int) else 500, "watch", path, obj)
    if kind not in WATCH_EVENTS:
        raise errors.Internal(f"watch {path}: an event of unknown type {kind!r}")
    return str(kind), obj


class Gone(errors.Aborted):
    """The resourceVersion a watch asked for is older than the server keeps (HTTP 410): list again."""


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

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self.tls:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _send(self, conn: http.client.HTTPConnection, method: str, path: str, body: Any,
              query: Mapping[str, str] | None, content_type: str = "application/json") -> http.client.HTTPResponse:
        target = self.prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json", "User-Agent": "node-agent"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        conn.request(method, target, body=data, headers=headers)
        return conn.getresponse()

    def _failed(self, exc: BaseException, method: str, path: str, timeout: float) -> errors.AgentError:
        if isinstance(exc, socket.timeout):
            return errors.DeadlineExceeded(f"{method} {path}: no answer from {self.creds.server} in {timeout:g}s")
        if isinstance(exc, ssl.SSLError):
            return tls.failure(exc, f"{method} {path}", self.creds.server, verbatim=True)
        return errors.Unavailable(f"{method} {path}: cannot reach {self.creds.server}: {exc}")

    def request(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                content_type: str = "application/json") -> Any:
        """One call; the decoded JSON answer. Errors are the agent's, by HTTP status."""
        conn = self._connect(self.timeout)
        try:
            resp = self._send(conn, method, path, body, query, content_type)
            raw = resp.read(MAX_BODY + 1)
            status = resp.status
        except (OSError, http.client.HTTPException) as exc:
            raise self._failed(exc, method, path, self.timeout) from exc
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
        return self.list_all(path, query)[0]

    def list_all(self, path: str, query: Mapping[str, str] | None = None) -> tuple[list[Any], str]:
        """Every item of a collection, page by page; and the resourceVersion to watch it from."""
        items: list[Any] = []
        token = version = ""
        for _ in range(1000):
            q = dict(query or {}, limit=str(PAGE))
            if token:
                q["continue"] = token
            page = self.request("GET", path, query=q)
            got = page.get("items") if isinstance(page, Mapping) else None
            items += got if isinstance(got, list) else []
            meta = page.get("metadata") if isinstance(page, Mapping) else None
            token = str(meta.get("continue") or "") if isinstance(meta, Mapping) else ""
            version = str(meta.get("resourceVersion") or "") if isinstance(meta, Mapping) else ""
            if not token:
                break
        return items, version

    def watch(self, path: str, resource_version: str, *, seconds: int = 300,
              query: Mapping[str, str] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """The collection's changes after ``resource_version``: (type, object) as the server sends them, for up
        to ``seconds`` (then the server ends the stream: watch again from the last version seen).

        BOOKMARK events carry only a newer resourceVersion. ``Gone`` when the
        server no longer has ``resource_version``; any other ERROR event, or a
        line that is not an event, ends the watch with the agent's error.
        """
        q = dict(query or {}, watch="1", resourceVersion=resource_version, allowWatchBookmarks="true",
                 timeoutSeconds=str(seconds))
        wait = seconds + self.timeout
        conn = self._connect(wait)
        try:
            try:
                resp = self._send(conn, "GET", path, None, q)
                status = resp.status
                if not 200 <= status < 300:
                    raw = resp.read(MAX_BODY)
                    try:
                        decoded = json.loads(raw) if raw else {}
                    except ValueError:
                        decoded = {}
                    if status == 410:
                        raise Gone(f"watch {path}: resourceVersion {resource_version} is gone")
                    raise _status_error(status, "GET", path, decoded)
            except (OSError, http.client.HTTPException) as exc:
                raise self._failed(exc, "watch", path, wait) from exc
            while True:
                try:
                    line = resp.readline(MAX_BODY + 1)
                except (OSError, http.client.HTTPException) as exc:
                    raise self._failed(exc, "watch", path, wait) from exc
                if not line:
                    return  # the server ended the watch
                if len(line) > MAX_BODY:
                    raise errors.ResourceExhausted(f"watch {path}: an event larger than {MAX_BODY} bytes")
                if not line.strip():
                    continue
                yield _event(line, path)
        finally:
            conn.close()

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
