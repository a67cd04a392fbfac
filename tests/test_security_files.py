"""Safe on a shared cluster (1 of 2): private folders, and nothing loaded that others could write.

Real files and modes, a real unprivileged user, a real Slurm job: the folders the library makes are private
(or shared read-only with a group), and the job's entry point, submit() and the checkpointer refuse a pickle
or checkpoint that another user could have written or swapped, in one line that says what to do.
tests/test_security_jobs.py has the other half: secrets and files of real jobs, the bounded rendezvous.

The permission checks run as the unprivileged user `taehvtest` (tests/security_helpers.py).
"""

from __future__ import annotations

import functools
import grp
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taehv_slurm.common.runfolder import JobDir, RunFolder
from taehv_slurm.common.security import UnsafePathError, check_safe_to_load
from taehv_slurm.executor import make_executor
from taehv_slurm.runtime.checkpoint import Checkpointer, CheckpointError
from taehv_slurm.submission import submit
from tests.helpers import LOCAL_TASK_ENV, REPO, make_cluster, wait_done
from tests.security_helpers import TEST_USER, User, mode, one_line, unprivileged_user

BACKTICKED = re.compile(r"`([^`]+)`")


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    """The unprivileged test user, with a private home folder for this module."""
    yield from unprivileged_user("tests/test_security_files.py")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------- folder modes

MODES = """
import json, os, stat, sys
from pathlib import Path
from taehv_slurm.common.security import UnsafePathError, make_private_dir, write_private
base, group, foreign = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
os.umask(0o022)  # a usual login umask: the library must not depend on the caller's
m = lambda p: stat.S_IMODE(os.stat(p).st_mode)
out = {}
leaf = make_private_dir(base / "private" / "a" / "b")
out["private"] = [m(base / "private"), m(base / "private" / "a"), m(leaf)]
shared = make_private_dir(base / "shared" / "run", group)
out["group"] = [[m(p), os.stat(p).st_gid] for p in (base / "shared", shared)]
(base / "loose").mkdir()
os.chmod(base / "loose", 0o777)
try:  # files another user put there first would be read: refused, not silently tightened
    make_private_dir(base / "loose")
    out["loose"] = None
except UnsafePathError as err:
    out["loose"] = str(err)
out["loose_mode"] = m(base / "loose")
(base / "mine").mkdir(mode=0o755)
make_private_dir(base / "mine")
out["tightened"] = m(base / "mine")
write_private(base / "private" / "note", "x")
out["file"] = m(base / "private" / "note")
for name, call in {"foreign": lambda: make_private_dir(foreign),
                   "not_member": lambda: make_private_dir(base / "x", "root"),
                   "no_group": lambda: make_private_dir(base / "y", "no-such-group-taehv")}.items():
    try:
        call()
        out[name] = None
    except UnsafePathError as err:
        out[name] = str(err)
print(json.dumps(out))
"""


def test_folder_modes_as_documented(user: User) -> None:
    base = user.home / "modes"
    base.mkdir()
    user.chown(base)
    foreign = base / "roots"  # a folder of another user (root) inside the user's own
    foreign.mkdir(mode=0o755)
    out = user.python(MODES, base, grp.getgrgid(user.gid).gr_name, foreign)
    assert out["private"] == [0o700] * 3  # parents it creates too
    assert out["group"] == [[0o2750, user.gid]] * 2  # 0750 + setgid: new files keep the group
    assert out["tightened"] == 0o700 and out["file"] == 0o600
    assert one_line(out["loose"]).startswith(f"{base / 'loose'} can be written by every user (mode 0777): ")
    assert out["loose_mode"] == 0o777  # untouched
    assert one_line(out["foreign"]).startswith(f"cannot make {foreign} private: "
                                               "it belongs to root (uid 0), not to you")
    assert mode(foreign) == 0o755  # untouched
    assert "group 'root': you are not a member of it" in one_line(out["not_member"])
    assert "group 'no-such-group-taehv'" in one_line(out["no_group"]) and "does not exist" in out["no_group"]


# -------------------------------------------------------- the entry point before submitit loads

MAKE_JOB_FOLDER = """
import json, os, sys
from pathlib import Path
from submitit.helpers import DelayedSubmission
from taehv_slurm.common.security import make_private_dir, private_umask
case = Path(sys.argv[1])
folder = make_private_dir(case / "above" / "run" / "submitit")
with private_umask():  # as submit() writes it
    DelayedSubmission(os.mkdir, str(case / "ran")).dump(folder / "4242_submitted.pkl")
print(json.dumps(str(folder)))
"""

