"""Issue 11, safe on a shared cluster: real files and modes, a real unprivileged user, real Slurm jobs.

The permission checks run as the unprivileged user `taehvtest` (created here, or by scripts/setup.sh),
through `setpriv` with one capability, CAP_DAC_READ_SEARCH: it lets the process read the interpreter
wherever it is installed (e.g. under a 0700 /root) and nothing else; it cannot write, chown or chmod
what is not its own, so writes, ownership and our checks behave exactly as for any user.

The Slurm jobs (1 node x 1 task, two steps of the tiny config) are submitted by the first test and run
while the others do: one private run carrying three secrets (named like a secret, listed in
`secret_env`, and only in the submitting environment), one run shared read-only with a group.
"""

from __future__ import annotations

import functools
import grp
import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from taehv_slurm.checkpoint import Checkpointer, CheckpointError
from taehv_slurm.config import load_cluster
from taehv_slurm.distenv import PORT_BASE, PORT_SPAN, DistEnv, port_for_job
from taehv_slurm.executor import make_executor
from taehv_slurm.handle import JobHandle
from taehv_slurm.requeue import RequeueableTask
from taehv_slurm.security import UnsafePathError, describe_secret_env
from taehv_slurm.submission import submit
from tests.helpers import LOCAL_TASK_ENV, REPO, make_cluster, tiny_train, wait_done

TEST_USER = "taehvtest"
SECRET_NAMED = "TAEHV_SECTEST_API_TOKEN"  # a secret by its name (TOKEN)
SECRET_LISTED = "TAEHV_SECTEST_OPAQUE"  # a secret because secret_env lists it
SECRET_SHELL = "TAEHV_SECTEST_SHELL_ONLY"  # listed in secret_env, set only in the submitting environment
PUBLIC = "TAEHV_SECTEST_PUBLIC"
BACKTICKED = re.compile(r"`([^`]+)`")


# ------------------------------------------------------------------------------ the test user


