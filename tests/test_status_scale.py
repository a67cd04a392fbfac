"""Status at a lab's scale: the registry written by many processes at once and read once, a run's files
read from their end, and the scheduler asked once for many jobs — counted on the real Slurm testbed
through a PATH wrapper that logs every squeue, sacct and scontrol call before running the real one.

The Slurm jobs here never run: a sweep submitted with `--begin` an hour away waits in the queue (no CPU),
and is cancelled at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from taehv_slurm.common.runfolder import JobDir, RunFileWarning
from taehv_slurm.handle import JobHandle
from taehv_slurm.registry import Registry, read_registry
from tests.helpers import REPO, slurm_conf_with

SCHEDULER = ("squeue", "sacct", "scontrol")
WRITERS, LINES_EACH = 8, 150

APPEND = """
import sys, time
from taehv_slurm.registry import record_submission
job_dir, writer, count, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
while time.time() < go:  # every writer starts at the same moment
    time.sleep(0.001)
for i in range(count):  # a record of a real line's size (a cluster config and a train config)
    record_submission(job_dir, {"job_id": f"{writer}-{i}", "run": f"w{writer}/r{i}", "run_dir": "x",
                                "folder": "y", "cluster": {"pad": "c" * 1500}, "train": {"pad": "t" * 1500}})
