from __future__ import annotations

import os
from pathlib import Path

from node_agent.journal import Entry, Journal


def test_entries_survive_and_go(tmp_path: Path) -> None:
    j = Journal(str(tmp_path / "j"))
    e = Entry("checkpoint", data={"pod": "ns/p", "helpers": []})
    j.write(e)
    e.data["helpers"].append({"pid": 1, "start": 2})
    j.write(e)
    (tmp_path / "j" / "junk.json").write_text("{not json")
    (tmp_path / "j" / "x.json.tmp").write_text("half")
    pending = Journal(str(tmp_path / "j")).pending()
    assert [(p.kind, p.op_id, p.data) for p in pending] == [("checkpoint", e.op_id, e.data)]
    assert sorted(os.listdir(tmp_path / "j")) == [e.op_id + ".json"]
    j.remove(e)
    j.remove(e)
    assert j.pending() == []
