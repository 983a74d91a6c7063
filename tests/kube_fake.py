"""A Kubernetes API server for tests, where no real one can run: the PodCheckpoint CRD, Pods and Nodes.

It keeps objects as the API server does, for what the agent uses of it:

* **custom resources** of the CRDs it is given (deploy/podcheckpoint-crd.yaml):
  create, get, list (with the collection's resourceVersion), watch from a
  resourceVersion (ADDED, MODIFIED, DELETED, BOOKMARK; versions older than
  the last compaction answer an ERROR event with code 410), replace and
  merge-patch, the status subresource (a write to the object leaves its
  status alone, a write to /status leaves everything else), resourceVersion
  conflicts (409, reason Conflict), generation bumped when the spec changes,
  and finalizers (DELETE only sets deletionTimestamp while any remain; the
  object goes once the last is removed). Every object and patch it receives
  is checked against the CRD's own OpenAPI schema, strictly, and its CEL
  rules (tests/crdschema.py): what would fail there is 422 Invalid here, and
  is recorded in `problems` as well;
* **Pods and Nodes**, as the test puts them there (`put`): get, list, and
  delete, with the same watch history;
* **RBAC**, as far as a test takes a verb away: `forbidden` holds
  "verb resource[/subresource]" entries answered 403 Forbidden.

`break_watches()` cuts every open watch mid-stream (an API server restarted);
`compact()` forgets the history so far (a watch from before it gets 410).
Plain HTTP on 127.0.0.1, a bearer token checked when `token` is set.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from tests.crdschema import CrdSchema

REPO = Path(__file__).resolve().parents[1]
PODCHECKPOINT_CRD = REPO / "deploy" / "podcheckpoint-crd.yaml"


@dataclass(frozen=True)
class Kind:
    """A resource the server serves: where it lives in the URL space, and its schema when it is a CRD's."""

    group: str  # "" for the core API
    version: str
    plural: str
    kind: str
    namespaced: bool
    schema: CrdSchema | None = None
    status_subresource: bool = False

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


def crd_kind(path: Path) -> Kind:
    crd = yaml.safe_load(path.read_text())
    [ver] = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return Kind(crd["spec"]["group"], ver["name"], crd["spec"]["names"]["plural"], crd["spec"]["names"]["kind"],
                crd["spec"]["scope"] == "Namespaced", CrdSchema(crd, ver["name"]),
                "status" in (ver.get("subresources") or {}))


PODS = Kind("", "v1", "pods", "Pod", True)
NODES = Kind("", "v1", "nodes", "Node", False)


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    status: int = 0


@dataclass
class State:
    kinds: list[Kind]
    token: str = ""
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)  # (plural, ns, name)
    history: list[tuple[int, str, str, dict[str, Any]]] = field(default_factory=list)  # (rv, plural, type, obj)
    version: int = 100
    compacted: int = 0  # watches from a version before this get 410
    calls: list[Call] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fail_next: dict[str, int] = field(default_factory=dict)  # "METHOD path" -> HTTP status, once
    forbidden: set[str] = field(default_factory=set)  # "VERB resource[/subresource]" RBAC does not grant: 403
    epoch: int = 0  # bumped by break_watches
    lock: threading.Condition = field(default_factory=threading.Condition)


class ApiHandler(BaseHTTPRequestHandler):
    """What every fake API server of the tests answers with: JSON bodies, and failures as a v1 Status."""

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                          "reason": reason, "message": message})


