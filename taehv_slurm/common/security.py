"""Safe on a shared cluster: private folders, and no loading of files that others can write.

submitit executes the pickle it finds in the job folder and `torch.load` of a checkpoint can execute
code, so a folder another user can write is a way into our user's account. Folders we create are
owner-only (or group-readable when the cluster config names a shared group); files are created under
an owner-only umask; before anything is loaded, `check_safe_to_load` refuses files or folders that
others could have written. docs/security.md lists what this guarantees and what the cluster must provide.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from taehv_slurm.common.config import ClusterConfig

PRIVATE_DIR_MODE = 0o700
# group may read (e.g. a project group looking at metrics), never write; setgid: new files keep the group
GROUP_DIR_MODE = 0o2750
PRIVATE_FILE_MODE = 0o600
PRIVATE_UMASK = 0o077  # files 0600, folders 0700
GROUP_UMASK = 0o027  # files 0640, folders 0750


class UnsafePathError(PermissionError):
    """A file or folder we were about to load from could have been written by another user."""


def umask_for(group: str | None) -> int:
    """The umask under which a run's files are created: owner-only, or group-readable with a shared group."""
    return GROUP_UMASK if group else PRIVATE_UMASK


@contextlib.contextmanager
def private_umask(group: str | None = None) -> Iterator[None]:
    """Create files owner-only (group-readable with `group`) inside the block.

    Around sbatch this also makes Slurm create the job's log files with that mode: sbatch records
    the submitting umask (SLURM_UMASK) and slurmstepd opens the output files under it.
    """
    old = os.umask(umask_for(group))
    try:
        yield
    finally:
        os.umask(old)


def make_private_dir(path: str | os.PathLike, group: str | None = None) -> Path:
    """Create `path` (and missing parents) owner-only (0700), or 2750 with `group`; tighten it if it exists.

    Raises UnsafePathError (one line) for a folder that belongs to another user or a group the user
    is not in, or an existing one that others may write: such a folder cannot be made private, so
    nothing is written into it.
    """
    path = Path(path)
    gid = _group_id(group) if group else None
    created = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    if path not in created:
        check_not_shared_writable(path)
    with private_umask(None):  # never briefly more open than 0700, whatever the caller's umask
        path.mkdir(parents=True, exist_ok=True)
    # created parents too: the group must traverse them
    for folder in [path, *[p for p in created if p != path]]:
        _restrict(folder, gid)
    return path


def check_not_shared_writable(folder: Path) -> None:
    """Refuse (one line, nothing changed) an existing folder that others may write: it is never tightened
    silently, as files someone else put there before would still be read."""
    if who := others_can_write(folder):
        raise UnsafePathError(f"{folder} can be written by {who}: another user could put files there "
                              "that the jobs would read; use a folder only you can write as job_dir "
                              f"(e.g. mkdir -m 700 {folder / _name(os.geteuid())})")


def others_can_write(folder: str | os.PathLike) -> str | None:
    """Who besides its owner may write into `folder` ('every user (mode 1777)', 'group staff (mode
    2770)'), or None. The sticky bit does not help here: others may still add files."""
    st = os.stat(folder)
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_mode & stat.S_IWOTH:
        return f"every user ({mode})"
    if st.st_mode & stat.S_IWGRP:
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        return f"group {group} ({mode})"
    return None


def _group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise UnsafePathError(f"group {group!r} (cluster config 'group') does not exist on this machine; "
                              "set group to one `id -Gn` lists, "
                              "or remove it to keep run folders owner-only") from None


def _restrict(folder: Path, gid: int | None) -> None:
    st = folder.stat()
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"cannot make {folder} private: it belongs to {describe_user(st.st_uid)}, "
                              "not to you; "
                              f"use a folder of your own (e.g. {folder / _name(os.geteuid())}) as job_dir")
    if gid is None:
        os.chmod(folder, PRIVATE_DIR_MODE)
        return
    try:
        os.chown(folder, -1, gid)
    except PermissionError:
        name = grp.getgrgid(gid).gr_name
        raise UnsafePathError(f"cannot give {folder} to group {name!r}: you are not a member of it; "
                              "set group in "
                              "the cluster config to one `id -Gn` lists") from None
    os.chmod(folder, GROUP_DIR_MODE)


