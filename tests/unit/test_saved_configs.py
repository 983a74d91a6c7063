"""A checkpoint's saved documents are hostile input: strict JSON, bounded nesting, the CRI schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node_agent import errors
from node_agent.podformat import METADATA_KIND, load_saved
from node_agent.store import Store

POD = json.dumps({"config": {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}}).encode()
CFG = json.dumps({"config": {"metadata": {"name": "c"}, "image": {"image": "busybox"}}}).encode()


def _checkpoint(tmp_path: Path, *, pod: bytes = POD, cfg: bytes = CFG, options: object = None) -> tuple[Store, object]:
    store = Store(tmp_path / "store")
    meta = {"kind": METADATA_KIND, "pod": {"namespace": "ns", "name": "p"}, "containers": [{"name": "c"}],
            "options": options if options is not None else {"file-locks": "true"}}
    with store.writer() as w:
        w.add_bytes("pod/config.json", pod)
        w.add_bytes("containers/c/config.dump", cfg)
        w.add_bytes("containers/c/spec.dump", b"{}")
        return store, w.commit(meta)


def test_a_genuine_document_loads(tmp_path: Path) -> None:
    store, rec = _checkpoint(tmp_path)
    saved = load_saved(store, rec)  # type: ignore[arg-type]
    assert saved.options == ("file-locks",) and saved.containers[0][1]["config"]["image"]["image"] == "busybox"


@pytest.mark.parametrize("doc, needle", [
    (b'{"config": {"metadata": {"name": "p"}}, "config": {}}', "duplicate key"),
    (b'{"config": {"metadata": {"name": "p", "attempt": NaN}}}', "non-finite"),
    (b'{"config": ' + b"[" * 100 + b"]" * 100 + b"}", "nested more than"),
    (b"[" * 2_000_000 + b"]" * 2_000_000, "nested too deeply"),
    (b'{"config": {"metadata": {"name": "p"}, "privileged_from_the_future": true}}', "CRI schema"),
])
def test_a_hostile_pod_document_is_data_loss(tmp_path: Path, doc: bytes, needle: str) -> None:
    store, rec = _checkpoint(tmp_path, pod=doc)
    with pytest.raises(errors.DataLoss) as e:
        load_saved(store, rec)  # type: ignore[arg-type]
    assert needle in str(e.value) and "pod/config.json" in str(e.value)


@pytest.mark.parametrize("options", [{"file-locks": "yes"}, {"bogus": "true"}, {"tcp-established": ""}])
def test_recorded_options_are_strict(tmp_path: Path, options: object) -> None:
    store, rec = _checkpoint(tmp_path, options=options)
    with pytest.raises(errors.DataLoss):
        load_saved(store, rec)  # type: ignore[arg-type]