class _Handler(ApiHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def _route(self) -> tuple[Kind, str, str, str] | None:
        """(kind, namespace, name, subresource) of the request's path."""
        parts = [p for p in urllib.parse.urlsplit(self.path).path.split("/") if p]
        for kind in self.server.state.kinds:
            head = [p for p in kind.prefix.split("/") if p]
            if parts[: len(head)] != head:
                continue
            rest = parts[len(head):]
            ns = ""
            if kind.namespaced and len(rest) >= 2 and rest[0] == "namespaces" and rest[2:3] == [kind.plural]:
                ns, rest = rest[1], rest[2:]
            elif kind.namespaced and rest[:1] == [kind.plural] and len(rest) == 1:
                pass  # across namespaces: list and watch
            if rest[:1] != [kind.plural]:
                continue
            return kind, ns, rest[1] if len(rest) > 1 else "", rest[2] if len(rest) > 2 else ""
        return None

    def _handle(self, method: str) -> None:
        st = self.server.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        call = Call(method, urllib.parse.urlsplit(self.path).path, query, body)
        with st.lock:
            st.calls.append(call)
            failing = st.fail_next.pop(f"{method} {call.path}", 0)
        if st.token and self.headers.get("Authorization") != f"Bearer {st.token}":
            call.status = 401
            return self._status(401, "Unauthorized", "Unauthorized")
        if failing:
            call.status = failing
            return self._status(failing, "Conflict" if failing == 409 else "InternalError", f"failing {failing}")
        route = self._route()
        if route is None:
            call.status = 404
            return self._status(404, "NotFound", f"no resource at {call.path}")
        kind, ns, name, sub = route
        verb = {"GET": "watch" if query.get("watch") else ("get" if name else "list"), "POST": "create",
                "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
        if f"{verb} {kind.plural}{'/' + sub if sub else ''}" in st.forbidden:
            call.status = 403
            return self._status(403, "Forbidden", f'{kind.plural}{"/" + sub if sub else ""} "{name}" is forbidden: '
                                                  f"User cannot {verb} resource")
        if method == "GET" and not name:
            if query.get("watch", ["0"])[0] in ("1", "true"):
                return self._watch(kind, ns, query)
            return self._list(kind, ns, call)
        code, answer = self.server.apply(method, kind, ns, name, sub, body,
                                         self.headers.get("Content-Type", ""))
        call.status = code
        self._send(code, answer)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle("PATCH")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")

    # ---- collections -------------------------------------------------------

    def _list(self, kind: Kind, ns: str, call: Call) -> None:
        st = self.server.state
        with st.lock:
            items = [copy.deepcopy(o) for (plural, ons, _), o in sorted(st.objects.items())
                     if plural == kind.plural and (not ns or ons == ns)]
            version = st.version
        call.status = 200
        self._send(200, {"kind": f"{kind.kind}List", "apiVersion": kind.prefix.split("/", 2)[-1],
                         "metadata": {"resourceVersion": str(version)}, "items": items})

    def _watch(self, kind: Kind, ns: str, query: dict[str, list[str]]) -> None:
        st = self.server.state
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        seconds = float(query.get("timeoutSeconds", ["60"])[0])
        bookmarks = query.get("allowWatchBookmarks", ["false"])[0] == "true"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(event: dict[str, Any]) -> None:
            data = json.dumps(event).encode() + b"\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        deadline = time.monotonic() + seconds
        with st.lock:
            epoch = st.epoch
            if since and since < st.compacted:
                emit({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                  "code": 410, "reason": "Expired",
                                                  "message": f"too old resource version: {since} ({st.compacted})"}})
                self.wfile.write(b"0\r\n\r\n")
                return
            sent = since
        try:
            while True:
                with st.lock:
                    pending = [(rv, t, o) for rv, plural, t, o in st.history
                               if rv > sent and plural == kind.plural
                               and (not ns or o["metadata"].get("namespace", "") == ns)]
                    if not pending:
                        left = deadline - time.monotonic()
                        if left <= 0 or st.epoch != epoch:
                            break
                        st.lock.wait(min(left, 0.5))
                        if st.epoch != epoch:
                            break
                        continue
                for rv, t, o in pending:
                    emit({"type": t, "object": o})
                    sent = rv
            with st.lock:
                broken = st.epoch != epoch
                if bookmarks and not broken:
                    emit({"type": "BOOKMARK", "object": {"kind": kind.kind, "metadata": {
                        "resourceVersion": str(st.version)}}})
            if broken:
                self.close_connection = True
                return  # cut mid-stream: no end of the chunked body
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: State

    def _record(self, kind: Kind, kind_event: str, obj: dict[str, Any]) -> None:
        """Under the lock: a new resourceVersion for ``obj`` and the event in the history."""
        st = self.state
        st.version += 1
        obj["metadata"]["resourceVersion"] = str(st.version)
        st.history.append((st.version, kind.plural, kind_event, copy.deepcopy(obj)))
        st.lock.notify_all()

    def _invalid(self, kind: Kind, new: dict[str, Any], old: dict[str, Any] | None) -> tuple[int, Any] | None:
        if kind.schema is None:
            return None
        found = kind.schema.errors(new, old)
        if not found:
            return None
        name = (new.get("metadata") or {}).get("name", "?")
        self.state.problems += found
        return 422, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422, "reason": "Invalid",
                     "message": f"{kind.kind} {name!r} is invalid: " + "; ".join(found)}

    def apply(self, method: str, kind: Kind, ns: str, name: str, sub: str, body: Any,
              content_type: str) -> tuple[int, Any]:
        st = self.state
        with st.lock:
            key = (kind.plural, ns, name)
            have = st.objects.get(key)
            if method == "GET":
                return (200, copy.deepcopy(have)) if have else _not_found(kind, name)
            if method == "POST":
                return self._create(kind, ns, body)
            if have is None:
                return _not_found(kind, name)
            if method == "DELETE":
                return self._delete(kind, key, have)
            if method == "PATCH":
                if "merge-patch" not in content_type:
                    return 415, {"kind": "Status", "code": 415, "message": f"unsupported patch {content_type}"}
                body = _merge(copy.deepcopy(have), body if isinstance(body, dict) else {})
            if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
                return 400, {"kind": "Status", "code": 400, "message": "not an object"}
            given = str(body["metadata"].get("resourceVersion") or "")
            if given and given != have["metadata"]["resourceVersion"]:
                return 409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409,
                             "reason": "Conflict",
                             "message": f"Operation cannot be fulfilled on {kind.plural} {name!r}: the object has "
                                        "been modified; please apply your changes to the latest version"}
            new = copy.deepcopy(have)
            if sub == "status" and kind.status_subresource:
                new["status"] = copy.deepcopy(body.get("status"))
                if new["status"] is None:
                    del new["status"]
            elif sub:
                return _not_found(kind, f"{name}/{sub}")
            else:
                for k, v in body.items():
                    if k not in ("metadata", "status") or not kind.status_subresource:
                        new[k] = copy.deepcopy(v)
                meta = body["metadata"]
                for k in ("labels", "annotations", "finalizers", "ownerReferences"):
                    if k in meta:
                        new["metadata"][k] = copy.deepcopy(meta[k])
                    else:
                        new["metadata"].pop(k, None)
                if new.get("spec") != have.get("spec"):
                    new["metadata"]["generation"] = int(have["metadata"].get("generation", 1)) + 1
            refused = self._invalid(kind, new, have)
            if refused:
                return refused
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                del st.objects[key]
                self._record(kind, "DELETED", new)
                return 200, copy.deepcopy(new)
            st.objects[key] = new
            self._record(kind, "MODIFIED", new)
            return 200, copy.deepcopy(new)

    def _create(self, kind: Kind, ns: str, body: Any) -> tuple[int, Any]:
        st = self.state
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict) or not body["metadata"].get("name"):
            return 400, {"kind": "Status", "code": 400, "message": "an object with metadata.name"}
        obj = copy.deepcopy(body)
        if kind.status_subresource:
            obj.pop("status", None)  # set only through /status
        meta = obj["metadata"]
        key = (kind.plural, ns if kind.namespaced else "", meta["name"])
        if key in st.objects:
            return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists",
                         "message": f"{kind.plural} {meta['name']!r} already exists"}
        meta.update(uid=str(uuid.uuid4()), generation=1,
                    creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if kind.namespaced:
            meta["namespace"] = ns
        obj.setdefault("apiVersion", kind.prefix.split("/", 2)[-1])
        obj.setdefault("kind", kind.kind)
        refused = self._invalid(kind, obj, None)
        if refused:
            return refused
        st.objects[key] = obj
        self._record(kind, "ADDED", obj)
        return 201, copy.deepcopy(obj)

    def _delete(self, kind: Kind, key: tuple[str, str, str], have: dict[str, Any]) -> tuple[int, Any]:
        st = self.state
        if have["metadata"].get("finalizers"):
            if not have["metadata"].get("deletionTimestamp"):
                have["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                self._record(kind, "MODIFIED", have)
            return 200, copy.deepcopy(have)
        del st.objects[key]
        self._record(kind, "DELETED", have)
        return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}


def _not_found(kind: Kind, name: str) -> tuple[int, Any]:
    return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound",
                 "message": f'{kind.plural} "{name}" not found'}


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = target if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


