"""Safe on a shared cluster (2 of 2): secrets and files of real Slurm jobs, a bounded rendezvous.

Secrets reach a job only through its environment, never a file; what a real job writes is private (or
group-readable only); ranks rendezvous within bounded timeouts, each job on a port of its own.
tests/test_security_files.py has the other half: folder modes, refusing unsafe pickles and checkpoints.

The Slurm jobs (1 node x 1 task, two steps of the tiny config) are submitted by the first test and run
while the others do: one private run carrying three secrets (named like a secret, listed in
`secret_env`, and only in the submitting environment), one run shared read-only with a group.
"""

from __future__ import annotations

import fnmatch
import grp
import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from taehv_slurm.common.config import load_cluster
from taehv_slurm.common.runfolder import ATTEMPTS, EVENTS, METRICS, REGISTRY, JobDir, RunFolder
from taehv_slurm.common.security import describe_secret_env
from taehv_slurm.handle import JobHandle
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.runtime.distenv import PORT_BASE, PORT_SPAN, DistEnv, port_for_job
from taehv_slurm.runtime.requeue import RequeueableTask
from taehv_slurm.submission import submit
from tests.helpers import REPO, make_cluster, tiny_train, wait_done
from tests.security_helpers import User, mode, unprivileged_user

SECRET_NAMED = "TAEHV_SECTEST_API_TOKEN"  # a secret by its name (TOKEN)
SECRET_LISTED = "TAEHV_SECTEST_OPAQUE"  # a secret because secret_env lists it
SECRET_SHELL = "TAEHV_SECTEST_SHELL_ONLY"  # listed in secret_env, set only in the submitting environment
PUBLIC = "TAEHV_SECTEST_PUBLIC"


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    """The unprivileged test user, with a private home folder for this module."""
    yield from unprivileged_user("tests/test_security_jobs.py")


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
        seen = {n: hashlib.sha256(os.environ[n].encode()).hexdigest() if n in os.environ else None
                for n in self.names}
        env = DistEnv.from_environ()
        return {"sha256": seen, "umask": umask, "port": env.master_port, "job_id": env.job_id,
                "train": self.task(ctx)}


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
    from taehv_slurm.trainer.task import TrainTask

    values = {SECRET_NAMED: f"tok-{secrets.token_hex(16)}", SECRET_LISTED: f"opq-{secrets.token_hex(16)}",
              SECRET_SHELL: f"shl-{secrets.token_hex(16)}"}
    train = tiny_train(steps=2, **{"teacher.kind": "none", "intervals.log_every": 1}).to_dict()
    base = tmp_path_factory.mktemp("security")
    group = grp.getgrgid(user.gid).gr_name
    handles = {}
    with pytest.MonkeyPatch.context() as environ:
        # as a user keeps a token in their shell, out of every file
        environ.setenv(SECRET_SHELL, values[SECRET_SHELL])
        for kind, extra in (("private", {}), ("shared", {"group": group})):
            cluster = make_cluster(base / kind, nodes=1, gpus_per_node=1, time_min=5,
                                   secret_env=[SECRET_LISTED, SECRET_SHELL],
                                   env={SECRET_NAMED: values[SECRET_NAMED],
                                        SECRET_LISTED: values[SECRET_LISTED],
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
        registry = JobDir(run.job_dir).registry.read_text()
        record = json.loads(registry.splitlines()[-1])
        assert record["cluster"]["env"] == {SECRET_NAMED: "***", SECRET_LISTED: "***", PUBLIC: "public-value"}
        folder = RunFolder(run.handle.run_dir).submitit
        script = (folder / f"{run.handle.job_id}_submission.sh").read_text()
        assert "export TAEHV_SECTEST_PUBLIC=public-value" in script
        pickle = (folder / f"{run.handle.job_id}_submitted.pkl").read_bytes()
        for value in runs.secrets.values():
            assert value not in registry and value not in script and value.encode() not in pickle
        allowed = 0o640 if run.group else 0o600  # sbatch ran under the library's umask
        for path in (folder / f"{run.handle.job_id}_submission.sh",
                     folder / f"{run.handle.job_id}_submitted.pkl",
                     JobDir(run.job_dir).registry):
            assert mode(path) & ~allowed == 0, f"{path}: {mode(path):04o}"


# ------------------------------------------------------------------------------------- secrets


def test_pickled_tasks_and_runtime_carry_no_secret(tmp_path: Path) -> None:
    import cloudpickle

    from taehv_slurm.runtime.smoke import SmokeTask
    from taehv_slurm.trainer.task import TrainTask

    value = f"tok-{secrets.token_hex(16)}"
    cluster = make_cluster(tmp_path, env={"HF_TOKEN": value, "OPAQUE": value + "x", "PLAIN": "p"},
                           secret_env=["OPAQUE"])
    assert value not in repr(cluster.runtime()) and value not in json.dumps(cluster.masked())
    for task in (RequeueableTask(TrainTask(tiny_train().to_dict(), cluster.runtime()), tmp_path / "run"),
                 SmokeTask(cluster.dist_backend, cluster.rendezvous_timeout_s), cluster.without_secrets()):
        assert value.encode() not in cloudpickle.dumps(task), type(task).__name__


@pytest.mark.usefixtures("slurm_cluster")  # a dry run asks Slurm about the partition
def test_dry_run_masks_secrets_and_says_they_will_be_passed(tmp_path: Path) -> None:
    values = [f"v{i}-{secrets.token_hex(12)}" for i in range(3)]
    out = subprocess.run(
        [sys.executable, "-m", "jobs.submit", "--cluster", "configs/cluster/testbed.yaml", "--train",
         "configs/train/tiny.yaml", "--nodes", "1", "--dry-run", "--name", "dry",
         "--set", f"job_dir={tmp_path}", "--set", f"env.HF_TOKEN={values[0]}",
         "--set", f"env.OPAQUE_THING={values[1]}", "--set", "env.PLAIN=pub",
         "--set", "secret_env=[OPAQUE_THING, SHELL_ONLY_KEY, NOT_SET_ANYWHERE]"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "NOT_SET_ANYWHERE"}, "SHELL_ONLY_KEY": values[2],
             "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    for value in values:
        assert value not in out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("secret env")]
    assert lines == ["secret env (passed through sbatch's environment, never written to a file): "
                     "HF_TOKEN=*** (cluster config), NOT_SET_ANYWHERE (not set: the job will not have it), "
                     "OPAQUE_THING=*** (cluster config), SHELL_ONLY_KEY=*** (your environment)"]
    assert "export PLAIN=pub" in out.stdout and "HF_TOKEN" not in out.stdout.split("sbatch script")[1]
    assert not (tmp_path / "dry").exists()  # a dry run writes nothing


def test_dry_run_line_names_secrets_sbatch_export_would_drop() -> None:
    cluster = load_cluster({"env": {"HF_TOKEN": "x"}, "secret_env": ["OTHER"],
                            "sbatch_args": {"export": "NONE"}})
    assert describe_secret_env(cluster, {"OTHER": "y"}).endswith(
        "; but sbatch --export=NONE leaves out HF_TOKEN, OTHER: add ALL or those names to it")
    assert "leaves out" not in describe_secret_env(load_cluster({"env": {"HF_TOKEN": "x"}}),
                                                   {"SBATCH_EXPORT": "ALL,A=1"})
    assert describe_secret_env(load_cluster({"env": {"PLAIN": "x"}}), {}) is None


# ------------------------------------------------------------------------ rendezvous (bounded)

RANK = """
import sys, time
from taehv_slurm.runtime.distenv import DistEnv, init_distributed
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
    master = _rank(0, 2, port, 8)  # its rendezvous timeout: how long it waits for its real rank 1
    intruder = _rank(2, 2, port, 8)  # claims rank 2 of a world of 2
    _, err = intruder.communicate(timeout=120)
    # refused before it touches the store, in one line (torch itself would also refuse: "rank < size")
    assert intruder.returncode != 0 and "rank 2 (local 2) is outside world size 2" in err
    out, err = master.communicate(timeout=120)
    # The master never got its real rank 1: it fails within the bounded timeouts, not after hours.
    assert master.returncode != 0 and "joined" not in out, err[-2000:]
    assert time.monotonic() - start < 45


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
        for expected in (f"{job}_submitted.pkl", f"{job}_0_result.pkl", f"{job}_0_log.out",
                         f"{job}_submission.sh", REGISTRY, EVENTS, METRICS,
                         "state.pt", "meta.json", "latest"):
            assert expected in names, f"{expected} missing under {run.job_dir}"
        assert any(n.startswith("events.out.tfevents") for n in names)
        for path in files:
            data = path.read_bytes()
            for name, value in runs.secrets.items():
                assert value.encode() not in data, f"{name}'s value is in {path}"


def written(job_dir: Path) -> list[Path]:
    """The job folder and everything in it, except submitit's symlinks (no mode of their own) to files in
    it."""
    paths = [job_dir, *job_dir.rglob("*")]
    links = [p for p in paths if p.is_symlink()]
    assert all(job_dir in p.resolve().parents for p in links), links
    return [p for p in paths if not p.is_symlink()]


def documented_modes() -> list[tuple[list[str], int, int]]:
    """docs/security.md's table of modes: ([name patterns], mode, mode with a group) per row."""
    text = (REPO / "docs" / "security.md").read_text()
    table = text.split("### 1. Run folders and files are private", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        what, private, shared = line.strip("|").split("|")[:3]
        rows.append((re.findall(r"`([^`]+)`", what), int(re.search(r"`(\d{4})`", private).group(1), 8),
                     int(re.search(r"`(\d{4})`", shared).group(1), 8)))
    return rows


def named_by(pattern: str, path: Path, run: Run) -> bool:
    """Whether a pattern of the table names `path` (a job folder's file or folder)."""
    if pattern in ("job_dir", "<run>/"):
        return path == (run.job_dir if pattern == "job_dir" else Path(run.handle.run_dir))
    # the code copy's files are its rows', whatever their names (a tracked `registry.jsonl` fixture)
    if path.relative_to(run.job_dir).parts[:1] == ("code",) and not pattern.startswith("code/"):
        return False
    wildcard = pattern.replace("<rank>", "*").replace("<digest>", "*")
    if pattern.endswith("/"):  # a folder: by its name, or by its path (`code/<digest>/`: the copy's folders)
        inside = "/" in pattern[:-1]
        named = path.relative_to(run.job_dir).as_posix() if inside else path.name
        return path.is_dir() and fnmatch.fnmatch(named, ("*" if inside else "") + wildcard[:-1])
    if "/" in wildcard:
        return path.is_file() and fnmatch.fnmatch(path.relative_to(run.job_dir).as_posix(), f"*{wildcard}")
    return path.is_file() and fnmatch.fnmatch(path.name, wildcard if "*" in wildcard else f"*{wildcard}")


def test_job_files_are_private_after_a_real_job(runs: Runs) -> None:
    """Every file and folder the jobs wrote (a private run, a run shared with a group) has exactly the mode
    docs/security.md's table gives its kind, and the shared run's all belong to the group."""
    table = documented_modes()
    for run in (runs.private, runs.shared):
        finished(run)
        gid = grp.getgrnam(run.group).gr_gid if run.group else None
        found = set()
        for path in written(run.job_dir):
            rows = [(private, shared) for patterns, private, shared in table
                    if any(named_by(p, path, run) for p in patterns)]
            assert len(rows) == 1, f"{path}: {len(rows)} rows of docs/security.md's table name it"
            want = rows[0][1] if run.group else rows[0][0]
            assert mode(path) == want, f"{path}: {mode(path):04o}, the table says {want:04o}"
            assert gid is None or path.stat().st_gid == gid, path
            found.add(path.name)
        # every kind of file the table has a row for, among them the two the group must read to follow a run
        assert {REGISTRY, EVENTS, ATTEMPTS, METRICS, "state.pt", "latest", "0.json"} <= found, found
    # What the job loads back (the trainer's checkpoint) is torch.load(weights_only=True)'s: only tensors and
    # plain values, the same state the library's loader gives.
    import torch

    checkpoints = RunFolder(runs.private.handle.run_dir).checkpoints
    step, state, meta = Checkpointer(checkpoints).load_latest()
    file = checkpoints / f"step_{step:08d}" / "state.pt"
    assert same(torch.load(file, map_location="cpu", weights_only=True), state)
    assert step == 2 and meta["step"] == 2 and plain(state) and set(state["params"]) == set(state["exp_avg"])


def same(a: Any, b: Any) -> bool:
    """Equal at every depth, tensors bit for bit."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def plain(value: Any) -> bool:
    """Only tensors and plain values (what weights_only loads), at any depth."""
    import torch

    if isinstance(value, dict):
        return all(isinstance(k, str | int) and plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, str | int | float | bool | torch.Tensor)


def test_concurrent_jobs_get_their_own_rendezvous_port(runs: Runs) -> None:
    results = [finished(run) for run in (runs.private, runs.shared)]
    ports = [r["port"] for r in results]
    assert ports == [port_for_job(r["job_id"]) for r in results]
    assert len(set(ports)) == 2 and all(PORT_BASE <= p <= 32767 for p in ports)
    assert [r["job_id"] for r in results] == [runs.private.handle.job_id, runs.shared.handle.job_id]