# What makes the job folder unsafe: (path relative to the case folder, new mode), or "foreign".
WEAKNESSES = {
    "run folder world-writable": ("above/run", 0o777),
    "submitit folder group-writable": ("above/run/submitit", 0o770),
    "pickle writable by others": ("above/run/submitit/4242_submitted.pkl", 0o666),
    "folder above world-writable, not sticky": ("above", 0o777),
    "pickle of another user": "foreign",
}


@pytest.mark.parametrize("weakness", list(WEAKNESSES))
def test_entry_refuses_a_job_folder_others_could_write(user: User, weakness: str) -> None:
    case = user.home / "entry" / re.sub(r"\W+", "-", weakness)
    case.mkdir(parents=True)
    user.chown(case.parent, case)
    folder = Path(user.python(MAKE_JOB_FOLDER, case))
    pickle = folder / "4242_submitted.pkl"
    what = WEAKNESSES[weakness]
    if what == "foreign":  # another user's pickle in its place (root can put it there)
        os.chown(pickle, 0, 0)
        os.chmod(pickle, 0o644)
    else:
        os.chmod(case / what[0], what[1])
    before = sha256(pickle)

    # as submit() starts it
    entry = [sys.executable, "-m", "taehv_slurm.runtime.entry", str(folder), str(folder.parent)]
    out = user.run(entry, LOCAL_TASK_ENV)
    assert out.returncode == 2, out.stderr
    message = one_line(out.stderr)
    assert message.startswith(f"[taehv] refusing to load {pickle}: ")
    assert not (case / "ran").exists(), "the refused pickle ran"
    assert sha256(pickle) == before and not list(folder.glob("*_result.pkl"))  # nothing lost, nothing written
    if what == "foreign":
        assert message.endswith(f"{pickle} belongs to root (uid 0), not to you ({TEST_USER}); "
                                "copy what you trust into a folder of your own")
        return
    weak = case / what[0]
    fix = BACKTICKED.search(message).group(1)
    assert fix == (f"chmod o-w {weak}" if "sticky" in weakness else f"chmod go-w {weak}")
    assert user.run(["sh", "-c", fix]).returncode == 0
    done = user.run(entry, LOCAL_TASK_ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (case / "ran").is_dir()  # the same pickle runs once the folder is safe
    assert mode(folder / "4242_0_result.pkl") == 0o600  # written under the entry point's umask


MAKE_EXECUTOR_FOLDER = """
import json, os, sys, tempfile
from pathlib import Path
from submitit.helpers import DelayedSubmission
from taehv_slurm.common.security import private_umask
folder = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp())  # as `mktemp -d`: 0700 in /tmp
folder.mkdir(mode=0o700, exist_ok=True)
with private_umask():
    DelayedSubmission(os.mkdir, str(folder / sys.argv[1])).dump(folder / "4242_submitted.pkl")
print(json.dumps(str(folder)))
"""


def test_an_executor_folder_made_by_mktemp_runs(user: User) -> None:
    # make_executor(cluster, folder) with a folder of the user's own inside the sticky /tmp: the folder
    # itself is what the run owns; /tmp above it is world-writable but sticky, so nobody can swap it.
    folder = Path(user.python(MAKE_EXECUTOR_FOLDER, "ran"))
    try:
        assert folder.parent == Path(tempfile.gettempdir()) and mode(folder.parent) & stat.S_ISVTX
        out = user.run([sys.executable, "-m", "taehv_slurm.runtime.entry", str(folder)], LOCAL_TASK_ENV)
        assert out.returncode == 0, out.stderr[-2000:]
        assert (folder / "ran").is_dir()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_no_advice_to_change_a_folder_that_is_not_the_users(user: User) -> None:
    # A folder of another user (root) that everyone may write, without the sticky bit: refused, and the
    # message says to move the run folder — never to chmod a folder the user does not own.
    open_dir = Path(tempfile.mkdtemp(prefix="taehv-open-"))
    try:
        os.chmod(open_dir, 0o777)
        mine = open_dir / "mine"
        mine.mkdir(mode=0o700)
        user.chown(mine)
        folder = Path(user.python(MAKE_EXECUTOR_FOLDER, "ran", mine / "exec"))
        out = user.run([sys.executable, "-m", "taehv_slurm.runtime.entry", str(folder)], LOCAL_TASK_ENV)
        assert out.returncode == 2 and not (folder / "ran").exists()
        message = one_line(out.stderr)
        assert f"{open_dir} is writable by everyone without the sticky bit (mode 0777)" in message
        assert "move the run folder out of it" in message and f"{open_dir} belongs to root (uid 0)" in message
        assert "chmod" not in message
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


def test_a_real_slurm_job_refuses_and_submit_refuses_first(slurm_cluster, tmp_path: Path) -> None:
    # A folder above the run folder that everyone may write (no sticky bit): anyone could have
    # swapped the run folder, so the job must not load what it finds there.
    above = tmp_path / "open"
    folder = above / "run" / "submitit"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(above, 0o777)
    cluster = make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=5)
    marker = tmp_path / "ran"
    job = make_executor(cluster, folder).submit(functools.partial(os.mkdir, str(marker)))
    assert wait_done(str(job.job_id), 120) == "FAILED"
    log = (folder / f"{job.job_id}_0_log.out").read_text()
    pickle = folder / f"{job.job_id}_submitted.pkl"
    refusals = [line for line in log.splitlines() if line.startswith("[taehv] ")]
    assert refusals == [f"[taehv] refusing to load {pickle}: {above} is writable by everyone "
                        "without the sticky bit "
                        f"(mode 0777); run `chmod o-w {above}` or move the run folder"], log
    assert pickle.is_file() and not marker.exists()
    # submit() checks the same before sbatch: nothing is queued that would refuse to start
    with pytest.raises(UnsafePathError) as err:
        submit(functools.partial(os.mkdir, str(marker)),
               make_cluster(above / "jobs", nodes=1, gpus_per_node=1), "r",
               requeueable=False)
    assert f"{above} is writable by everyone without the sticky bit" in one_line(str(err.value))
    assert not list((above / "jobs").rglob("*.pkl")) and not JobDir(above / "jobs").registry.exists()