class FakeKube:
    """The server, on 127.0.0.1 in a thread of its own; `with FakeKube() as api:`."""

    def __init__(self, token: str = "") -> None:
        self.state = State(kinds=[crd_kind(PODCHECKPOINT_CRD), PODS, NODES], token=token)
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.state = self.state
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-kube", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        user = {"token": self.state.token} if self.state.token else {}
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "agent", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
        }))
        return path

    def kind(self, plural: str) -> Kind:
        [kind] = [k for k in self.state.kinds if k.plural == plural]
        return kind

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object as a user (or the system) would: checked like any other."""
        kind = self.kind(plural)
        code, answer = self.server.apply("POST", kind, obj["metadata"].get("namespace", ""), "", "", obj,
                                         "application/json")
        assert code == 201, answer
        return dict(answer)

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.state.lock:
            found = self.state.objects.get((plural, namespace, name))
            return copy.deepcopy(found) if found else None

    def delete(self, plural: str, namespace: str, name: str) -> None:
        code, answer = self.server.apply("DELETE", self.kind(plural), namespace, name, "", None, "")
        assert code == 200, answer

    def break_watches(self) -> None:
        """Every open watch ends mid-stream, as when the API server restarts."""
        with self.state.lock:
            self.state.epoch += 1
            self.state.lock.notify_all()

    def compact(self) -> None:
        """Forget the history so far: a watch from any version up to now gets 410 Gone."""
        with self.state.lock:
            self.state.compacted = self.state.version + 1
            self.state.history.clear()

    def __enter__(self) -> FakeKube:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.break_watches()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