"""


def test_eight_processes_appending_at_once_lose_no_line_and_cut_none(tmp_path: Path) -> None:
    go = time.time() + 3
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [subprocess.Popen([sys.executable, "-c", APPEND, str(tmp_path), str(w), str(LINES_EACH),
                                 str(go)], cwd=REPO, env=env) for w in range(WRITERS)]
    assert [w.wait(timeout=120) for w in writers] == [0] * WRITERS
    lines = JobDir(tmp_path).registry.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == WRITERS * LINES_EACH + 1
    records = [json.loads(line) for line in lines[:-1]]  # every line whole
    assert Counter(r["job_id"] for r in records) == {f"{w}-{i}": 1 for w in range(WRITERS)
                                                     for i in range(LINES_EACH)}
    registry = Registry.load(tmp_path)
    assert len(registry.job_ids()) == WRITERS * LINES_EACH
    assert registry.find("7-149")["run"] == "w7/r149" and registry.find("w3/r0")["job_id"] == "3-0"


def record(job_id: str, run: str, at: float, **extra: object) -> dict:
    return {"event": "submitted", "time": at, "job_id": job_id, "run": run, "run_dir": f"/old/{run}",
            "folder": f"/old/{run}/submitit", "submitted_at": at, **extra}


def test_old_registries_damaged_lines_and_appends_are_read_as_before(tmp_path: Path) -> None:
    old = {k: v for k, v in record("11", "first", 1.0).items() if k != "run"}  # before `run` was recorded
    by_hand = {"job_id": "12", "event": "submitted", "run_dir": "/x/second", "folder": "/x/f", "time": 2.0}
    text = "".join(json.dumps(r) + "\n" for r in (old, by_hand))
    text += '{"event": "submitted", "time": 3.0, "job_id": "13", "run": "cut", "run_dir": "/a", "fol\n'
    text += json.dumps(record("14", "first", 4.0)) + "\n"
    JobDir(tmp_path).registry.write_text(text + '{"event": "submitted", "time": 5.0, "job_id": "15", "run')
    with pytest.warns(RunFileWarning, match=r"skipped 1 damaged line\(s\) \(line 3: cut short"):
        registry = Registry.load(tmp_path)
    assert [r["job_id"] for r in read_registry(tmp_path)] == ["11", "12", "14"]  # the unfinished one too
    assert registry.find("11")["run_dir"] == "/old/first" and registry.find("second")["job_id"] == "12"
    assert registry.find("first")["job_id"] == "14"  # a run name: its newest job
    with JobDir(tmp_path).registry.open("a") as f:  # its writer ends the line, another one follows
        f.write('": "late", "run_dir": "/b", "folder": "/c"}\n')
        f.write(json.dumps(record("16", "first", 6.0)) + "\n")
    assert registry is Registry.load(tmp_path) and registry.job_ids() == ["11", "12", "14", "15", "16"]
    assert [r["job_id"] for r in registry.of_run("first")] == ["11", "14", "16"]
    JobDir(tmp_path).registry.write_text(json.dumps(record("21", "new", 7.0)) + "\n")  # replaced in place
    assert Registry.load(tmp_path).job_ids() == ["21"]


def a_long_local_run(job_dir: Path, steps: int) -> list[str]:
    """One run folder submitted twice (a resubmitted run resumes it): job A trained steps 1..steps/2, job B
    the rest; returns the job ids. The files as the local backend leaves them; no job runs."""
    from taehv_slurm.common.config import load_cluster

    cluster = load_cluster(REPO / "configs/cluster/local.yaml").masked()
    run, now, half = JobDir(job_dir).run("long"), time.time() - 10 * steps, steps // 2
    run.submitit.mkdir(parents=True)
    ids, starts = ["4242-aaaaaa", "4243-bbbbbb"], [now, now + 2 * half + 5]
    with JobDir(job_dir).registry.open("a") as f:
        for job_id, at in zip(ids, starts):
            f.write(json.dumps(record(job_id, "long", at, run_dir=str(run.path),
                                      folder=str(run.submitit), folder_rel="long/submitit",
                                      backend="local", task="TrainTask", nodes=1, world_size=1,
                                      cluster=cluster, train={"steps": steps},
                                      plan={"total_steps": steps}, sweep={})) + "\n")
            (run.submitit / f"{job_id}_local.json").write_text(json.dumps({"state": "COMPLETED"}))
    checkpoint = run.checkpoints / f"step_{steps:08d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text("{}")
    (run.checkpoints / "latest").write_text(checkpoint.name)
    events, metrics = [], []
    for job_id, at, first in zip(ids, starts, (0, half)):
        events += [{"event": "start", "time": at + 2, "began": at + 1, "step": first, "job_id": job_id,
                    "restart_count": 0},
                   {"event": "first_step", "time": at + 3, "step": first + 1, "seconds": 2.0,
                    "job_id": job_id}]
        # one line a step; every 7th step a slow one (the median pace is 1 s)
        metrics += [{"step": s, "time": at + 2 + (s - first) + (0.5 if s % 7 == 0 else 0), "loss": 1.0 / s}
                    for s in range(first + 1, first + half + 1)]
        events.append({"event": "finished", "time": metrics[-1]["time"], "step": first + half,
                       "job_id": job_id})
    run.events().path.write_text("".join(json.dumps(e) + "\n" for e in events))
    run.metrics().path.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return ids


@pytest.mark.parametrize("steps", [400, 6000])
def test_a_status_reads_the_end_of_a_long_run_and_gives_what_the_whole_files_give(tmp_path: Path,
                                                                                  steps: int) -> None:
    older, newer = (JobHandle.attach(job_id, tmp_path) for job_id in a_long_local_run(tmp_path, steps))
    # each job's own last step (the older job's ends where the newer one began), from the file's end
    assert older.last_step() == steps // 2 and newer.last_step() == steps
    rows = older.summary(), newer.summary()
    assert [(r["state"], r["step"], r["steps"]) for r in rows] == [("COMPLETED", steps // 2, steps),
                                                                    ("COMPLETED", steps, steps)]
    # ETTR from each attempt's last lines (a status) as from all of them (`goodput()`): the same pace
    for handle, row in zip((older, newer), rows):
        assert row["ettr"] == handle.goodput().attrs["ettr"] and row["ettr"] > 0
    assert len(newer.events()) == 3 and {e["job_id"] for e in newer.events()} == {newer.job_id}
    frame = newer.metrics()
    assert list(frame["step"]) == list(range(1, steps + 1)) and set(frame["event"]) == {"train"}


# ------------------------------------------------------------------------------- Slurm, counted


@pytest.fixture
def counted(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PATH starts with squeue/sacct/scontrol wrappers that log each call to the
    returned file, then run the real command."""
    wrappers, log = tmp_path / "bin", tmp_path / "scheduler_calls.log"
    wrappers.mkdir()
    for name in SCHEDULER:
        real = shutil.which(name)
        assert real, f"{name} is not on PATH"
        (wrappers / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexec {real} "$@"\n')
        (wrappers / name).chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{wrappers}{os.pathsep}{os.environ['PATH']}"}
    return env, log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def held_sweep(job_dir: Path, runs: int, env: dict[str, str], *extra: str) -> subprocess.Popen:
    """`taehv submit --sweep` of `runs` runs that wait an hour in the queue (they never run here)."""
    seeds = ",".join(map(str, range(runs)))
    return subprocess.Popen([sys.executable, "-m", "taehv_slurm", "submit", "--cluster",
                             "configs/cluster/testbed.yaml", "--train", "configs/train/tiny.yaml",
                             "--nodes", "1", "--gpus-per-node", "1", "--set", f"job_dir={job_dir}",
                             "--set", "sbatch_args.begin=now+3600", "--sweep", f"seed={seeds}",
                             "--name", "held", *extra], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def cancel_sweep(out: str) -> None:
    ids = re.findall(r"submitted job (\S+)", out)
    if ids:
        subprocess.run(["scancel", ids[0].split("_")[0]], capture_output=True)


def test_status_of_fifty_slurm_runs_asks_the_scheduler_twice(slurm_cluster, tmp_path: Path, counted) -> None:
    env, log = counted
    job_dir = tmp_path / "runs"
    out, err = held_sweep(job_dir, 50, env).communicate(timeout=300)
    try:
        assert "sweep of 50 runs" in out, out[-2000:] + err[-2000:]
        before = len(calls(log))
        for argv in (["--all"], [], ["--all", "--format", "json"]):
            done = subprocess.run([sys.executable, "-m", "taehv_slurm", "status", *argv, "--job-dir",
                                   str(job_dir)], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            asked, before = calls(log)[before:], len(calls(log))
            shown = json.loads(done.stdout) if "json" in argv else done.stdout.splitlines()[1:]
            assert len(shown) == (20 if not argv else 50)
            assert all("PENDING" in str(row) for row in shown)
            assert len(asked) <= 2 and {c.split()[0] for c in asked} <= {"squeue", "sacct"}, asked
        # a site that keeps no accounting (sacct: "Slurm accounting storage is disabled") is no failure
        kept_none = slurm_conf_with(tmp_path, AccountingStorageType="accounting_storage/none")
        for argv, said in ((["--all"], "PENDING"), (["--all", "--accounting"], "no accounting for these")):
            done = subprocess.run([sys.executable, "-m", "taehv_slurm", "status", *argv, "--job-dir",
                                   str(job_dir)], cwd=REPO, env={**env, "SLURM_CONF": str(kept_none)},
                                  capture_output=True, text=True, timeout=120)
            assert (done.returncode, done.stderr, said in done.stdout) == (0, "", True), done.stdout[-2000:]
        # an order to a job drops what was known of it: the state read right after is Slurm's new one
        handles = [JobHandle.attach(f"held/seed={seed}", job_dir) for seed in (0, 1)]
        assert [h.state for h in handles] == ["PENDING", "PENDING"]
        handles[0].cancel()  # a pending array task cancelled leaves squeue at once, and never had accounting
        assert [h.state for h in handles] == ["UNKNOWN", "PENDING"]
    finally:
        cancel_sweep(out)


def test_following_a_sweep_of_twenty_for_two_minutes_asks_at_most_thirty_times(slurm_cluster, tmp_path: Path,
                                                                               counted) -> None:
    env, log = counted
    follower = held_sweep(tmp_path / "runs", 20, env, "--follow")
    time.sleep(120)
    follower.send_signal(signal.SIGTERM)  # as Ctrl-C: on Slurm it stops following, the runs go on
    out, err = follower.communicate(timeout=60)
    try:
        assert "sweep of 20 runs" in out, out[-2000:] + err[-2000:]
        assert "stopped following; the runs go on" in out, out[-2000:] + err[-2000:]
        assert out.count(": job ") >= 20  # a line per run as it was first seen (PENDING)
        asked = [c for c in calls(log) if c.split()[0] in SCHEDULER]
        assert 0 < len(asked) <= 30, asked
    finally:
        cancel_sweep(out)