def test_a_symbolic_link_on_the_way_is_refused(tmp_path: Path) -> None:
    from taehv_slurm.common.security import check_safe_to_load, make_private_dir

    run = make_private_dir(tmp_path / "run")
    elsewhere = make_private_dir(tmp_path / "elsewhere")
    (elsewhere / "4242_submitted.pkl").write_bytes(b"x")
    RunFolder(run).submitit.symlink_to(elsewhere)
    with pytest.raises(UnsafePathError) as err:
        check_safe_to_load(RunFolder(run).submitit / "4242_submitted.pkl", run)
    assert one_line(str(err.value)).endswith(f"{RunFolder(run).submitit} is a symbolic link; "
                                             "replace it with the real file or folder")


# ----------------------------------------------------------------------------- checkpoints

CHECKPOINT_LOADS = """
import hashlib, json, os, re, subprocess, sys
from pathlib import Path
import torch
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.common.security import UnsafePathError, describe_secret_env
base, planted, theirs = (Path(a) for a in sys.argv[1:4])
run = base / "run"
ck = Checkpointer(RunFolder(run).checkpoints, trust_root=run)
ck.save({"w": torch.arange(4.0)}, 1, {"note": "mine"})
state = RunFolder(run).checkpoints / "step_00000001" / "state.pt"
digest = lambda: hashlib.sha256(state.read_bytes()).hexdigest()
def attempt(c):
    try:
        return c.load_latest()[0]
    except UnsafePathError as err:
        return str(err)
out = {"own": attempt(ck)}
before = digest()
os.chmod(run, 0o777)
out["world_writable"] = attempt(ck)
out["kept"] = digest() == before and ck.latest_step() == 1
subprocess.run(re.search(r"`([^`]+)`", out["world_writable"]).group(1), shell=True, check=True)
out["after_fix"] = attempt(ck)
out["planted"] = attempt(Checkpointer(RunFolder(planted).checkpoints, trust_root=planted))
out["theirs"] = attempt(Checkpointer(theirs))
print(json.dumps(out))
"""


def test_folders_above_the_run_are_checked_as_written_and_with_links_resolved(tmp_path: Path) -> None:
    """A folder everyone may write (no sticky bit) above the run folder is refused whether it lies on the
    path as written (anyone could swap the link below it) or on the path the links resolve to (anyone
    could swap the run folder itself); a path with neither loads."""
    safe, open_dir = tmp_path / "safe", tmp_path / "open"
    for folder in (safe / "real" / "run", open_dir / "inner" / "run"):
        folder.mkdir(parents=True, mode=0o700)
        (folder / "state.pt").write_bytes(b"x")
        os.chmod(folder / "state.pt", 0o600)
    os.chmod(open_dir, 0o777)
    # written through safe folders only, lying below the open one
    (safe / "link").symlink_to(open_dir / "inner")
    # written through the open folder, lying in safe ones
    (open_dir / "door").symlink_to(safe / "real")
    for run in (safe / "link" / "run", open_dir / "door" / "run"):
        with pytest.raises(UnsafePathError) as err:
            check_safe_to_load(run / "state.pt", run)
        assert one_line(str(err.value)) == (
            f"refusing to load {run / 'state.pt'}: {open_dir} is writable by everyone without the sticky bit "
            f"(mode 0777); run `chmod o-w {open_dir}` or move the run folder")
    check_safe_to_load(safe / "real" / "run" / "state.pt", safe / "real" / "run")


