"""Safe on a shared cluster: private folders, and no loading of files that others can write.

submitit executes the pickle it finds in the job folder and `torch.load` of a checkpoint can execute
code, so a folder another user can write is a way into our user's account. Folders we create are
owner-only (or group-readable when the cluster config names a shared group); before anything is
loaded, `check_safe_to_load` refuses files or folders that others could have written.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
GROUP_DIR_MODE = 0o750  # group may read (e.g. a project group looking at metrics), never write
PRIVATE_FILE_MODE = 0o600


class UnsafePathError(PermissionError):
    """A file or folder we were about to load from could have been written by another user."""


def make_private_dir(path: str | os.PathLike, group: str | None = None) -> Path:
    """Create `path` (and parents) owner-only, or owner-write/group-read with `group`; fix its mode if it exists."""
    path = Path(path)
    old = os.umask(0o077)
    try:
        path.mkdir(parents=True, exist_ok=True)
    finally:
        os.umask(old)
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise UnsafePathError(f"group {group!r} (cluster config 'group') does not exist on this machine") from None
        os.chown(path, -1, gid)
        os.chmod(path, GROUP_DIR_MODE | stat.S_ISGID)
    else:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def check_safe_to_load(path: str | os.PathLike, root: str | os.PathLike | None = None) -> None:
    """Refuse to load `path` unless it and every folder from `root` down to it belong to this user and
    are writable by nobody else; folders above `root` must not be writable by others (sticky /tmp is fine).

    Raises UnsafePathError with one line naming the path and the fix.
    """
    path = Path(path).absolute()
    root_path = Path(root).absolute() if root is not None else path.parent
    uid = os.geteuid()
    inside = [path] + [p for p in path.parents if p == root_path or root_path in p.parents]
    for item in inside:
        try:
            st = item.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(f"refusing to load {path}: {item} is a symbolic link; replace it with the real file or folder")
        if st.st_uid != uid:
            raise UnsafePathError(
                f"refusing to load {path}: {item} belongs to uid {st.st_uid}, not to you (uid {uid}); "
                f"copy what you trust into a folder of your own"
            )
        if st.st_mode & 0o022:
            raise UnsafePathError(
                f"refusing to load {path}: {item} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod go-w {item}` if you trust its contents"
            )
    for item in root_path.parents:
        st = item.stat()
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UnsafePathError(
                f"refusing to load {path}: {item} is writable by everyone without the sticky bit "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod o-w {item}` or move the run folder"
            )


def write_private(path: str | os.PathLike, data: bytes | str) -> None:
    """Write a file readable by its owner only (created with that mode: never briefly public)."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
