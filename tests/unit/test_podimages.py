"""A restored container's image (``podimages``): pulled when a restore must pull it, and held to the checkpoint's.

A small fake CRI stands in for containerd's image service; it records what it is asked.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node_agent import errors, podimages
from node_agent.config.loading import from_mapping


class FakeImages:
    def __init__(self, present: dict[str, tuple[str, tuple[str, ...]]], pull_error: errors.AgentError | None = None):
        self.present = present
        self.pull_error = pull_error
        self.pulled: list[tuple[str, str]] = []

    async def image_present(self, image: str) -> bool:
        return image in self.present

    async def image_ids(self, image: str) -> tuple[str, tuple[str, ...]]:
        return self.present.get(image, ("", ()))

    async def pull_image(self, image: str, *, username: str = "", password: str = "", timeout: float | None = None) -> str:
        self.pulled.append((image, username))
        if self.pull_error is not None:
            raise self.pull_error
        self.present[image] = ("sha256:" + "1" * 64, ())
        return image


RECORD: Any = SimpleNamespace(id="sha256:" + "c" * 64)


def _settings(tmp_path: Path, logins: dict[str, Any] | None = None) -> Any:
    creds = tmp_path / "config.json"
    if logins is not None:
        creds.write_text(json.dumps({"auths": logins}))
    return from_mapping({"store": str(tmp_path / "store"),
                         "registry": {"config-path": "", "credentials-file": str(creds)}})


async def test_a_missing_image_is_pulled_with_the_nodes_login(tmp_path: Path) -> None:
    cri = FakeImages({})
    settings = _settings(tmp_path, {"reg.example:5000": {"username": "node", "password": "pw"}})
    await podimages.ensure_image(cri, settings, RECORD, "app", "reg.example:5000/team/app:1")  # type: ignore[arg-type]
    assert cri.pulled == [("reg.example:5000/team/app:1", "node")]
    await podimages.ensure_image(cri, settings, RECORD, "app", "reg.example:5000/team/app:1")  # type: ignore[arg-type]
    assert len(cri.pulled) == 1  # there now: not pulled again


@pytest.mark.parametrize(("failure", "kind"), [
    (errors.Internal("failed to resolve image"), errors.FailedPrecondition),
    (errors.NotFound("no such image"), errors.FailedPrecondition),
    (errors.Unauthenticated("the registry wants a login"), errors.Unauthenticated),
    (errors.PermissionDenied("not this user"), errors.PermissionDenied),
])
async def test_an_image_that_cannot_be_pulled_says_why(
    tmp_path: Path, failure: errors.AgentError, kind: type[errors.AgentError]
) -> None:
    cri = FakeImages({}, failure)
    with pytest.raises(kind) as info:
        await podimages.ensure_image(cri, _settings(tmp_path), RECORD, "app", "reg.example/app:1")  # type: ignore[arg-type]
    assert str(info.value).startswith(f"restore of {RECORD.id}: image reg.example/app:1 (container app) is not on "
                                      "this node, and pulling it failed: ")
    assert cri.pulled == [("reg.example/app:1", "")]


async def test_the_kubelets_image_must_be_the_checkpoints_own(tmp_path: Path) -> None:
    own, other = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    saved: Any = SimpleNamespace(containers=(("app", {"rootfsImageRef": own}, {}),))
    ok = FakeImages({"reg/app:1": (own, ("reg/app@sha256:" + "d" * 64,))})
    await podimages.check_image(ok, RECORD, saved, "app", "reg/app:1")  # type: ignore[arg-type]
    by_digest: Any = SimpleNamespace(containers=(("app", {"rootfsImageRef": "reg/app@sha256:" + "d" * 64}, {}),))
    await podimages.check_image(ok, RECORD, by_digest, "app", "reg/app:1")  # type: ignore[arg-type]
    with pytest.raises(errors.FailedPrecondition, match=f"checkpointed on image {own}, but image reg/app:2 is {other}"):
        await podimages.check_image(FakeImages({"reg/app:2": (other, ())}), RECORD, saved, "app",  # type: ignore[arg-type]
                                    "reg/app:2")
    with pytest.raises(errors.FailedPrecondition, match="is not on this node; the kubelet pulls"):
        await podimages.check_image(FakeImages({}), RECORD, saved, "app", "reg/app:1")  # type: ignore[arg-type]