@dataclass
class User:
    """The unprivileged user, and a private temporary folder of its own."""

    name: str
    uid: int
    gid: int
    home: Path  # owned by the user, 0700, under the system's temporary folder

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run `argv` as the user (its own uid, gid and groups; no privilege but reading)."""
        environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "LANG": "C.UTF-8",
                   "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
        command = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
                   "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--", *argv]
        return subprocess.run(command, env=environ, cwd=self.home, capture_output=True, text=True, timeout=timeout)

    def python(self, code: str, *args: str | os.PathLike, env: Mapping[str, str] | None = None) -> Any:
        """Run `code` as the user; it prints one JSON value on its last line, returned here."""
        out = self.run([sys.executable, "-c", code, *map(str, args)], env)
        assert out.returncode == 0, f"as {self.name}: {out.stderr[-3000:]}"
        return json.loads(out.stdout.strip().splitlines()[-1])

    def chown(self, *paths: Path) -> None:
        for path in paths:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:
        if os.geteuid() != 0:
            pytest.fail(f"user {TEST_USER} is missing: run `bash scripts/setup.sh` as root (it creates it)", pytrace=False)
        subprocess.run(["useradd", "-m", TEST_USER], check=True, capture_output=True)
        entry = pwd.getpwnam(TEST_USER)
    if os.geteuid() != 0:
        pytest.fail("tests/test_security.py switches to the test user: run it as root, as CI does", pytrace=False)
    home = Path(tempfile.mkdtemp(prefix="taehv-security-"))
    os.chown(home, entry.pw_uid, entry.pw_gid)
    who = User(TEST_USER, entry.pw_uid, entry.pw_gid, home)
    facts = who.python("import json, os; print(json.dumps([os.geteuid(), os.access('/', os.W_OK)]))")
    assert facts == [entry.pw_uid, False], f"not an unprivileged process: {facts}"
    try:
        yield who
    finally:
        shutil.rmtree(home, ignore_errors=True)


def one_line(message: str) -> str:
    assert message and "\n" not in message.strip(), f"not one line: {message!r}"
    return message.strip()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------- the real Slurm jobs (begin)


class EnvProbe:
    """Runs a trainer callable and reports what the job saw, never the secrets themselves:
    a sha256 per variable (None when unset), the rendezvous port and the umask."""

    def __init__(self, task: Any, names: Sequence[str]) -> None:
        self.task = task
        self.names = list(names)

    def __call__(self, ctx: Any) -> dict[str, Any]:
        umask = os.umask(0)
        os.umask(umask)
        seen = {n: hashlib.sha256(os.environ[n].encode()).hexdigest() if n in os.environ else None for n in self.names}
        env = DistEnv.from_environ()
        return {"sha256": seen, "umask": umask, "port": env.master_port, "job_id": env.job_id, "train": self.task(ctx)}


@dataclass
class Run:
    handle: JobHandle
    job_dir: Path
    group: str | None


@dataclass
class Runs:
    private: Run
    shared: Run
    secrets: dict[str, str]  # name -> value


@pytest.fixture(scope="module")
def runs(slurm_cluster, user: User, tmp_path_factory) -> Iterator[Runs]:
    from trainer.train import TrainTask

    values = {SECRET_NAMED: f"tok-{secrets.token_hex(16)}", SECRET_LISTED: f"opq-{secrets.token_hex(16)}",
              SECRET_SHELL: f"shl-{secrets.token_hex(16)}"}
    train = tiny_train(steps=2, **{"teacher.kind": "none", "intervals.log_every": 1}).to_dict()
    base = tmp_path_factory.mktemp("security")
    group = grp.getgrgid(user.gid).gr_name
    handles = {}
    with pytest.MonkeyPatch.context() as environ:
        environ.setenv(SECRET_SHELL, values[SECRET_SHELL])  # as a user keeps a token in their shell, out of every file
        for kind, extra in (("private", {}), ("shared", {"group": group})):
            cluster = make_cluster(base / kind, nodes=1, gpus_per_node=1, time_min=5, secret_env=[SECRET_LISTED, SECRET_SHELL],
                                   env={SECRET_NAMED: values[SECRET_NAMED], SECRET_LISTED: values[SECRET_LISTED],
                                        PUBLIC: "public-value"}, **extra)
            probe = EnvProbe(TrainTask(train, cluster.runtime()), [*values, PUBLIC])
            handles[kind] = Run(submit(probe, cluster, "secure"), base / kind, extra.get("group"))
    try:
        yield Runs(handles["private"], handles["shared"], values)
    finally:  # never leave a job of ours behind
        subprocess.run(["scancel", *(r.handle.job_id for r in handles.values())], capture_output=True)


def finished(run: Run) -> dict[str, Any]:
    state = wait_done(run.handle.job_id, 240)
    assert state == "COMPLETED", f"job {run.handle.job_id}: {state}\n{run.handle.tail(30)}"
    return run.handle.result()


def every_file(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_submit_writes_no_secret_and_only_private_files(runs: Runs) -> None:
    # Right after sbatch, before the jobs run: the registry, the sbatch script and the pickle.
    for run in (runs.private, runs.shared):
        registry = (run.job_dir / "registry.jsonl").read_text()
        record = json.loads(registry.splitlines()[-1])
        assert record["cluster"]["env"] == {SECRET_NAMED: "***", SECRET_LISTED: "***", PUBLIC: "public-value"}
        folder = run.handle.run_dir / "submitit"
        script = (folder / f"{run.handle.job_id}_submission.sh").read_text()
        assert "export TAEHV_SECTEST_PUBLIC=public-value" in script
        pickle = (folder / f"{run.handle.job_id}_submitted.pkl").read_bytes()
        for value in runs.secrets.values():
            assert value not in registry and value not in script and value.encode() not in pickle
        allowed = 0o640 if run.group else 0o600  # sbatch ran under the library's umask
        for path in (folder / f"{run.handle.job_id}_submission.sh", folder / f"{run.handle.job_id}_submitted.pkl",
                     run.job_dir / "registry.jsonl"):
            assert mode(path) & ~allowed == 0, f"{path}: {mode(path):04o}"


# ------------------------------------------------------------------------------- folder modes

MODES = """
import json, os, stat, sys
from pathlib import Path
from taehv_slurm.security import UnsafePathError, make_private_dir, write_private
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
make_private_dir(base / "loose")
out["tightened"] = m(base / "loose")
write_private(base / "private" / "note", "x")
out["file"] = m(base / "private" / "note")
for name, call in {"foreign": lambda: make_private_dir(foreign), "not_member": lambda: make_private_dir(base / "x", "root"),
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
    assert one_line(out["foreign"]).startswith(f"cannot make {foreign} private: it belongs to root (uid 0), not to you")
    assert mode(foreign) == 0o755  # untouched
    assert "group 'root': you are not a member of it" in one_line(out["not_member"])
    assert "group 'no-such-group-taehv'" in one_line(out["no_group"]) and "does not exist" in out["no_group"]


# -------------------------------------------------------- the entry point before submitit loads

MAKE_JOB_FOLDER = """
import json, os, sys
from pathlib import Path
from submitit.helpers import DelayedSubmission
from taehv_slurm.security import make_private_dir, private_umask
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

    entry = [sys.executable, "-m", "taehv_slurm.entry", str(folder), str(folder.parent)]  # as submit() starts it
    out = user.run(entry, LOCAL_TASK_ENV)
    assert out.returncode == 2, out.stderr
    message = one_line(out.stderr)
    assert message.startswith(f"[taehv] refusing to load {pickle}: ")
    assert not (case / "ran").exists(), "the refused pickle ran"
    assert sha256(pickle) == before and not list(folder.glob("*_result.pkl"))  # nothing lost, nothing written
    if what == "foreign":
        assert message.endswith(f"{pickle} belongs to root (uid 0), not to you ({TEST_USER}); copy what you trust "
                                "into a folder of your own")
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
from taehv_slurm.security import private_umask
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
        out = user.run([sys.executable, "-m", "taehv_slurm.entry", str(folder)], LOCAL_TASK_ENV)
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
        out = user.run([sys.executable, "-m", "taehv_slurm.entry", str(folder)], LOCAL_TASK_ENV)
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
    assert refusals == [f"[taehv] refusing to load {pickle}: {above} is writable by everyone without the sticky bit "
                        f"(mode 0777); run `chmod o-w {above}` or move the run folder"], log
    assert pickle.is_file() and not marker.exists()
    # submit() checks the same before sbatch: nothing is queued that would refuse to start
    with pytest.raises(UnsafePathError) as err:
        submit(functools.partial(os.mkdir, str(marker)), make_cluster(above / "jobs", nodes=1, gpus_per_node=1), "r",
               requeueable=False)
    assert f"{above} is writable by everyone without the sticky bit" in one_line(str(err.value))
    assert not list((above / "jobs").rglob("*.pkl")) and not (above / "jobs" / "registry.jsonl").exists()


def test_a_symbolic_link_on_the_way_is_refused(tmp_path: Path) -> None:
    from taehv_slurm.security import check_safe_to_load, make_private_dir

    run = make_private_dir(tmp_path / "run")
    elsewhere = make_private_dir(tmp_path / "elsewhere")
    (elsewhere / "4242_submitted.pkl").write_bytes(b"x")
    (run / "submitit").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError) as err:
        check_safe_to_load(run / "submitit" / "4242_submitted.pkl", run)
    assert one_line(str(err.value)).endswith(f"{run / 'submitit'} is a symbolic link; replace it with the real file or folder")


# ----------------------------------------------------------------------------- checkpoints

CHECKPOINT_LOADS = """
import hashlib, json, os, re, subprocess, sys
from pathlib import Path
import torch
from taehv_slurm.checkpoint import Checkpointer
from taehv_slurm.security import UnsafePathError, describe_secret_env
base, planted, theirs = (Path(a) for a in sys.argv[1:4])
run = base / "run"
ck = Checkpointer(run / "checkpoints", trust_root=run)
ck.save({"w": torch.arange(4.0)}, 1, {"note": "mine"})
state = run / "checkpoints" / "step_00000001" / "state.pt"
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
out["planted"] = attempt(Checkpointer(planted / "checkpoints", trust_root=planted))
out["theirs"] = attempt(Checkpointer(theirs))
print(json.dumps(out))
"""


def test_checkpoint_load_refuses_writable_or_foreign_files(user: User) -> None:
    import torch

    base = user.home / "ck"
    base.mkdir()
    user.chown(base)
    # planted: the user's run folder, but state.pt is another user's (root's) file
    planted = base / "planted"
    Checkpointer(planted / "checkpoints").save({"w": torch.zeros(2)}, 3)
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
    state = planted / "checkpoints" / "step_00000003" / "state.pt"
    assert one_line(out["planted"]).startswith(f"refusing to load {state}: {state} belongs to root (uid 0), not to you")
    assert "copy what you trust into a folder of your own" in out["planted"]
    theirs_state = theirs / "step_00000005" / "state.pt"
    assert one_line(out["theirs"]).startswith(f"refusing to load {theirs_state}: {theirs_state} belongs to root (uid 0)")


class _RunsCode:
    """Pickles as a call to os.mkdir: what a malicious state.pt would do on an unrestricted load."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


def test_checkpoints_load_weights_only_with_our_own_message(tmp_path: Path) -> None:
    import torch

    ck = Checkpointer(tmp_path / "ck")
    ck.save({"w": torch.ones(3), "step": 7, "rng": [{"seed": 1}]}, 7, {"config": {"lr": 1e-4}})
    folder = tmp_path / "ck" / "step_00000007"
    assert json.loads((folder / "meta.json").read_text())["config"] == {"lr": 1e-4}  # non-tensor state: JSON
    marker = tmp_path / "code-ran"
    torch.save({"w": torch.ones(3), "payload": _RunsCode(marker)}, folder / "state.pt")
    with pytest.raises(CheckpointError) as err:
        ck.load(7)
    message = one_line(str(err.value))
    assert not marker.exists() and (folder / "state.pt").is_file()
    assert message == (f"cannot load checkpoint {folder}: state.pt holds a Python object (posix.mkdir), not only tensors "
                       "and plain values, and such objects are never unpickled (they could run code); delete that "
                       "folder to resume from an older one (it was not loaded)")
    for damage in (b"not a checkpoint", (folder / "state.pt").read_bytes()[:200], b""):
        (folder / "state.pt").write_bytes(damage)
        with pytest.raises(CheckpointError) as err:
            ck.load(7)
        assert "weights_only" not in str(err.value) and "state.pt is damaged or not a torch checkpoint" in one_line(str(err.value))
    # Resuming moves the unloadable checkpoint aside (never runs it, never deletes it)
    assert ck.load_latest() is None and not marker.exists()
    assert [p.name.split(".")[0] for p in (tmp_path / "ck").iterdir() if ".damaged-" in p.name] == ["step_00000007"]


# ------------------------------------------------------------------------------------- secrets


def test_pickled_tasks_and_runtime_carry_no_secret(tmp_path: Path) -> None:
    import cloudpickle

    from taehv_slurm.smoke import SmokeTask
    from trainer.train import TrainTask

    value = f"tok-{secrets.token_hex(16)}"
    cluster = make_cluster(tmp_path, env={"HF_TOKEN": value, "OPAQUE": value + "x", "PLAIN": "p"}, secret_env=["OPAQUE"])
    assert value not in repr(cluster.runtime()) and value not in json.dumps(cluster.masked())
    for task in (RequeueableTask(TrainTask(tiny_train().to_dict(), cluster.runtime()), tmp_path / "run"),
                 SmokeTask(cluster.dist_backend, cluster.rendezvous_timeout_s), cluster.without_secrets()):
        assert value.encode() not in cloudpickle.dumps(task), type(task).__name__


def test_dry_run_masks_secrets_and_says_they_will_be_passed(tmp_path: Path) -> None:
    values = [f"v{i}-{secrets.token_hex(12)}" for i in range(3)]
    out = subprocess.run(
        [sys.executable, "-m", "jobs.submit", "--cluster", "configs/cluster/testbed.yaml", "--train",
         "configs/train/tiny.yaml", "--nodes", "1", "--dry-run", "--name", "dry", "--set", f"job_dir={tmp_path}",
         "--set", f"env.HF_TOKEN={values[0]}", "--set", f"env.OPAQUE_THING={values[1]}", "--set", "env.PLAIN=pub",
         "--set", "secret_env=[OPAQUE_THING, SHELL_ONLY_KEY, NOT_SET_ANYWHERE]"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "NOT_SET_ANYWHERE"}, "SHELL_ONLY_KEY": values[2],
             "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    for value in values:
        assert value not in out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("secret env")]
    assert lines == ["secret env (passed through sbatch's environment, never written to a file): HF_TOKEN=*** (cluster "
                     "config), NOT_SET_ANYWHERE (not set: the job will not have it), OPAQUE_THING=*** (cluster config), "
                     "SHELL_ONLY_KEY=*** (your environment)"]
    assert "export PLAIN=pub" in out.stdout and "HF_TOKEN" not in out.stdout.split("sbatch script")[1]
    assert not (tmp_path / "dry").exists()  # a dry run writes nothing


def test_dry_run_line_names_secrets_sbatch_export_would_drop() -> None:
    cluster = load_cluster({"env": {"HF_TOKEN": "x"}, "secret_env": ["OTHER"], "sbatch_args": {"export": "NONE"}})
    assert describe_secret_env(cluster, {"OTHER": "y"}).endswith(
        "; but sbatch --export=NONE leaves out HF_TOKEN, OTHER: add ALL or those names to it")
    assert "leaves out" not in describe_secret_env(load_cluster({"env": {"HF_TOKEN": "x"}}), {"SBATCH_EXPORT": "ALL,A=1"})
    assert describe_secret_env(load_cluster({"env": {"PLAIN": "x"}}), {}) is None


# ------------------------------------------------------------------------ rendezvous (bounded)

RANK = """
import sys, time
from taehv_slurm.distenv import DistEnv, init_distributed
rank, world, port, rdv = (int(a) for a in sys.argv[1:5])
env = DistEnv(rank, rank, world, world, 0, 1, "127.0.0.1", port, "sec", "single")
init_distributed(env, "gloo", timeout_s=5, rendezvous_timeout_s=rdv, use_cuda=False)
print("joined")
"""


def _rank(rank: int, world: int, port: int, rendezvous_s: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(world), str(port), str(rendezvous_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_beyond_world_size_is_refused_and_the_master_gives_up(tmp_path: Path) -> None:
    port = _unused_port()
    start = time.monotonic()
    master = _rank(0, 2, port, 20)
    intruder = _rank(2, 2, port, 20)  # claims rank 2 of a world of 2
    _, err = intruder.communicate(timeout=120)
    # refused before it touches the store, in one line (torch itself would also refuse: "rank < size")
    assert intruder.returncode != 0 and "rank 2 (local 2) is outside world size 2" in err
    out, err = master.communicate(timeout=120)
    # The master never got its real rank 1: it fails within the bounded timeouts, not after hours.
    assert master.returncode != 0 and "joined" not in out, err[-2000:]
    assert time.monotonic() - start < 60


def test_a_stray_connection_cannot_hang_the_rendezvous() -> None:
    port = _unused_port()
    start = time.monotonic()
    master = _rank(0, 2, port, 4)
    stray = socket.socket()
    deadline = time.monotonic() + 30
    while True:  # connect once the master listens, then say nothing
        try:
            stray.connect(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline and master.poll() is None, "the master never listened"
            stray.close()
            stray = socket.socket()
            time.sleep(0.1)
    try:
        _, err = master.communicate(timeout=60)
    finally:
        stray.close()
    assert master.returncode != 0
    assert f"rendezvous with 127.0.0.1:{port} failed after ≤4 s" in err.strip().splitlines()[-1], err[-2000:]
    assert time.monotonic() - start < 40


def test_rendezvous_ports_stay_in_the_documented_range() -> None:
    low = 32768  # Linux's default first ephemeral port; the machine's own setting where it can be read
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ranges.exists():
        low = int(ranges.read_text().split()[0])
    assert PORT_BASE == 20000 and PORT_BASE + PORT_SPAN - 1 == 32767 < low
    # Jobs submitted one after another get different ports until PORT_SPAN further submissions.
    first = 4_000_000
    assert len({port_for_job(str(j)) for j in range(first, first + PORT_SPAN)}) == PORT_SPAN


# ----------------------------------------------------------------- after the real Slurm jobs


def test_the_job_sees_its_secrets_through_the_environment(runs: Runs) -> None:
    for run in (runs.private, runs.shared):
        result = finished(run)
        digests = {n: hashlib.sha256(v.encode()).hexdigest() for n, v in runs.secrets.items()}
        assert result["sha256"] == {**digests, PUBLIC: hashlib.sha256(b"public-value").hexdigest()}
        assert result["umask"] == (0o027 if run.group else 0o077)  # set by the entry point
        assert result["train"]["step"] == 2


def test_no_secret_anywhere_under_the_job_folders(runs: Runs) -> None:
    for run in (runs.private, runs.shared):
        finished(run)
        files = every_file(run.job_dir)
        names = {p.name for p in files}
        job = run.handle.job_id
        # Not a vacuous search: every kind of file a job writes is there (pickles included).
        for expected in (f"{job}_submitted.pkl", f"{job}_0_result.pkl", f"{job}_0_log.out", f"{job}_submission.sh",
                         "registry.jsonl", "events.jsonl", "metrics.jsonl", "state.pt", "meta.json", "latest"):
            assert expected in names, f"{expected} missing under {run.job_dir}"
        assert any(n.startswith("events.out.tfevents") for n in names)
        for path in files:
            data = path.read_bytes()
            for name, value in runs.secrets.items():
                assert value.encode() not in data, f"{name}'s value is in {path}"


def written(job_dir: Path) -> list[Path]:
    """The job folder and everything in it, except submitit's symlinks (no mode of their own) to files in it."""
    paths = [job_dir, *job_dir.rglob("*")]
    links = [p for p in paths if p.is_symlink()]
    assert all(job_dir in p.resolve().parents for p in links), links
    return [p for p in paths if not p.is_symlink()]


def test_job_files_are_private_after_a_real_job(runs: Runs) -> None:
    private = runs.private
    finished(private)
    for path in written(private.job_dir):
        assert mode(path) == (0o700 if path.is_dir() else 0o600), f"{path}: {mode(path):04o}"
    shared = runs.shared
    finished(shared)
    gid = grp.getgrnam(shared.group).gr_gid
    for path in written(shared.job_dir):
        # Group-readable at most, never group-writable, nothing for others; the group kept throughout.
        if path.is_dir():
            assert mode(path) == 0o2750, f"{path}: {mode(path):04o}"
        else:
            assert mode(path) in (0o640, 0o600), f"{path}: {mode(path):04o}"
        assert path.stat().st_gid == gid, path
    # What the job loads back (the trainer's checkpoint) loads with weights_only=True.
    step, state, meta = Checkpointer(private.handle.run_dir / "checkpoints").load_latest()
    assert step == 2 and meta["step"] == 2 and "rng" in state


def test_concurrent_jobs_get_their_own_rendezvous_port(runs: Runs) -> None:
    results = [finished(run) for run in (runs.private, runs.shared)]
    ports = [r["port"] for r in results]
    assert ports == [port_for_job(r["job_id"]) for r in results]
    assert len(set(ports)) == 2 and all(PORT_BASE <= p <= 32767 for p in ports)
    assert [r["job_id"] for r in results] == [runs.private.handle.job_id, runs.shared.handle.job_id]
