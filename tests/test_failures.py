"""A run never trains on garbage and never loops on a failure that will repeat (real Slurm testbed).

Faults come from outside the task, as a cluster inflicts them:
- `diverged`: the user's command with lr 0.5 — the loss is not finite from the second step;
- `repeats`: a task that fails the same way at the same step in every attempt (as an OOM does): started
  again inside the allocation on the same node once, then stopped;
- `late`: a task whose first step took 45 s (as a cold compile can) fails when fewer seconds are left before
  its time limit than a restart would need: the job requeues instead of restarting in its allocation;
- `startup`: a missing dataset, found when the job starts;
- `killed`: one rank's process is killed with SIGKILL (as the out-of-memory killer does);
- `step_killed`: `scancel --signal=KILL JOB.0`, every process of the job step at once;
- `unreleased`: a rank killed as above where scontrol refuses to release the job it requeued held;
- `ecc`: a rank raises the error of a GPU's uncorrectable ECC error (a hardware fault: its node is left out);
- `disk`: a rank's write to its node's own disk (a /tmp cache) finds it full (the node is left out too);
- `killed_twice`: both ranks of a 2-node job are killed by SIGKILL at the same step in every attempt;
- `lost`: every process of the job SIGKILLed at once (a node that lost power), then Slurm requeues the job.
And a run whose folder's filesystem fills up under it, to the last byte, or turns read-only (their own tests,
on a small tmpfs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.faults import rank_record, wait_for
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.goodput import attempt_rows
from taehv_slurm.handle import JobHandle
from taehv_slurm.reports import describe_requeue
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.runtime.requeue import unrecorded_requeue
from taehv_slurm.runtime.restart import RESTART_MARGIN_S
from taehv_slurm.sacct import requeue_count
from taehv_slurm.slurm import job_info, seconds_left
from taehv_slurm.submission import submit
from taehv_slurm.training import submit_training
from tests.helpers import REPO, cli, events, make_cluster, mounted_tmpfs, quick_train, tiny_train, wait_done
from tests.tasks import CountingTask, FailsAtStep, FailsWhenTold, MeetsAFault

pytestmark = pytest.mark.usefixtures("slurm_cluster")


@dataclass
class Jobs:
    job_dir: Path
    repeats: JobHandle
    startup: JobHandle
    killed: JobHandle
    step_killed: JobHandle
    unreleased: JobHandle
    ecc: JobHandle
    disk: JobHandle
    killed_twice: JobHandle
    late: JobHandle
    lost: JobHandle


# `late`: a 4-minute limit, its warning (USR2) 30 s before it, so up to 90 s before it (Slurm may send it up
# to 60 s early). A restart needs its first step's time + 90 s: the failure comes between the two with a
# first step of 45 s (as the test makes it) to 145 s (a loaded 2-core machine took 87 s to reach it, where a
# 3-minute limit left too few seconds for the failure to come before the warning)
LATE_SIGNAL_DELAY_S, LATE_TIME_MIN = 30, 4


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> Iterator[Jobs]:
    job_dir = tmp_path_factory.mktemp("failures")
    with mounted_tmpfs(tmp_path_factory.mktemp("node-tmp"), "size=1m,mode=700") as node_tmp:
        subprocess.run(["fallocate", "-l", str(shutil.disk_usage(node_tmp).free), str(node_tmp / "full")],
                       check=True)
        yield from submitted_jobs(job_dir, node_tmp)


def submitted_jobs(job_dir: Path, node_tmp: Path) -> Iterator[Jobs]:
    one = make_cluster(job_dir, nodes=1, gpus_per_node=1, time_min=10)
    missing = tiny_train(steps=5, **{"data.source": "video", "data.path": str(job_dir / "no-videos")})
    # The killed ones run until killed, then finish 20 steps after their restart.
    until_killed = CountingTask(3000, step_s=0.1, steps_after_restart=20)
    found = Jobs(job_dir=job_dir, repeats=submit(FailsAtStep(3), one, "repeats"),
                 # the job's own start-up check, as where the login node cannot see the data
                 startup=submit_training(dataclasses.replace(one, check_data_on_submit=False), missing,
                                         "startup")[0],
                 killed=submit(until_killed, one, "killed"),
                 step_killed=submit(until_killed, one, "step-killed"),
                 unreleased=submit(until_killed, dataclasses.replace(
                     one, env={"TAEHV_SCONTROL": str(refusing_release_scontrol(job_dir))}), "unreleased"),
                 ecc=submit(MeetsAFault("ecc", step=3, steps=6), one, "ecc"),
                 disk=submit(MeetsAFault("disk", step=3, steps=6, folder=str(node_tmp)), one, "disk"),
                 # a heartbeat of 1 s: the ranks' records show the step before they die 2.5 s into it
                 killed_twice=submit(MeetsAFault("kill", step=3, steps=6, wait_s=2.5), make_cluster(
                     job_dir, nodes=2, gpus_per_node=1, time_min=10, heartbeat_s=1), "killed-twice"),
                 # paused at step 0 until the test releases it: its first step as slow as the test makes it
                 late=submit(FailsWhenTold(3000, step_s=0.2, pause_at=0, steps_after_restart=5),
                             dataclasses.replace(one, time_min=LATE_TIME_MIN,
                                                 signal_delay_s=LATE_SIGNAL_DELAY_S),
                             "late"),
                 lost=submit(until_killed, one, "lost"))
    try:
        yield found
    finally:
        handles = [getattr(found, f.name) for f in dataclasses.fields(found) if f.name != "job_dir"]
        subprocess.run(["scancel", *(h.job_id for h in handles)], capture_output=True)


def refusing_release_scontrol(folder: Path) -> Path:
    """The real scontrol, except that `scontrol release` is refused as a site's policy can refuse it."""
    wrapper = folder / "scontrol"
    refuse = 'echo "scontrol: error: Access/permission denied" >&2; exit 1'
    real = shutil.which("scontrol")
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = release ] && {{ {refuse}; }}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_a_diverged_run_fails_in_one_line_and_never_saves_garbage(tmp_path: Path) -> None:
    done = cli("jobs.submit", "--cluster", "configs/cluster/testbed.yaml", "--train",
               "configs/train/tiny.yaml", "--set", "gpus_per_node=2", "--set", "optim.lr=0.5", "--set",
               "steps=120", "--set", "intervals.ckpt_every=1", "--set", f"job_dir={tmp_path}", "--name",
               "nan", "--follow", cwd=REPO, timeout=600)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and len(errors) == 1, done.stdout[-3000:] + done.stderr
    stopped_at = int(re.match(r"error: DivergedError: step (\d+): ", errors[0]).group(1))
    assert "not finite in 3 steps in a row" in errors[0]
    assert "lower optim.lr (now 0.5) or lengthen optim.warmup_steps" in errors[0]
    run = RunFolder(tmp_path / "nan")
    job = JobHandle.attach("nan", tmp_path)
    assert wait_done(job.job_id, 60) == "FAILED"
    # Saved after every step (ckpt_every 1) except the three skipped ones: the newest checkpoint is the
    # step before them, and none was written while steps were skipped.
    latest = Checkpointer(run.checkpoints).latest_step()
    assert latest == stopped_at - 3 and f"the last checkpoint is step {latest} (" in errors[0]
    saved = [e["step"] for e in events(job, "checkpoint")]
    assert saved == list(range(1, latest + 1)), saved
    _, state, _ = Checkpointer(run.checkpoints).load_latest()
    assert all(bool(v.isfinite().all()) for v in state["params"].values())  # `latest` is never garbage
    for line in run.metrics().path.read_text().splitlines():  # strict JSON: null, never NaN
        json.loads(line, parse_constant=lambda token: pytest.fail(f"{token} in metrics.jsonl"))
    assert not [e for e in events(job, "failure") if not e.get("fatal")]  # one recorded stop, no requeue
    assert not events(job, "requeue")

    # A checkpoint that does hold non-finite weights (written by hand here) is never exported.
    _, state, meta = Checkpointer(run.checkpoints).load_latest()
    name = next(iter(state["params"]))
    state["params"][name][0] = math.nan
    Checkpointer(RunFolder(tmp_path / "poisoned").checkpoints).save(state, 1, meta)
    refused = cli("jobs.export", str(tmp_path / "poisoned"), "--out", str(tmp_path / "x.pth"), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"error: checkpoint step 1 holds non-finite weights (1 tensor(s), e.g. {name}): the run diverged; "
        "export an earlier checkpoint (its checkpoints/step_N folder)")
    assert not (tmp_path / "x.pth").exists()
    # Resumed from it, the weights stay non-finite (each update is skipped); one step is within the budget,
    # and the save at the run's end refuses the state: the poisoned checkpoint stays the latest.
    from taehv_slurm.trainer.task import TrainTask  # torch, the model: in this test's process only
    from taehv_slurm.trainer.train import DivergedError

    with pytest.raises(DivergedError) as err:
        TrainTask(tiny_train(steps=2).to_dict(),
                  {"device": "cpu", "torch_threads": 1, "run_dir": str(tmp_path / "poisoned")})()
    assert str(err.value).startswith(f"step 2: the model state holds non-finite values (1 tensor(s), e.g. "
                                     f"params.{name}); it was not saved, the last checkpoint stays latest")
    assert Checkpointer(RunFolder(tmp_path / "poisoned").checkpoints).steps() == [1]


