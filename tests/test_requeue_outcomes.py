"""A requeue that is recorded must have happened (real Slurm testbed).

Each case is a real job with real signals; the events a run records are compared with what Slurm did
(`sacct` states), the job's final state must be the truthful one, messages are one line, and no step
is lost or run twice where the run can continue. The jobs are submitted together by one module fixture
(they run side by side, so the module takes about as long as its longest case). The time limit
without its warning is tested beside the time-limit test in tests/test_requeue.py (both wait for a limit):

- `path_replaced`: a `setup:` line that replaces PATH, then the time-limit warning: scontrol, found
  before the setup ran, still requeues the job;
- `no_scontrol`: a job whose scontrol cannot be found where it starts fails at once, saying why;
- `unreachable`: scontrol cannot reach the controller at the warning: `requeue_failed`, the job ends
  FAILED with one line naming cause, fix and resume, and resubmitting the name loses no step;
- `nested` (submitted by its test): a user's function that builds and calls TrainTask itself (ignoring its
  context) saves at a preemption into the run folder and resumes there;
- `never_polls`: a task that never reaches a step boundary is reported once and its restart counts as
  no progress;
- `busy`: a second job for a run with a live job is refused by submit() and, when started anyway, by
  the run folder's lock; --force cancels (it saves) and takes over from the saved step;
- `damaged`: an overwritten newest checkpoint (same size) is found by its checksum, moved aside once
  (rank 0 decides for both ranks) and the run resumes from the one before;
- an executor folder made like `mktemp -d` (inside the sticky /tmp) runs;
- `limited`: a job with `max_requeues: 1` preempted twice: its third start is refused and it ends FAILED.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.faults import rank_record, wait_for
from taehv_slurm.backends import SlurmBackend
from taehv_slurm.common.runfolder import JobDir, RunFolder
from taehv_slurm.executor import make_executor
from taehv_slurm.handle import JobHandle
from taehv_slurm.runtime.requeue import NotRequeueableError, RequeueableTask
from taehv_slurm.submission import RunBusyError, submit
from tests.helpers import (
    REPO,
    events,
    make_cluster,
    metrics,
    quick_train,
    unreachable_controller_conf,
    wait_done,
)
from tests.tasks import CountingTask, NeverPolls, train_with_the_context

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def steps_done(run_dir: Path) -> list[int]:
    path = Path(run_dir) / "steps.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def allocation_states(handle: JobHandle) -> list[str]:
    """sacct's record of each run of the job, oldest first (settled: waits until accounting has the end)."""
    frame = handle.accounting()
    return [s.split()[0] for s in frame[frame["JobID"] == handle.job_id]["State"]]


def one_line(text: str) -> str:
    assert text and "\n" not in text.strip(), f"not one line: {text!r}"
    return text.strip()


