from __future__ import annotations

import pytest

from node_agent import errors
from node_agent.checkpointing import gpu_devices
from node_agent.devshm import shm_source
from node_agent.podformat import parse_options


def test_documented_options_map_to_runc_flags() -> None:
    f = parse_options({"tcp-established": "true", "file-locks": "true", "ext-unix-sk": "false"})
    assert f.runc_args() == ["--tcp-established", "--file-locks"]
    assert f.as_options() == {"tcp-established": "true", "file-locks": "true"}


@pytest.mark.parametrize("opts", [{"bogus": "1"}, {"tcp-established": "maybe"}, {"leave-running": "true"},
                                  {"file-locks": ""}, {"pre-dump": "1"}, {"shell-job": "yes"}, {"ext-unix-sk": "True"}])
def test_other_options_are_invalid(opts: dict[str, str]) -> None:
    with pytest.raises(errors.InvalidArgument):
        parse_options(opts)


def test_gpu_device_nodes_are_found_in_devices_and_mounts() -> None:
    spec = {
        "linux": {"devices": [{"path": "/dev/fuse"}, {"path": "/dev/nvidia0"}]},
        "mounts": [{"destination": "/dev/dri/card0", "source": "/dev/dri/card0"}, {"destination": "/etc/hosts", "source": "/x"}],
    }
    assert gpu_devices(spec) == ["/dev/dri/card0", "/dev/nvidia0"]
    assert gpu_devices({"mounts": [{"destination": "/opt", "source": "/dev/kfd"}]}) == ["/dev/kfd"]
    assert gpu_devices({}) == []


def test_shm_source_only_for_the_pods_own_shm() -> None:
    own = {"mounts": [{"destination": "/dev/shm", "type": "bind", "source": "/run/c/sandboxes/abc/shm"}]}
    assert shm_source(own) == "/run/c/sandboxes/abc/shm"
    host = {"mounts": [{"destination": "/dev/shm", "type": "bind", "source": "/dev/shm"}]}
    assert shm_source(host) is None
    assert shm_source({"mounts": [{"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}]}) is None


def test_pre_dump_option_is_the_agents_own() -> None:
    from node_agent.podformat import parse_all_options

    flags, pre = parse_all_options({"pre-dump": "false", "file-locks": "true"})
    assert pre is False and flags.runc_args() == ["--file-locks"]
    assert parse_all_options({})[1] is None


def test_file_locks_are_on_for_new_checkpoints_unless_turned_off() -> None:
    from node_agent.podformat import parse_all_options

    assert parse_all_options({})[0].runc_args() == ["--file-locks"]
    assert parse_all_options({})[0].as_options() == {"file-locks": "true"}
    assert parse_all_options({"file-locks": "false"})[0].runc_args() == []
    # The options a dump was made with: what is not there was off.
    assert parse_options({}).runc_args() == []