def test_a_failure_that_repeats_stops_after_two_attempts(jobs: Jobs) -> None:
    handle = jobs.repeats
    assert wait_done(handle.job_id, 300) == "FAILED", handle.tail(40)
    first, second = events(handle, "start")
    # the first failure (the code may not repeat it): the ranks started again inside the allocation, on the
    # same node, as the same job; the second: stopped
    (restart,) = events(handle, "restart")
    assert (restart["cause"], restart["left_out"]) == ("failure", [])
    assert restart["nodes"] == restart["nodes_before"] == [first["host"]]
    assert (second["job_id"], second["restart_count"], second["host"]) == (first["job_id"], 0, first["host"])
    assert not events(handle, "requeue")
    (stopped,) = events(handle, "stopped")
    assert stopped["reason"].startswith("the same failure ended two attempts in a row (MemoryError: CUDA out "
                                        "of memory. Tried to allocate 2.00 GiB), so another would end the "
                                        "same way")
    assert handle.summary()["note"] == stopped["reason"]


def test_a_start_up_failure_is_not_retried(jobs: Jobs) -> None:
    handle = jobs.startup
    assert wait_done(handle.job_id, 300) == "FAILED", handle.tail(40)
    assert not events(handle, "start") and not events(handle, "requeue")
    assert handle.error.startswith("ValueError: video folder ") and "does not exist" in handle.error


