"""Capture and apply a container's writable-layer diff.

The writable layer of a CRI container is the upperdir of its overlayfs root
(`criu_bridge.mountinfo.upperdir_of`). `capture.capture_diff` turns it,
while the container is frozen, into the files of the container checkpoint
archive:

- `rootfs-diff.tar`: an uncompressed POSIX (PAX) tar of the regular files,
  directories, symlinks, hardlinks and FIFOs of the upperdir, in a fixed order
  (depth first, names sorted bytewise), with relative member names, mode
  (setuid/setgid/sticky included), numeric uid/gid and whole-second mtime.
  Extended attributes `security.capability` and `user.*` (except
  `user.overlay.*`) travel as `SCHILY.xattr.*` PAX records.
- `deleted.files`: a JSON list of the paths that the upperdir whites out
  (character device 0:0), relative to the container root ("etc/motd"). This
  is the list CRI-O, Podman and checkpointctl use; `apply_diff` also accepts
  their "/etc/motd" spelling. Names that are not UTF-8 are written with
  Python's surrogate escapes.
- `opaque.dirs`: a JSON list, in the same format, of the directories marked
  opaque (xattr `trusted.overlay.opaque` or `user.overlay.opaque` = "y"):
  everything the lower layers hold inside them is gone. The file lies next
  to `deleted.files` (see `common.opaque_dirs_path`) and is only written when
  the list is not empty, so `deleted.files` stays a plain list that other
  tools read unchanged, and tools that do not know `opaque.dirs` ignore it.

Sockets and device files other than whiteouts are not captured; they are
reported in `DiffStats.skipped`. Upperdirs that use overlayfs metacopy or
redirect_dir are refused, since their data or names live in the lower layers.

`apply.apply_diff` treats the tar and both lists as hostile. It resolves
every parent directory one component at a time from a descriptor of the
rootfs with O_NOFOLLOW (`tree`), creates entries relative to that
descriptor, never follows a symlink in a path, never crosses into another
filesystem, and rejects (InvalidInput) absolute names, "..", NUL bytes,
devices, hardlinks to anything but a regular file extracted from the same
archive, conflicting duplicates and every bound of `DiffLimits`. It reads the
tar with the strict parser of `criu_bridge.tarstream` (ustar, PAX and GNU
long names) rather than tarfile; the capture writes it with
`criu_bridge.tarwrite`.

Modules: `common` (limits, stats, paths from hostile input, the block copy),
`capture`, `tree` (descriptors and removal below the rootfs), `apply`.
"""
