from __future__ import annotations

import json
import os
from pathlib import Path

from criu_bridge.watchdog import proc_starttime
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


def test_each_entry_names_its_writer(tmp_path: Path) -> None:
    j = Journal(str(tmp_path / "j"))
    e = Entry("restore", data={"pod": "ns/p"})
    j.write(e)
    [back] = j.pending()
    assert (back.pid, back.start) == (os.getpid(), proc_starttime(os.getpid()))
    assert back.writer_alive() and back.written_by_me() and j.holds(back)
    # Written by an agent that did not record its start time: no live writer, whatever runs under that PID now.
    (tmp_path / "j" / "old.json").write_text(json.dumps({"kind": "restore", "op_id": "old", "pid": os.getpid(),
                                                         "data": {}}))
    old = next(p for p in j.pending() if p.op_id == "old")
    assert (old.pid, old.start) == (os.getpid(), None) and not old.writer_alive() and not old.written_by_me()