def test_a_killed_rank_is_named_and_the_job_retries_on_another_node(jobs: Jobs) -> None:
    handle = jobs.killed
    wait_for(lambda: (rank_record(handle, 0).get("step") or 0) >= 5, 180, "the job to train")
    first = rank_record(handle, 0)
    os.kill(first["pid"], signal.SIGKILL)  # as the kernel's out-of-memory killer does: one process
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(60)
    (killed,) = events(handle, "killed")
    assert (killed["ranks"], killed["hosts"], killed["signal_name"]) == ([0], [first["host"]], "SIGKILL")
    assert killed["detail"].startswith(f"rank 0 on {first['host']} was killed by SIGKILL")
    (requeue,) = events(handle, "requeue")
    assert requeue["reason"] == "killed" and requeue["excluded"] == [first["host"]]
    assert events(handle, "start")[-1]["host"] != first["host"]  # the next attempt ran elsewhere
    assert f"rank 0 on {first['host']} was killed by SIGKILL" in handle.summary()["note"]


def test_a_job_left_held_after_its_requeue_says_so_and_how_to_release_it(jobs: Jobs) -> None:
    """Moving a job off a failed node holds it while its excluded nodes change; if the release is then
    refused, the job would wait held for good: status says so, with the command that releases it."""
    handle = jobs.unreleased
    wait_for(lambda: (rank_record(handle, 0).get("step") or 0) >= 5, 180, "the job to train")
    os.kill(rank_record(handle, 0)["pid"], signal.SIGKILL)
    wait_for(lambda: events(handle, "requeue"), 120, "the requeue to be recorded")
    (requeue,) = events(handle, "requeue")
    assert requeue["release_error"] == (f"scontrol release {handle.job_id}: scontrol: error: "
                                        "Access/permission denied")

    def settled() -> str | None:  # the requeued job passes through COMPLETING while its processes end
        state = handle.state
        return None if state in ("RUNNING", "REQUEUED", "COMPLETING") else state

    assert wait_for(settled, 120, "the requeued job to settle") == "PENDING"  # and then it waits, held
    status = cli("jobs.status", handle.job_id, "--job-dir", str(handle.job_dir), "--format", "json")
    (row,) = json.loads(status.stdout)
    assert row["note"] == (f"held since its requeue ({requeue['release_error']}): "
                           f"run `scontrol release {handle.job_id}`")
    subprocess.run(["scontrol", "release", handle.job_id], check=True)  # what the note says to do
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(60)
    assert "held since" not in handle.summary()["note"]


