"""The code a Slurm job runs: a copy of the checkout's tracked files, made when the job is submitted.

A job may wait in the queue for hours and requeue days later; a checkout edited meanwhile would otherwise
be what it imports. So, where taehv_slurm is imported from a git work tree (`pip install -e .`), `submit`
copies that tree's tracked files — as they are in the work tree, uncommitted changes included; untracked
and ignored files (data, runs, virtual environments) never — once into

    <job_dir>/code/<digest>/        the files, and SNAPSHOT_FILE: the commit, dirty or not, the diff

named by a digest of their paths, modes and contents (a sweep's runs, and every submit of unchanged code,
share one copy), and the job's batch script puts it first on PYTHONPATH: the batch script's own steps and
every attempt of every rank import the submitted code. `code_snapshot: false` (`taehv submit
--no-snapshot`) runs the checkout as it is when each attempt starts. An installed package (a wheel) has no
tree: nothing to copy, its version says what ran. The nodes' Python must be 3.11 or later (PYTHONSAFEPATH):
on 3.10 a job started from the checkout's folder imports the checkout, as each attempt's record then shows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import taehv_slurm
from taehv_slurm.backends import backend_named
from taehv_slurm.common.config import ClusterConfig, ConfigError
from taehv_slurm.common.runfolder import JobDir
from taehv_slurm.common.security import make_private_dir, private_umask
from taehv_slurm.runtime.provenance import SNAPSHOT_FILE, code_state

SNAPSHOT_LIMIT_BYTES = 512 << 20  # tracked files beyond this are a data set in git, not code to copy


class SnapshotError(ConfigError):
    """The checkout cannot be copied; the message is one line with the fix."""


@dataclass(frozen=True)
class Tree:
    """A git work tree's tracked files, as they are now."""

    top: Path
    files: tuple[str, ...]  # relative paths, present in the work tree
    digest: str

    def import_root(self, job_dir: str | os.PathLike) -> Path:
        """The folder the job puts first on PYTHONPATH: the copy's counterpart of the one holding
        taehv_slurm."""
        package_parent = Path(taehv_slurm.__file__).resolve().parents[1]
        return snapshot_dir(job_dir, self.digest) / package_parent.relative_to(self.top)


def snapshot_dir(job_dir: str | os.PathLike, digest: str) -> Path:
    return JobDir(os.path.abspath(job_dir)).code / digest


def checkout() -> Tree | None:
    """The work tree taehv_slurm is imported from, with its tracked files' digest; None for an installed
    package (no tree) or where git is missing."""
    package = Path(taehv_slurm.__file__).resolve().parent
    try:
        top = Path(_git(package, "rev-parse", "--show-toplevel").strip())
        listed = _git(top, "ls-files", "-z", "--cached").split("\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    digest, files, size = hashlib.sha256(), [], 0
    for name in sorted(n for n in listed if n):
        path = top / name
        if not os.path.lexists(path) or path.is_dir():  # deleted in the tree, or a submodule
            continue
        info = path.lstat()
        data = os.readlink(path).encode() if stat.S_ISLNK(info.st_mode) else path.read_bytes()
        size += len(data)
        if size > SNAPSHOT_LIMIT_BYTES:
            raise SnapshotError(f"the checkout {top} tracks more than {SNAPSHOT_LIMIT_BYTES >> 20} MB of "
                                "files: keep data out of git, or set code_snapshot: false (--no-snapshot) to "
                                "run the checkout as it is when the job starts")
        digest.update(f"{name}\0{info.st_mode & 0o111:o}\0{len(data)}\0".encode() + data)
        files.append(name)
    return Tree(top, tuple(files), digest.hexdigest()[:16])


def make(tree: Tree, job_dir: str | os.PathLike, group: str | None = None) -> Path:
    """Copy the tree's tracked files to <job_dir>/code/<digest> (once: an existing copy is complete, as it
    appears by one rename); returns the folder the job puts on PYTHONPATH."""
    target = snapshot_dir(job_dir, tree.digest)
    if not (target / SNAPSHOT_FILE).exists():
        make_private_dir(target.parent, group)
        staging = Path(tempfile.mkdtemp(prefix=".copy-", dir=target.parent))
        try:
            # private as the rest of the run folders (docs/security.md): files 0600 and folders 0700, or
            # group-readable with `group`; no exec bits (the job runs its Python with `python -m`)
            make_private_dir(staging, group)
            with private_umask(group):
                for name in tree.files:
                    source, dest = tree.top / name, staging / name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    if source.is_symlink():
                        os.symlink(os.readlink(source), dest)
                    else:
                        shutil.copyfile(source, dest)
                state = code_state(tree.top)
                (staging / SNAPSHOT_FILE).write_text(json.dumps({**state, "digest": tree.digest}) + "\n")
            os.rename(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not (target / SNAPSHOT_FILE).exists():  # else another submit made the same copy first
                raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return tree.import_root(job_dir)


def untracked_modules(tree: Tree) -> list[str]:
    """Python files in the tree that git does not track (nor ignore): not in the copy, so a job that imports
    one fails."""
    try:
        listed = _git(tree.top, "ls-files", "-z", "--others", "--exclude-standard", "--", "*.py")
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(n for n in listed.split("\0") if n)


def job_env(cluster: ClusterConfig, copy: bool = True) -> dict[str, str]:
    """The environment that makes a job of `cluster` import the submitted code: PYTHONPATH with the copy first
    ({} for a local job, `code_snapshot: false`, or an installed package). copy=False: where the copy would
    be (a dry run), nothing written."""
    if not (cluster.code_snapshot and backend_named(cluster.backend).writes_sbatch_script):
        return {}
    tree = checkout()
    if tree is None:
        return {}
    root = make(tree, cluster.job_dir, cluster.group) if copy else tree.import_root(cluster.job_dir)
    # PYTHONSAFEPATH: `python -m` puts the folder it starts in (where the job was submitted from, often the
    # checkout itself) before PYTHONPATH, unless told not to (Python 3.11 and later)
    return {"PYTHONPATH": pythonpath(root), "PYTHONSAFEPATH": "1"}


def pythonpath(root: Path) -> str:
    """PYTHONPATH for the job: the copy first, then what the submitting environment had."""
    return os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])


def _git(where: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, check=True,
                          timeout=30).stdout
