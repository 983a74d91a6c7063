"""A checkpoint grants nothing: CRIU images held to the new container's config (criu_bridge.privileges).

The images here are synthetic, written field by field as CRIU writes them
(the genuine layout: a container of the test bed, dumped by CRIU 4.2), so
each rule is shown on both sides, including the sides the machines here
cannot produce for real (processes running as non-root cannot be dumped
without CAP_SYS_RESOURCE).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from criu_bridge import criuimg, privileges, taskimages
from criu_bridge.errors import BridgeError, InvalidInput
from tests.unit.criu_images import (
    DEFAULT_CAPS, DEFAULT_MASK, GENUINE_MOUNTS, MS_NOSUID, MS_RO, ROOT_IDS, TASK_IDS, Checkpoint, b, caps_words, core,
    creds, ids, image, mount, spec, v,
)


@pytest.fixture
def ckpt(tmp_path: Path) -> Checkpoint:
    return Checkpoint(tmp_path / "images")


def one(found: list[str], *needles: str) -> str:
    assert len(found) >= 1, found
    hits = [f for f in found if all(n in f for n in needles)]
    assert hits, (needles, found)
    return hits[0]


# ---- the genuine case --------------------------------------------------------------------


def test_a_genuine_container_is_accepted(ckpt: Checkpoint) -> None:
    assert ckpt.findings() == []


def test_what_is_read_is_what_criu_wrote(ckpt: Checkpoint) -> None:
    got = ckpt.read()
    assert [t.pid for t in got.tasks] == [7, 23] and got.root_task.comm == "sh"
    c = got.tasks[0].threads[0].creds
    assert c is not None and c.caps["effective"] == DEFAULT_MASK and c.uids == (0, 0, 0, 0)
    assert got.tasks[0].namespaces == TASK_IDS and got.root_namespaces == ROOT_IDS
    assert len(got.mount_namespaces[13]) == len(GENUINE_MOUNTS)


# ---- capabilities --------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["inheritable", "permitted", "effective", "bounding", "ambient"])
def test_a_capability_outside_the_bounding_set_is_refused_in_every_set(ckpt: Checkpoint, which: str) -> None:
    admin = privileges.capability_mask(["CAP_SYS_ADMIN"])
    kw = {"inheritable": {"inheritable": admin}, "ambient": {"ambient": admin},
          "bounding": {"bounding": DEFAULT_MASK | admin}}.get(which, {})
    thread = creds(**kw) if kw else creds(caps=DEFAULT_MASK | admin, bounding=DEFAULT_MASK)
    ckpt.files["core-7.img"] = core(7, comm="sh", thread=thread)
    found = ckpt.findings()
    assert one(found, "task 7 (sh)", "CAP_SYS_ADMIN", f" {which}", "outside the container's bounding set")


def test_capabilities_the_config_grants_are_accepted(ckpt: Checkpoint) -> None:
    admin = privileges.capability_mask(["CAP_SYS_ADMIN"])
    ckpt.files["core-7.img"] = core(7, thread=creds(caps=DEFAULT_MASK | admin))
    caps = DEFAULT_CAPS + ["CAP_SYS_ADMIN"]
    assert ckpt.findings(spec(process__capabilities={k: caps for k in ("bounding", "effective", "permitted")})) == []


def test_fewer_capabilities_than_the_config_are_fine(ckpt: Checkpoint) -> None:
    ckpt.files["core-7.img"] = core(7, thread=creds(caps=0, bounding=0))
    assert ckpt.findings() == []


# ---- uid, gid, groups -------------------------------------------------------------------------


def test_a_root_checkpoint_under_a_non_root_config_is_refused(ckpt: Checkpoint) -> None:
    found = ckpt.findings(spec(process__user={"uid": 1000, "gid": 1000, "additionalGids": [1000]}))
    one(found, "task 7", "uid 0/0/0/0", "user 1000")
    one(found, "gid 0/0/0/0", "group 1000")
    one(found, "supplementary groups 0")


def test_a_non_root_checkpoint_under_its_own_user_is_accepted(ckpt: Checkpoint) -> None:
    for pid in (7, 23):
        ckpt.files[f"core-{pid}.img"] = core(pid, thread=creds(uid=1000, gid=1000, groups=(1000,), caps=0))
    assert ckpt.findings(spec(process__user={"uid": 1000, "gid": 1000, "additionalGids": [1000]})) == []


def test_root_with_setuid_may_have_become_anyone(ckpt: Checkpoint) -> None:
    ckpt.files["core-23.img"] = core(23, thread=creds(uid=33, gid=33, groups=(33,), caps=0))
    assert ckpt.findings() == []


def test_root_without_setuid_or_setgid_may_not(ckpt: Checkpoint) -> None:
    ckpt.files["core-23.img"] = core(23, thread=creds(uid=33, gid=33, groups=(33,), caps=0))
    caps = [c for c in DEFAULT_CAPS if c not in ("CAP_SETUID", "CAP_SETGID")]
    found = ckpt.findings(spec(process__capabilities={k: caps for k in ("bounding", "effective", "permitted")}))
    one(found, "task 23", "uid 33/33/33/33")
    one(found, "task 23", "gid 33/33/33/33")


def test_a_uid_of_2_to_the_32_reads_as_criu_reads_it(ckpt: Checkpoint) -> None:
    """protobuf-c keeps the low 32 bits of a uint32 varint: 2**32 is uid 0, as CRIU would set it."""
    raw = creds(uid=1000, gid=1000, groups=(1000,), caps=0).replace(v(1, 1000), v(1, 1 << 32), 1)
    ckpt.files["core-7.img"] = core(7, thread=raw)
    found = ckpt.findings(spec(process__user={"uid": 1000, "gid": 1000, "additionalGids": [1000]}))
    one(found, "task 7", "uid 0/1000/1000/1000")


# ---- securebits, no_new_privs, LSM, seccomp, scheduling ------------------------------------------


def test_securebits_that_keep_capabilities_are_refused(ckpt: Checkpoint) -> None:
    ckpt.files["core-7.img"] = core(7, comm="sh", thread=creds(secbits=1 << 4))
    one(ckpt.findings(), "task 7 (sh)", "securebits keep-caps")


def test_securebits_that_only_restrict_are_accepted(ckpt: Checkpoint) -> None:
    ckpt.files["core-7.img"] = core(7, thread=creds(secbits=(1 << 0) | (1 << 1) | (1 << 6) | (1 << 7)))
    assert ckpt.findings() == []


def test_no_new_privs_is_required_when_the_config_sets_it(ckpt: Checkpoint) -> None:
    one(ckpt.findings(spec(process__noNewPrivileges=True)), "task 7", "no_new_privs is off")
    for pid in (7, 23):
        ckpt.files[f"core-{pid}.img"] = core(pid, thread=creds(nnp=True))
    assert ckpt.findings(spec(process__noNewPrivileges=True)) == []


def test_the_lsm_profile_must_be_the_configs(ckpt: Checkpoint) -> None:
    one(ckpt.findings(spec(process__apparmorProfile="cri-containerd.apparmor.d")), "LSM profile '(none)'")
    for pid in (7, 23):
        ckpt.files[f"core-{pid}.img"] = core(pid, thread=creds(lsm="cri-containerd.apparmor.d"))
    assert ckpt.findings(spec(process__apparmorProfile="cri-containerd.apparmor.d")) == []


def test_apparmor_policy_for_the_kernel_is_refused(ckpt: Checkpoint) -> None:
    ckpt.files["core-7.img"] = core(7, thread=creds(apparmor_data=True))
    ckpt.files["apparmor.img"] = image(0x59423047, b"")
    found = ckpt.findings()
    one(found, "task 7", "AppArmor policy")
    one(found, "apparmor.img")


def test_seccomp_dropped_is_refused(ckpt: Checkpoint) -> None:
    profile = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}
    one(ckpt.findings(spec(linux__seccomp=profile)), "task 7", "seccomp is disabled")
    for pid in (7, 23):
        ckpt.files[f"core-{pid}.img"] = core(pid, thread=creds(), seccomp=2)
    assert ckpt.findings(spec(linux__seccomp=profile)) == []


def test_the_older_per_task_seccomp_mode_wins_as_criu_reads_it(ckpt: Checkpoint) -> None:
    profile = {"defaultAction": "SCMP_ACT_ERRNO"}
    for pid in (7, 23):
        ckpt.files[f"core-{pid}.img"] = core(pid, thread=creds(), seccomp=2, old_seccomp=0)
    one(ckpt.findings(spec(linux__seccomp=profile)), "seccomp is disabled")
    for pid in (7, 23):
        ckpt.files[f"core-{pid}.img"] = core(pid, thread=creds(), old_seccomp=2)
    assert ckpt.findings(spec(linux__seccomp=profile)) == []


def test_real_time_scheduling_and_negative_nice_need_sys_nice(ckpt: Checkpoint) -> None:
    ckpt.files["core-7.img"] = core(7, thread=creds(), thread_extra=v(4, 1) + v(5, 50))
    one(ckpt.findings(), "task 7", "real-time scheduling policy 1")
    ckpt.files["core-7.img"] = core(7, thread=creds(), thread_extra=v(3, (5 << 1) - 1))  # sint32 -5
    one(ckpt.findings(), "task 7", "nice value -5")
    caps = DEFAULT_CAPS + ["CAP_SYS_NICE"]
    assert ckpt.findings(spec(process__capabilities={k: caps for k in ("bounding", "permitted")})) == []


def test_rlimits_and_oom_score_adj_above_the_config_are_refused(ckpt: Checkpoint) -> None:
    nofile = b"".join(b(1, v(1, 0) + v(2, 0)) for _ in range(7)) + b(1, v(1, 1 << 20) + v(2, 1 << 20))
    ckpt.files["core-7.img"] = core(7, thread=creds(), task_extra=b(8, nofile) + v(14, (1 << 64) - 1000))
    found = ckpt.findings(spec(process__rlimits=[{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
                               process__oomScoreAdj=100))
    one(found, "task 7", "RLIMIT_NOFILE 1048576/1048576", "1024")
    one(found, "task 7", "oom_score_adj -1000", "100")


# ---- credentials that are missing, threads, tasks that never run ---------------------------------------


def test_a_task_without_credentials_is_refused(ckpt: Checkpoint) -> None:
    """CRIU would leave it with its own credentials: root, every capability."""
    ckpt.files["core-7.img"] = core(7, comm="sh")
    one(ckpt.findings(), "task 7 (sh) has no credentials")


def test_the_oldest_layout_takes_creds_from_their_own_image(ckpt: Checkpoint) -> None:
    ckpt.files["core-7.img"] = core(7, comm="sh")
    ckpt.files["creds-7.img"] = image(taskimages.CREDS_MAGIC, creds(caps=privileges.capability_mask(["CAP_SYS_ADMIN"])))
    one(ckpt.findings(), "task 7 (sh)", "CAP_SYS_ADMIN")
    ckpt.files["creds-7.img"] = image(taskimages.CREDS_MAGIC, creds())
    assert ckpt.findings() == []


def test_every_thread_is_held_to_the_config(ckpt: Checkpoint) -> None:
    ckpt.tasks[1] = (23, [23, 24])
    ckpt.files["core-24.img"] = core(24, main=False, thread=creds(caps=privileges.capability_mask(["CAP_BPF"])))
    one(ckpt.findings(), "task 23 (sleep), thread 24", "CAP_BPF")


def test_zombies_and_helpers_run_nothing_and_are_not_held(ckpt: Checkpoint) -> None:
    ckpt.files["core-23.img"] = core(23, state=taskimages.TASK_DEAD)
    assert ckpt.findings() == []


def test_findings_are_bounded(ckpt: Checkpoint) -> None:
    ckpt.tasks = [(7 + i, [7 + i]) for i in range(30)]
    for pid, _ in ckpt.tasks:
        ckpt.files[f"core-{pid}.img"] = core(pid)
        ckpt.files[f"ids-{pid}.img"] = image(criuimg.IDS_MAGIC, ids(TASK_IDS))
    found = ckpt.findings()
    assert len(found) == privileges.MAX_FINDINGS + 1 and found[-1] == "and 18 more"


# ---- namespaces ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ns", ["network", "pid", "mount", "ipc", "uts"])
def test_a_task_in_the_nodes_namespace_is_refused(ckpt: Checkpoint, ns: str) -> None:
    ckpt.files["ids-23.img"] = image(criuimg.IDS_MAGIC, ids({**TASK_IDS, ns: ROOT_IDS[ns]}))
    one(ckpt.findings(), "task 23", f"{ns} namespace of the node")


def test_a_user_namespace_the_config_lacks_is_refused(ckpt: Checkpoint) -> None:
    ckpt.files["ids-7.img"] = image(criuimg.IDS_MAGIC, ids({**TASK_IDS, "user": 99}))
    ckpt.files["userns-99.img"] = image(taskimages.USERNS_MAGIC, b(1, v(1, 0) + v(2, 0) + v(3, 1 << 32 - 1)))
    found = ckpt.findings()
    one(found, "task 7", "user namespace")
    one(found, "userns-*.img")


def test_user_namespace_maps_must_be_the_configs(ckpt: Checkpoint) -> None:
    for pid in (7, 23):
        ckpt.files[f"ids-{pid}.img"] = image(criuimg.IDS_MAGIC, ids({**TASK_IDS, "user": 99}))
    ckpt.files["userns-99.img"] = image(taskimages.USERNS_MAGIC, b(1, v(1, 0) + v(2, 100000) + v(3, 65536))
                                        + b(2, v(1, 0) + v(2, 100000) + v(3, 65536)))
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network", "user")]
    same = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    assert ckpt.findings(spec(linux__namespaces=namespaces, linux__uidMappings=same, linux__gidMappings=same)) == []
    other = [{"containerID": 0, "hostID": 0, "size": 65536}]
    one(ckpt.findings(spec(linux__namespaces=namespaces, linux__uidMappings=other, linux__gidMappings=same)),
        "user namespace 99")


def test_the_root_task_needs_its_namespace_ids(ckpt: Checkpoint) -> None:
    del ckpt.files["ids-7.img"]
    one(ckpt.findings(), "task 7 (sh) has no namespace ids")


# ---- mounts ---------------------------------------------------------------------------------------


def test_an_added_block_device_mount_is_refused(ckpt: Checkpoint) -> None:
    ckpt.mounts.append(mount(130, 100, 16, "/host", source="/dev/vda", fsname="ext4"))
    one(ckpt.findings(), "mount 130 at /host", "'ext4'", "/dev/vda")


@pytest.mark.parametrize("fstype", [0, 3, 11, 15, 17, 19])
def test_filesystems_a_config_never_mounts_are_refused(ckpt: Checkpoint, fstype: int) -> None:
    ckpt.mounts.append(mount(130, 100, fstype, "/x", source="/dev/sda1"))
    one(ckpt.findings(), "mount 130 at /x")


def test_a_virtual_mount_needs_sys_admin_where_the_config_has_none(ckpt: Checkpoint) -> None:
    ckpt.mounts.append(mount(130, 100, 5, "/scratch", source="tmpfs"))
    one(ckpt.findings(), "mount 130 at /scratch", "tmpfs")
    caps = DEFAULT_CAPS + ["CAP_SYS_ADMIN"]
    assert ckpt.findings(spec(process__capabilities={k: caps for k in ("bounding", "permitted")})) == []


def test_criu_special_external_mounts_are_refused(ckpt: Checkpoint) -> None:
    ckpt.mounts.append(mount(130, 100, 16, "/dev/disk", source="/dev/vda", ext_key="CRIU:EXTERNAL_DEV"))
    one(ckpt.findings(), "mount 130 at /dev/disk", "CRIU:EXTERNAL_DEV")


def test_a_read_only_volume_made_writable_is_refused(ckpt: Checkpoint) -> None:
    ckpt.mounts[-1] = mount(121, 100, 0, "/data", source="/dev/vda", root="/x", ext_key="/data")
    one(ckpt.findings(), "mount 121 at /data", "read-only")
    ckpt.mounts[-1] = mount(121, 100, 0, "/elsewhere", source="/dev/vda", root="/x", ext_key="/data")
    one(ckpt.findings(), "mount 121 at /elsewhere", "/data is read-only")


def test_read_only_sysfs_and_cgroup_binds_stay_read_only(ckpt: Checkpoint) -> None:
    ckpt.mounts[5] = mount(106, 100, 2, "/sys", source="sysfs", flags=MS_NOSUID)
    one(ckpt.findings(), "mount 106 at /sys", "read-only")
    ckpt.mounts[5] = GENUINE_MOUNTS[5]
    ckpt.mounts[7] = mount(108, 107, 12, "/sys/fs/cgroup/memory", root="/pod/c1", ext_key="/sys/fs/cgroup/memory")
    one(ckpt.findings(), "mount 108", "read-only")


def test_a_second_proc_over_the_masked_one_is_refused(ckpt: Checkpoint) -> None:
    ckpt.mounts.append(mount(131, 100, 1, "/proc", source="proc"))
    one(ckpt.findings(), "2 mounts at /proc")


MASKED = {"linux__maskedPaths": ["/proc/kcore", "/proc/acpi"], "linux__readonlyPaths": ["/proc/bus"]}


def _masks(parent: int = 102) -> list[bytes]:
    return [mount(140, parent, 0, "/proc/kcore", source="udev", root="/null", ext_key="/dev/null"),
            mount(141, parent, 5, "/proc/acpi", source="tmpfs", flags=MS_RO),
            mount(142, parent, 1, "/proc/bus", source="proc", root="/bus", flags=MS_RO, root_dev=1102)]


def test_masked_and_read_only_paths_are_accepted_as_runc_makes_them(ckpt: Checkpoint) -> None:
    ckpt.mounts += _masks()
    assert ckpt.findings(spec(**MASKED)) == []


def test_a_dropped_mask_is_refused(ckpt: Checkpoint) -> None:
    ckpt.mounts += _masks()[1:]
    one(ckpt.findings(spec(**MASKED)), "/proc/kcore masked", "no mount there")


def test_a_path_the_node_lacks_needs_no_mask(ckpt: Checkpoint) -> None:
    ckpt.mounts += _masks()[1:]
    assert ckpt.findings(spec(**MASKED), exists=lambda p: p != "/proc/kcore") == []


def test_a_writable_read_only_path_is_refused(ckpt: Checkpoint) -> None:
    ckpt.mounts += _masks()[:2] + [mount(142, 102, 1, "/proc/bus", source="proc", root="/bus", root_dev=1102)]
    one(ckpt.findings(spec(**MASKED)), "mount 142 at /proc/bus", "read-only")


def test_a_mask_under_the_proc_mount_covers_nothing(ckpt: Checkpoint) -> None:
    ckpt.mounts += _masks(parent=100)
    one(ckpt.findings(spec(**MASKED)), "mount 140", "not mounted on the mount at /proc")


def test_an_unrelated_masked_path_outside_proc_is_looked_up_in_the_rootfs(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    exists = privileges.path_exists(str(rootfs))
    assert not exists("/etc/secret") and exists("/etc") and exists("/proc/self")
    assert not exists("/proc/no-such-file")


# ---- hostile framing ---------------------------------------------------------------------------------


def test_a_duplicated_thread_core_is_refused(ckpt: Checkpoint) -> None:
    good = core(7, thread=creds())
    ckpt.files["core-7.img"] = good[:8] + criuimg.entry_bytes(good[12:] + b(5, b(10, creds(caps=0))))
    with pytest.raises(InvalidInput, match="occurs 2 times"):
        ckpt.read()


def test_packed_capabilities_read_as_unpacked_ones(ckpt: Checkpoint) -> None:
    admin = DEFAULT_MASK | privileges.capability_mask(["CAP_SYS_ADMIN"])
    packed = b"".join(criuimg.encode_varint(w) for w in caps_words(admin))
    raw = creds().replace(b"".join(v(11, w) for w in caps_words(DEFAULT_MASK)), b(11, packed))
    ckpt.files["core-7.img"] = core(7, thread=raw)
    one(ckpt.findings(), "CAP_SYS_ADMIN", "effective set")


def test_only_the_first_entry_of_a_core_is_read_as_by_criu(ckpt: Checkpoint) -> None:
    good = core(7, thread=creds())
    ckpt.files["core-7.img"] = good + criuimg.entry_bytes(b(5, b(10, creds(caps=(1 << 41) - 1))))
    assert ckpt.findings() == []


def test_a_field_of_the_wrong_wire_type_is_refused(ckpt: Checkpoint) -> None:
    bad = creds().replace(v(1, 0), b(1, b"x"), 1)
    ckpt.files["core-7.img"] = core(7, thread=bad)
    with pytest.raises(InvalidInput, match="wire type"):
        ckpt.read()


@pytest.mark.parametrize("name", ["pstree.img", "inventory.img", "core-7.img", "ids-7.img", "mountpoints-13.img"])
def test_truncated_images_are_refused(ckpt: Checkpoint, name: str) -> None:
    ckpt.read()
    data = (ckpt.dir / name).read_bytes()
    (ckpt.dir / name).write_bytes(data[:-3])
    with pytest.raises(InvalidInput, match="truncated"):
        taskimages.read(str(ckpt.dir))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["core-7.img", "ids-7.img", "mountpoints-13.img", "pstree.img"]))
def test_any_bytes_in_an_image_are_read_or_refused_cleanly(tmp_path_factory: Any, junk: bytes, name: str) -> None:
    c = Checkpoint(tmp_path_factory.mktemp("fuzz") / "images")
    c.read()
    magic = {"core-7.img": criuimg.CORE_MAGIC, "ids-7.img": criuimg.IDS_MAGIC, "mountpoints-13.img":
             taskimages.MNTS_MAGIC, "pstree.img": taskimages.PSTREE_MAGIC}[name]
    (c.dir / name).write_bytes(struct.pack("<II", criuimg.IMG_COMMON_MAGIC, magic) + junk)
    try:
        got = taskimages.read(str(c.dir))
    except BridgeError:
        return
    assert isinstance(privileges.findings(got, spec(), exists=lambda _p: True), list)


def test_what_only_takes_access_away_needs_no_privilege(ckpt: Checkpoint) -> None:
    """Masks another engine made (Podman, CRI-O) under a config without them: read-only tmpfs over a
    directory, a path of /proc bound read-only onto itself."""
    ckpt.mounts += [mount(150, 106, 5, "/sys/firmware", source="tmpfs", flags=MS_RO),
                    mount(151, 102, 1, "/proc/sys", source="proc", root="/sys", flags=MS_RO, root_dev=1102)]
    assert ckpt.findings() == []


def test_a_writable_or_displaced_bind_of_proc_is_refused(ckpt: Checkpoint) -> None:
    ckpt.mounts.append(mount(151, 102, 1, "/proc/sys", source="proc", root="/sys", root_dev=1102))
    one(ckpt.findings(), "mount 151 at /proc/sys", "proc")
    # All of /proc, read-only, somewhere else: a view of it without the config's masks.
    ckpt.mounts[-1] = mount(151, 100, 1, "/mnt/proc", source="proc", root="/", flags=MS_RO, root_dev=1102)
    one(ckpt.findings(), "mount 151 at /mnt/proc")
    ckpt.mounts[-1] = mount(151, 100, 1, "/mnt/sys", source="proc", root="/sys", flags=MS_RO, root_dev=1102)
    one(ckpt.findings(), "mount 151 at /mnt/sys")


def test_a_bind_in_place_over_a_mask_uncovers_it_and_is_refused(ckpt: Checkpoint) -> None:
    masked = {"linux__maskedPaths": ["/proc/sys/kernel/x"]}
    ckpt.mounts += [mount(160, 102, 5, "/proc/sys/kernel/x", source="tmpfs", flags=MS_RO)]
    assert ckpt.findings(spec(**masked)) == []
    ckpt.mounts += [mount(161, 102, 1, "/proc/sys", source="proc", root="/sys", flags=MS_RO, root_dev=1102)]
    one(ckpt.findings(spec(**masked)), "mount 160", "not mounted on the mount at /proc/sys")