def test_a_job_step_killed_from_outside_names_the_signal_rank_and_host(jobs: Jobs) -> None:
    handle = jobs.step_killed
    wait_for(lambda: (rank_record(handle, 0).get("step") or 0) >= 5, 180, "the job to train")
    host = rank_record(handle, 0)["host"]
    subprocess.run(["scancel", "--signal=KILL", f"{handle.job_id}.0"], check=True)
    wait_for(lambda: events(handle, "killed"), 120, "the kill to be recorded")
    (killed,) = events(handle, "killed")
    assert (killed["ranks"], killed["hosts"], killed["signal"]) == ([0], [host], signal.SIGKILL)
    status = cli("jobs.status", handle.job_id, "--job-dir", str(handle.job_dir), "--format", "json")
    (row,) = json.loads(status.stdout)
    assert f"rank 0 on {host} was killed by SIGKILL" in row["note"]
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(60)


def test_a_hardware_error_moves_the_job_off_its_node(jobs: Jobs) -> None:
    """A rank's error that names the GPU's hardware (ECC, Xid) is a node fault: the job is requeued without
    that node and resumes from its checkpoint elsewhere."""
    handle = jobs.ecc
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(60)
    first, second = events(handle, "start")
    (failure,) = events(handle, "failure")
    assert (failure["error"], failure["step"], failure["host"]) == (
        "RuntimeError: CUDA error: uncorrectable ECC error encountered", 3, first["host"])
    (requeue,) = events(handle, "requeue")
    assert (requeue["reason"], requeue["excluded"], requeue["excluded_now"]) == (
        "failure", [first["host"]], [first["host"]])
    assert second["host"] != first["host"] and second["step"] == requeue["step"] == 3


def test_a_nodes_own_disk_full_moves_the_job_off_that_node(jobs: Jobs) -> None:
    """A write to the node's own disk (its /tmp, not the shared job folder) that finds it full is a node
    fault, as a GPU's: the job is requeued without that node, not stopped as a full job folder stops it."""
    handle = jobs.disk
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(60)
    first, second = events(handle, "start")
    (failure,) = events(handle, "failure")
    seen = (failure["error"], failure["step"], failure["host"], failure.get("node_fault"))
    assert seen == ("OSError: [Errno 28] No space left on device", 3, first["host"], True), failure
    assert not failure.get("fatal")
    (requeue,) = events(handle, "requeue")
    assert (requeue["excluded"], requeue["excluded_now"]) == ([first["host"]], [first["host"]])
    assert second["host"] != first["host"] and second["step"] == 3