def check_safe_to_load(path: str | os.PathLike, root: str | os.PathLike | None = None) -> None:
    """Refuse to load `path` unless it could only have been written by this user.

    One rule for every load (a job's pickle, a checkpoint): `root` is the folder the run owns (default:
    the folder holding `path`); it and everything inside it down to `path` must belong to this user and
    be writable by nobody else. Folders above `root` may be anyone's, but one that everyone may write
    without the sticky bit (/tmp has it) is refused: anyone could have swapped what lies below it. Both
    are checked as written and with symbolic links resolved.

    Raises UnsafePathError with one line naming the path and the fix; nothing is changed or deleted,
    and no message advises changing a folder that is not this user's.
    """
    path = Path(path).absolute()
    root_path = Path(root).absolute() if root is not None else path.parent
    uid = os.geteuid()
    inside = [path] + [p for p in path.parents if p == root_path or root_path in p.parents]
    for item in inside:
        try:
            st = item.lstat()
        except FileNotFoundError:
            continue  # the loader reports a missing file itself
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(f"refusing to load {path}: {item} is a symbolic link; "
                                  "replace it with the real file or folder")
        if st.st_uid != uid:
            raise UnsafePathError(
                f"refusing to load {path}: {item} belongs to {describe_user(st.st_uid)}, "
                f"not to you ({_name(uid)}); "
                "copy what you trust into a folder of your own"
            )
        if st.st_mode & 0o022:
            raise UnsafePathError(
                f"refusing to load {path}: {item} is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod go-w {item}` if you trust its contents"
            )
    above = dict.fromkeys([*root_path.parents, *root_path.resolve().parents])
    for item in above:
        st = item.stat()
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            fix = (f"run `chmod o-w {item}` or move the run folder" if st.st_uid == uid else
                   f"move the run folder out of it (job_dir, or the executor folder) "
                   f"to a folder of your own; "
                   f"{item} belongs to {describe_user(st.st_uid)}")
            raise UnsafePathError(f"refusing to load {path}: {item} is writable by everyone "
                                  "without the sticky bit "
                                  f"(mode {stat.S_IMODE(st.st_mode):04o}); {fix}")


def write_private(path: str | os.PathLike, data: bytes | str) -> None:
    """Write a file readable by its owner only (created with that mode: never briefly public)."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)


def describe_secret_env(cluster: ClusterConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """One line for `--dry-run`: the secret env names the job will get (values masked), and where from.

    They reach the job through sbatch's environment (--export=ALL, Slurm's default), never a file.
    """
    environ = os.environ if environ is None else environ
    parts = []
    for name in sorted(cluster.secret_names()):
        if cluster.env.get(name, "***") != "***":
            parts.append(f"{name}=*** (cluster config)")
        elif name in environ:
            parts.append(f"{name}=*** (your environment)")
        else:
            parts.append(f"{name} (not set: the job will not have it)")
    if not parts:
        return None
    line = "secret env (passed through sbatch's environment, never written to a file): " + ", ".join(parts)
    # sbatch --export without ALL (from sbatch_args or SBATCH_EXPORT) passes only the names it lists.
    export = cluster.sbatch_args.get("export") or environ.get("SBATCH_EXPORT")
    listed = {part.split("=", 1)[0].strip() for part in (export or "").split(",")}
    left_out = sorted(n for n in cluster.secret_names() if n not in listed)
    if export and "ALL" not in {p.upper() for p in listed} and left_out:
        line += (f"; but sbatch --export={export} leaves out {', '.join(left_out)}: "
                 "add ALL or those names to it")
    return line


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def describe_user(uid: int) -> str:
    """'alice (uid 1001)', or 'uid 1001' for a uid without a name here."""
    name = _name(uid)
    return f"{name} (uid {uid})" if name != str(uid) else f"uid {uid}"