def unreachable_scontrol(folder: Path) -> Path:
    """The real scontrol, pointed at a controller port where nothing listens."""
    bad = unreachable_controller_conf(folder)
    wrapper = folder / "scontrol"
    wrapper.write_text(f"#!/bin/sh\nSLURM_CONF={bad} exec {shutil.which('scontrol')} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


@dataclass
class Cases:
    job_dir: Path
    path_replaced: JobHandle
    unreachable: JobHandle
    no_scontrol: JobHandle
    never_polls: JobHandle
    busy: JobHandle
    mktemp_job: object
    mktemp_folder: Path
    limited: JobHandle


@pytest.fixture(scope="module")
def cases(slurm_cluster, tmp_path_factory) -> Iterator[Cases]:
    job_dir = tmp_path_factory.mktemp("outcomes")
    one = functools.partial(make_cluster, job_dir, nodes=1, gpus_per_node=1)
    bindir = job_dir / "bin"  # what a setup line leaves on PATH: srun, and nothing else of Slurm
    bindir.mkdir()
    (bindir / "srun").symlink_to(shutil.which("srun"))
    mktemp_folder = Path(tempfile.mkdtemp())
    found = Cases(
        job_dir=job_dir,
        path_replaced=submit(CountingTask(30, pause_at=3), one(time_min=10, setup=[f"export PATH={bindir}"]),
                             "path-replaced"),
        unreachable=submit(CountingTask(30, pause_at=3),
                           one(time_min=10, env={"TAEHV_SCONTROL": str(unreachable_scontrol(job_dir))}),
                           "unreachable"),
        no_scontrol=submit(CountingTask(30),
                           one(time_min=10, env={"TAEHV_SCONTROL": "/nonexistent/scontrol"}),
                           "no-scontrol"),
        never_polls=submit(NeverPolls(), one(time_min=10, kill_wait_s=10, max_requeues_without_progress=0),
                           "never"),
        busy=submit(CountingTask(3000), one(time_min=15), "busy"),
        mktemp_job=make_executor(one(), mktemp_folder).submit(os.getpid),
        mktemp_folder=mktemp_folder,
        # paused at step 3 until preempted: it must still run when its test comes, late in the module
        limited=submit(CountingTask(30, pause_at=3), one(time_min=30, max_requeues=1), "limited"),
    )
    try:
        yield found
    finally:
        ids = [h.job_id for h in (found.path_replaced, found.unreachable, found.no_scontrol,
                                  found.never_polls, found.busy, found.limited)]
        subprocess.run(["scancel", *ids], capture_output=True)
        shutil.rmtree(mktemp_folder, ignore_errors=True)


def time_limit_warning(handle: JobHandle) -> None:
    """Slurm's time-limit warning, now (USR2 to the job's tasks, as `--signal=USR2@N` sends it), while the
    CountingTask waits at its pause; then it may go on."""
    run_dir = Path(handle.run_dir)
    wait_for(lambda: (run_dir / "paused").exists(), 300, f"{handle.name} to reach its pause")
    subprocess.run(["scancel", "--signal=USR2", handle.job_id], check=True)
    (run_dir / "release").touch()


def test_scontrol_found_before_a_setup_line_that_replaces_path(cases: Cases) -> None:
    handle = cases.path_replaced
    time_limit_warning(handle)
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(40)
    (requeue,) = events(handle, "requeue")
    assert (requeue["reason"], requeue["by"]) == ("timeout", "self")
    assert allocation_states(handle) == ["REQUEUED", "COMPLETED"]
    assert steps_done(handle.run_dir) == list(range(1, 31))
    assert "Traceback" not in handle.tail(200)


def test_a_refused_requeue_fails_the_job_in_one_line_and_the_name_resumes(cases: Cases) -> None:
    handle = cases.unreachable
    time_limit_warning(handle)
    assert wait_done(handle.job_id, 300) == "FAILED", handle.tail(40)
    assert allocation_states(handle) == ["FAILED"]  # never requeued: nothing claims it was
    assert not events(handle, "requeue")
    (failed,) = events(handle, "requeue_failed")
    # scontrol either reports the failed connection or does not answer in the time the signal leaves
    assert failed["reason"] == "timeout" and failed["error"].startswith("scontrol requeue: ")
    assert ("Unable to contact slurm controller" in failed["error"]
            or "did not answer within" in failed["error"])
    saved = failed["step"]
    line = one_line(handle.error)
    assert line.startswith(f"saved step {saved} but could not requeue: scontrol requeue: ")
    assert "the Slurm controller was unreachable from the node" in line
    errors = [ln for ln in handle.tail(200).splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and f"resume with `taehv submit --name {handle.name}`" in errors[0]
    status = subprocess.run([sys.executable, "-m", "jobs.status", handle.job_id,
                             "--job-dir", str(cases.job_dir)],
                            capture_output=True, text=True, cwd=REPO, timeout=60).stdout
    assert "FAILED" in status and "could not requeue" in status
    # Nothing lost: the same name resumes from the saved step.
    again = submit(CountingTask(30, pause_at=3),
                   make_cluster(cases.job_dir, nodes=1, gpus_per_node=1, time_min=10),
                   handle.name)
    assert wait_done(again.job_id, 300) == "COMPLETED", again.tail(40)
    assert events(again, "start")[-1]["step"] == saved
    assert steps_done(handle.run_dir) == list(range(1, 31))


def test_a_job_that_could_never_requeue_fails_at_the_start(cases: Cases) -> None:
    handle = cases.no_scontrol
    assert wait_done(handle.job_id, 120) == "FAILED", handle.tail(40)
    assert not events(handle, "start")  # failed before it trained anything
    assert handle.error == ("RequeueImpossibleError: TAEHV_SCONTROL=/nonexistent/scontrol is not an "
                            "executable where the job starts, so it could never requeue itself: put Slurm's "
                            "bin folder on PATH for jobs, "
                            "or set TAEHV_SCONTROL in the cluster env to scontrol's path on the nodes")


def test_a_task_that_builds_its_own_trainer_with_its_context_saves_into_the_run_folder(cases: Cases) -> None:
    name = f"nested-{uuid.uuid4().hex[:6]}"  # its train config's name: a standalone run would use runs/<name>
    cluster = make_cluster(cases.job_dir, nodes=1, gpus_per_node=1, time_min=10)
    handle = submit(functools.partial(train_with_the_context, name), cluster, "nested")
    wait_for(lambda: len(metrics(handle.run_dir)) >= 3, 300, "nested training to log")
    subprocess.run(["scontrol", "requeue", handle.job_id], check=True)  # preemption
    assert wait_done(handle.job_id, 600) == "COMPLETED", handle.tail(60)
    (requeue,) = events(handle, "requeue")
    assert (requeue["reason"], requeue["by"]) == ("preempted", "slurm") and requeue["step"] > 0
    assert events(handle, "start")[-1]["step"] == requeue["step"]  # resumed where it saved
    steps = [row["step"] for row in metrics(handle.run_dir) if "loss" in row]
    assert steps == list(range(1, 31))
    assert (RunFolder(handle.run_dir).checkpoints / f"step_{requeue['step']:08d}").is_dir()
    assert not (REPO / "runs" / name).exists()  # not a folder of its own in the job's cwd


def test_a_task_that_never_polls_is_reported_once_and_counts_as_no_progress(cases: Cases) -> None:
    handle = cases.never_polls
    wait_for(lambda: events(handle, "start"), 120, "the task to start")
    subprocess.run(["scontrol", "requeue", handle.job_id], check=True)
    assert wait_done(handle.job_id, 300) == "FAILED", handle.tail(40)
    kinds = [e["event"] for e in events(handle)]
    # the requeue no rank could record (none polls), recorded by the next start before its guards stop it;
    # "failure" was missed once under load
    assert kinds == ["start", "failure", "requeue", "stopped"], (kinds, handle.tail(60))
    assert events(handle, "requeue")[0]["noted_at_start"]
    (failure,) = events(handle, "failure")
    assert failure["error"].startswith("the task never called ctx.step_boundary (or ctx.should_stop) "
                                       "in the 5 s")
    assert events(handle, "stopped")[0]["reason"].startswith("no progress: 1 starts in a row began at step 0")
    said = [ln for ln in handle.tail(200).splitlines() if ln.startswith("[taehv] the task never called")]
    assert len(said) == 1  # reported once (the stop reason that follows quotes it as the last error)


def test_one_live_job_per_run(cases: Cases) -> None:
    handle = cases.busy
    wait_for(lambda: len(steps_done(handle.run_dir)) >= 3, 300, "the busy run to train")
    cluster = make_cluster(cases.job_dir, nodes=1, gpus_per_node=1, time_min=15)
    registry = JobDir(cases.job_dir).registry.read_text()
    with pytest.raises(RunBusyError) as err:
        submit(CountingTask(3000), cluster, "busy")
    message = one_line(str(err.value))
    assert f"run busy already has job {handle.job_id} (RUNNING)" in message
    assert f"taehv logs {handle.job_id} --follow" in message and f"taehv cancel {handle.job_id}" in message
    assert "--force" in message
    assert JobDir(cases.job_dir).registry.read_text() == registry  # nothing submitted

    # Started around submit() (another registry, by hand): the run folder's lock refuses it.
    stray = make_executor(cluster, Path(handle.run_dir) / "stray-submitit", run_dir=handle.run_dir)
    job = stray.submit(RequeueableTask(CountingTask(3000), handle.run_dir, backend=SlurmBackend()))
    assert wait_done(str(job.job_id), 120) == "FAILED"
    log = Path(handle.run_dir) / "stray-submitit" / f"{job.job_id}_0_log.out"
    assert (f"is trained by job {handle.job_id} (RUNNING): two jobs must never train one folder"
            in log.read_text())
    assert handle.state == "RUNNING"
    done = steps_done(handle.run_dir)
    assert done == list(range(1, len(done) + 1))  # the second job trained nothing

    # --force: the live job is cancelled (it saves), then the new one resumes from that step.
    forced = submit(CountingTask(3000), cluster, "busy", force=True)
    (cancelled,) = events(handle, "cancelled")
    assert wait_done(handle.job_id, 60) == "CANCELLED"
    wait_for(lambda: [e for e in events(forced, "start") if e["job_id"] == forced.job_id], 120,
             "the forced job to start")
    assert ([e for e in events(forced, "start") if e["job_id"] == forced.job_id][0]["step"]
            == cancelled["step"])
    subprocess.run(["scancel", forced.job_id], check=True)


def test_an_overwritten_checkpoint_is_found_once_and_the_run_resumes_before_it(cases: Cases) -> None:
    from taehv_slurm.training import submit_training

    cluster = make_cluster(cases.job_dir, nodes=1, gpus_per_node=2, time_min=10)  # two ranks resume it
    steady = {"intervals.log_every": 1, "intervals.ckpt_every": 2, "intervals.keep_checkpoints": 3}
    first = submit_training(cluster, quick_train(steps=6, **steady), "damaged")[0]
    assert wait_done(first.job_id, 300) == "COMPLETED", first.tail(40)
    newest = RunFolder(first.run_dir).checkpoints / "step_00000006" / "state.pt"
    size = newest.stat().st_size
    with open(newest, "r+b") as f:  # 4 KiB of random bytes in the middle: same size, still a zip file
        f.seek(size // 2)
        f.write(os.urandom(4096))
    assert newest.stat().st_size == size
    again = submit_training(cluster, quick_train(steps=8, **steady), "damaged")[0]
    assert wait_done(again.job_id, 300) == "COMPLETED", again.tail(40)
    log = again.tail(200)
    assert ("checkpoint step 6 is damaged (state.pt does not match its checksum (overwritten since it was "
            "saved))" in log and "resuming from step 4" in log), log
    assert "resumed from step 4" in log
    aside = list(RunFolder(first.run_dir).checkpoints.glob("step_00000006.damaged-*"))
    assert len(aside) == 1 and (aside[0] / "state.pt").stat().st_size == size  # kept, never deleted
    (damaged,) = events(again, "checkpoint_damaged")  # decided once, by rank 0, for both ranks
    assert "checkpoint step 6 is damaged" in damaged["detail"]
    assert events(again, "start")[-1]["step"] == 4
    assert not [e for e in events(again) if e["event"] in ("failure", "killed")]


def test_an_executor_folder_made_by_mktemp_runs(cases: Cases) -> None:
    assert wait_done(str(cases.mktemp_job.job_id), 120) == "COMPLETED"
    assert isinstance(cases.mktemp_job.result(), int)


class TakesNothing:
    def __call__(self) -> None:
        pass


def test_submit_refuses_callables_that_cannot_take_the_context(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path / "jobs")
    for task in (lambda: None, TakesNothing()):
        with pytest.raises(NotRequeueableError) as err:
            submit(task, cluster, "never")
        message = one_line(str(err.value))
        assert ("cannot be called with its run context" in message
                and "ctx.step_boundary(step, save)" in message)
        assert "requeueable=False" in message
    assert not (tmp_path / "jobs").exists()  # refused before any folder was made


def test_the_requeue_limit_stops_the_job_when_it_would_start_once_more(cases: Cases) -> None:
    """`max_requeues: 1`: one restart of the job, for any reason; preempted a second time, it saves as
    ever, but its next start is refused (`stopped`, the reason in `taehv status`) and it ends FAILED."""
    handle = cases.limited
    for attempt in (1, 2):  # preempt each attempt once it waits at its pause (step 3)
        wait_for(lambda attempt=attempt: len(events(handle, "start")) == attempt
                 and rank_record(handle, 0).get("restart") == attempt - 1
                 and rank_record(handle, 0).get("step") == 3, 300, f"attempt {attempt} to train")
        subprocess.run(["scontrol", "requeue", handle.job_id], check=True)
        wait_for(lambda attempt=attempt: len(events(handle, "requeue")) == attempt, 120, "its requeue")
    assert wait_done(handle.job_id, 300) == "FAILED", handle.tail(40)
    assert [(e["reason"], e["by"]) for e in events(handle, "requeue")] == [("preempted", "slurm")] * 2
    (stopped,) = events(handle, "stopped")
    assert stopped["reason"] == "requeue limit reached: the job started 2 times (max_requeues=1)"
    assert len(events(handle, "start")) == 2 and handle.summary()["note"] == stopped["reason"]
    assert "[taehv] not starting: requeue limit reached" in handle.tail(100)