def test_a_rank_killed_at_the_same_step_twice_stops_and_exclusion_leaves_room(jobs: Jobs) -> None:
    """Both ranks of a 2-node job die by SIGKILL at step 3: their two nodes would be left out, but the
    testbed's partition of 3 nodes must still hold the job, so only the first is; killed again at the same
    step, by the same signal, the run stops instead of trying a third time."""
    handle = jobs.killed_twice
    assert wait_done(handle.job_id, 300) == "FAILED", handle.tail(60)
    first, second = events(handle, "killed")
    seen = [(e["step"], e["signal_name"], e["ranks"]) for e in (first, second)]
    assert seen == [(3, "SIGKILL", [0, 1])] * 2, (first, second)
    (requeue,) = events(handle, "requeue")
    assert len(first["hosts"]) == 2 and requeue["excluded"] == first["hosts"][:1]
    assert requeue["exclusion_capped"] == "the partition must still hold the job"
    assert first["hosts"][0] not in second["hosts"]
    (stopped,) = events(handle, "stopped")
    assert stopped["reason"].startswith(f"the same failure ended two attempts in a row ({second['detail']})")
    assert len(events(handle, "start")) == 2 and handle.summary()["note"] == stopped["reason"]


def test_near_its_time_limit_a_failure_requeues_instead_of_restarting(jobs: Jobs) -> None:
    """A restart pays only with time left to train: it needs its start-up (the run's first step took 45 s
    here), the time-limit warning's delay and a minute. With fewer seconds left, the job requeues (a fresh
    time limit) instead of restarting in its allocation; it resumes and completes."""
    handle = jobs.late
    run = Path(handle.run_dir)
    (start,) = wait_for(lambda: events(handle, "start"), 180, "the job to start")
    wait_for(lambda: (run / "paused").exists(), 60, "its first step to begin")
    time.sleep(max(0.0, start["began"] + 45 - time.time()))
    (run / "release").touch()
    (first,) = wait_for(lambda: events(handle, "first_step"), 60, "its first step")
    needs = first["seconds"] + LATE_SIGNAL_DELAY_S + RESTART_MARGIN_S  # restart.restart_needs_s

    def left() -> float:
        return seconds_left(job_info(handle.job_id), time.time())

    wait_for(lambda: left() <= needs - 20, 120, "fewer seconds left than a restart needs")
    # and still more than the time limit's warning can come before it: the failure comes first
    assert left() > LATE_SIGNAL_DELAY_S + 60 + 5, (left(), needs)
    (run / "fail").touch()
    (requeue,) = wait_for(lambda: events(handle, "requeue"), 120, "the requeue")
    assert (requeue["reason"], requeue["failed_at_step"] > 0) == ("failure", True), requeue
    assert not events(handle, "restart")  # not inside the allocation
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(60)
    assert [e["restart_count"] for e in events(handle, "start")] == [0, 1]