def test_checkpoint_load_refuses_writable_or_foreign_files(user: User) -> None:
    import torch

    base = user.home / "ck"
    base.mkdir()
    user.chown(base)
    # planted: the user's run folder, but state.pt is another user's (root's) file
    planted = base / "planted"
    Checkpointer(RunFolder(planted).checkpoints).save({"w": torch.zeros(2)}, 3)
    for path in [planted, *planted.rglob("*")]:
        if path.name != "state.pt":
            user.chown(path)
    # theirs: a colleague's checkpoint they made readable (root's, 0755/0644)
    theirs = base / "theirs"
    Checkpointer(theirs).save({"w": torch.ones(2)}, 5)
    for path in [theirs, *theirs.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)

    out = user.python(CHECKPOINT_LOADS, base, planted, theirs)
    assert out["own"] == 1 and out["after_fix"] == 1 and out["kept"] is True
    run = base / "run"
    assert one_line(out["world_writable"]) == (
        f"refusing to load {run}/checkpoints/step_00000001/state.pt: {run} is writable by group or others "
        f"(mode 0777); run `chmod go-w {run}` if you trust its contents")
    state = RunFolder(planted).checkpoints / "step_00000003" / "state.pt"
    assert one_line(out["planted"]).startswith(f"refusing to load {state}: "
                                               f"{state} belongs to root (uid 0), not to you")
    assert "copy what you trust into a folder of your own" in out["planted"]
    theirs_state = theirs / "step_00000005" / "state.pt"
    assert one_line(out["theirs"]).startswith(f"refusing to load {theirs_state}: "
                                              f"{theirs_state} belongs to root (uid 0)")


class _RunsCode:
    """Pickles as a call to os.mkdir: what a malicious state.pt would do on an unrestricted load."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


def documented_checkpoint_errors(checkpoints: Path) -> list[str]:
    """docs/security.md's CheckpointError lines (a Python object; a damaged file), `$CK` as `checkpoints`."""
    text = (REPO / "docs" / "security.md").read_text()
    return [line.removeprefix("CheckpointError: ").replace("$CK", str(checkpoints))
            for line in text.splitlines() if line.startswith("CheckpointError: ")]


def test_checkpoints_load_weights_only_with_our_own_message(tmp_path: Path) -> None:
    import torch

    ck = Checkpointer(tmp_path / "ck")
    ck.save({"w": torch.ones(3), "step": 7, "rng": [{"seed": 1}]}, 7, {"config": {"lr": 1e-4}})
    folder = tmp_path / "ck" / "step_00000007"
    assert json.loads((folder / "meta.json").read_text())["config"] == {"lr": 1e-4}  # non-tensor state: JSON
    marker = tmp_path / "code-ran"
    torch.save({"w": torch.ones(3), "payload": _RunsCode(marker)}, folder / "state.pt")
    # Whoever can write state.pt can write meta.json too: the checksum finds accidents, not attacks
    meta = json.loads((folder / "meta.json").read_text())
    planted = (folder / "state.pt").read_bytes()
    meta["files"]["state.pt"] = {"bytes": len(planted), "sha256": hashlib.sha256(planted).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as err:
        ck.load(7)
    message = one_line(str(err.value))
    assert not marker.exists() and (folder / "state.pt").is_file()
    python_object, damaged = documented_checkpoint_errors(tmp_path / "ck")  # docs/security.md's lines
    assert message == python_object
    for damage in (b"not a checkpoint", (folder / "state.pt").read_bytes()[:200], b""):
        (folder / "state.pt").write_bytes(damage)
        with pytest.raises(CheckpointError) as err:
            ck.load(7)
        message = one_line(str(err.value))  # the recorded size finds each before torch reads it
        assert "weights_only" not in message
        assert f"state.pt has {len(damage)} bytes, {len(planted)} were written" in message
    # The same size, and the checksum rewritten with it: torch's load is what fails.
    overwritten = (b"not a checkpoint " * len(planted))[:len(planted)]
    (folder / "state.pt").write_bytes(overwritten)
    meta["files"]["state.pt"] = {"bytes": len(overwritten), "sha256": hashlib.sha256(overwritten).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as err:
        ck.load(7)
    assert one_line(str(err.value)) == damaged
    # Resuming moves the unloadable checkpoint aside (never runs it, never deletes it)
    assert ck.load_latest() is None and not marker.exists()
    assert ([p.name.split(".")[0] for p in (tmp_path / "ck").iterdir() if ".damaged-" in p.name]
            == ["step_00000007"])