def processes_of(job_id: str) -> list[int]:
    """Every process of the job on the testbed's nodes (its batch script, srun, the ranks): those whose
    environment holds SLURM_JOB_ID=job_id."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"SLURM_JOB_ID={job_id}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_requeue_nothing_in_the_job_could_record_is_recorded_at_its_next_start(jobs: Jobs) -> None:
    """Every process of the job SIGKILLed at once, as a node that loses power leaves them (no rank saves, the
    batch script says nothing), then `scontrol requeue`, as Slurm requeues a job after NODE_FAIL: the next
    start records the requeue with the state Slurm's accounting gives that allocation, and status and
    goodput count it (before, the run's files knew of no requeue)."""
    lost = jobs.lost
    wait_for(lambda: (Path(lost.run_dir) / "steps.txt").exists(), 180, "the job to train")
    for pid in processes_of(lost.job_id):
        os.kill(pid, signal.SIGKILL)
    subprocess.run(["scontrol", "requeue", lost.job_id], check=True, capture_output=True)
    assert wait_done(lost.job_id, 300) == "COMPLETED", lost.tail(60)
    (noted,) = events(lost, "requeue")
    assert (noted["by"], noted["reason"], noted["noted_at_start"], noted["segment"]) == \
        ("slurm", "requeued", True, 0), noted
    assert [e["restart_count"] for e in events(lost, "start")] == [0, 1]
    summary, goodput = lost.summary(), lost.goodput()
    assert summary["requeues"] == lost.requeue_count == 1 and "requeued at step 0 by Slurm" in summary["note"]
    assert list(goodput["end"]) == ["requeue (requeued)", "finished"], goodput


def test_a_node_failure_slurm_requeued_ends_its_attempt_as_that_requeue() -> None:
    """The events of a real run: a 1-node job of the tiny config on the testbed, its node set down
    (`scontrol update nodename=tb1 state=down`); its rank saved at Slurm's SIGTERM and recorded that the job
    step ended, then died with the node, and Slurm requeued the job after NODE_FAIL. Its next start found
    the requeue unrecorded and recorded it with accounting's NODE_FAIL; goodput ends the attempt with it."""
    history = [json.loads(line) for line in (REPO / "tests/fixtures/node_fail_events.jsonl").open()]
    noted = next(i for i, e in enumerate(history) if e.get("noted_at_start"))
    assert unrecorded_requeue(history[:noted], "4", 1) == {"segment": 0, "time": history[noted - 1]["time"]}
    assert unrecorded_requeue(history[:noted], "4", 0) is None and unrecorded_requeue(history, "4", 1) is None
    rows = attempt_rows(history, [], 1, 120)
    assert [row["end"] for row in rows] == ["requeue (node_fail)", "finished"]
    assert describe_requeue(history[noted]) == ("requeued at step 36 by Slurm (node_fail; the job could not "
                                                "record it)")
    accounting = [{"JobID": "4", "State": "NODE_FAIL", "Attempt": 0},
                  {"JobID": "4.batch", "State": "CANCELLED", "Attempt": 0},
                  {"JobID": "4", "State": "COMPLETED", "Attempt": 1}]
    assert requeue_count(accounting, "4") == 1 and requeue_count(accounting[:2], "4") == 0


def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes_once_there_is_room(tmp_path: Path) -> None:
    # The run folder's filesystem fills under a running job (a quota reached, a shared scratch filling up):
    # its save fails, and a restart or a requeue would fail the same way at its next save
    with mounted_tmpfs(tmp_path / "scratch", "size=96m,mode=700") as scratch:
        cluster = make_cluster(scratch, nodes=1, gpus_per_node=2, time_min=10)
        train = quick_train(steps=200, **{"intervals.ckpt_every": 20, "intervals.log_every": 5})
        [job] = submit_training(cluster, train, run_name="full")
        checkpoints = Checkpointer(RunFolder(job.run_dir).checkpoints)
        wait_for(lambda: checkpoints.latest_step() is not None, 180, "the first checkpoint")
        filler = scratch / "filler"  # leaves 256 KiB: room for the events, not for a checkpoint
        room = shutil.disk_usage(scratch).free - 2**18
        subprocess.run(["fallocate", "-l", str(room), str(filler)], check=True)
        assert wait_done(job.job_id, 180) == "FAILED", job.tail(40)
        kept = checkpoints.latest_step()
        ends = ("start", "failure", "restart", "requeue", "stopped")
        outcomes = [e["event"] for e in events(job) if e["event"] in ends]
        assert outcomes == ["start", "failure"]  # rank 0 records it once; nothing restarts or requeues
        assert job.error.startswith("SaveFailedError: saving checkpoint step "), job.error
        assert "(No space left on device)" in job.error
        assert job.error.endswith(f"the previous checkpoint (step {kept}) is intact; free space there, then "
                                  f"submit the run again: it resumes from step {kept}"), job.error
        status = cli("jobs.status", job.job_id, "--job-dir", str(scratch))
        assert "FAILED" in status.stdout and "No space left on device" in status.stdout, status.stdout
        filler.unlink()
        [again] = submit_training(cluster, train, run_name="full")
        assert wait_done(again.job_id, 300) == "COMPLETED", again.tail(40)
        assert events(again, "start")[-1]["step"] == kept and checkpoints.latest_step() == 200


def steps_of(job_id: str) -> list[str]:
    """The job steps Slurm ran for `job_id` (`5.0`, `5.1` after a restart inside the allocation)."""
    out = subprocess.run(["sacct", "-n", "-P", "-o", "JobID", "-j", job_id], capture_output=True, text=True,
                         check=True).stdout.split()
    return [s for s in out if s.split(".")[-1].isdigit() and "." in s]


def started_and_saved(scratch: Path, name: str) -> tuple[JobHandle, Checkpointer]:
    cluster = make_cluster(scratch, nodes=1, gpus_per_node=2, time_min=10)
    train = quick_train(steps=400, **{"intervals.ckpt_every": 20, "intervals.log_every": 5})
    [job] = submit_training(cluster, train, run_name=name)
    checkpoints = Checkpointer(RunFolder(job.run_dir).checkpoints)
    wait_for(lambda: checkpoints.latest_step() is not None, 180, "the first checkpoint")
    return job, checkpoints


def test_a_disk_full_to_the_last_byte_stops_the_run_at_its_next_write_in_one_line(tmp_path: Path) -> None:
    # Not even a metrics line fits (the save's room is not what runs out first): no restart meets it again
    with mounted_tmpfs(tmp_path / "scratch", "size=96m,mode=700") as scratch:
        job, checkpoints = started_and_saved(scratch, "full")
        subprocess.run(["fallocate", "-l", str(shutil.disk_usage(scratch).free), str(scratch / "filler")],
                       check=True)
        assert shutil.disk_usage(scratch).free == 0
        assert wait_done(job.job_id, 120) == "FAILED", job.tail(40)
        kept = checkpoints.latest_step()
        assert steps_of(job.job_id) == [f"{job.job_id}.0"]  # the ranks were not started again
        status = cli("jobs.status", job.job_id, "--job-dir", str(scratch)).stdout
        assert "FAILED" in status and "No space left on device" in status, status
        assert f"free space there, then submit the run again: it resumes from step {kept}" in status, status
        # what a file's page still held was recorded: once, as the run's end, by the rank that met it
        if recorded := [e for e in events(job) if e["event"] in ("failure", "restart", "stopped")]:
            assert [(e["event"], e.get("fatal")) for e in recorded] == [("failure", True)], recorded


def test_a_run_folder_turned_read_only_fails_the_job_and_status_says_why(tmp_path: Path) -> None:
    # A filesystem remounted read-only under a running job (as one does after errors): nothing can record
    # the failure, so `taehv status` finds it; the job ends at once instead of restarting into it
    with mounted_tmpfs(tmp_path / "scratch", "size=96m,mode=700") as scratch:
        job, checkpoints = started_and_saved(scratch, "ro")
        # read-only from here for every path under it (files already open stay writable: the logs)
        subprocess.run(["mount", "--bind", str(scratch), str(scratch)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(scratch)], check=True)
            assert wait_done(job.job_id, 120) == "FAILED"
            kept = checkpoints.latest_step()
            assert steps_of(job.job_id) == [f"{job.job_id}.0"]
            status = cli("jobs.status", job.job_id, "--job-dir", str(scratch))
        finally:
            subprocess.run(["umount", "-l", str(scratch)], check=True)
        assert status.returncode == 0, status.stderr
        why = (f"Read-only file system: {job.run_dir} (now; the job recorded no cause); the last checkpoint "
               f"(step {kept}) is intact; have that filesystem made writable, then submit the run again: it "
               f"resumes from step {kept}")
        assert "FAILED" in status.stdout and why in status.stdout, status.stdout
