"""Sites that do not requeue: the run goes on as a chain of follow-up jobs, shown and counted as one run.

On the real testbed:
- `requeue: auto` where Slurm refuses the job's `scontrol requeue` (a site's wrapper, as a policy refuses
  it): three time-limit warnings, each time every rank saves, the refused requeue becomes a follow-up job
  (`sbatch --dependency=afternotok:JOB --kill-on-invalid-dep=yes`), and the run finishes bit-identical to
  an uninterrupted one; `taehv status` shows one run, requeued 3×, and goodput counts its four attempts;
- `requeue: follow_up` and a preemption's SIGTERM to the ranks (as slurmstepd delivers it where
  PreemptMode=CANCEL ends the job): the follow-up job resumes and finishes;
- `taehv submit --after JOB` refuses a job Slurm does not know, in one line, before anything is queued.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm.common.runfolder import JobDir
from taehv_slurm.handle import JobHandle
from taehv_slurm.registry import Registry
from taehv_slurm.runtime.steps import FOLLOW_UP_EXIT_CODE
from taehv_slurm.sacct import sacct_records
from taehv_slurm.submission import submit
from taehv_slurm.training import submit_training
from tests.helpers import (
    REPO,
    STEP_BY_STEP,
    assert_identical,
    cli,
    events,
    final_state,
    last_step,
    make_cluster,
    metrics,
    quick_train,
    wait_done,
)
from tests.tasks import CountingTask

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def refusing_requeue_scontrol(folder: Path) -> Path:
    """The real scontrol, except that `scontrol requeue` is refused, as where a site disallows it."""
    wrapper = folder / "scontrol"
    refuse = 'echo "scontrol: error: Requested operation is presently disabled" >&2; exit 1'
    wrapper.write_text(f'#!/bin/sh\ncase "$1" in requeue|requeuehold) {refuse};; esac\n'
                       f'exec {shutil.which("scontrol")} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def wait_chain_done(handle: JobHandle, timeout_s: float) -> str:
    """The final state of the run's last job (a job that handed over ends after its follow-up is recorded)."""
    while True:
        current = handle.current_job_id
        state = wait_done(current, timeout_s)
        if handle.current_job_id == current:
            return state


def test_a_refused_requeue_goes_on_as_follow_up_jobs_bit_identical(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=30,
                           env={"TAEHV_SCONTROL": str(refusing_requeue_scontrol(tmp_path))})
    train = quick_train(steps=30, **STEP_BY_STEP)
    reference = submit_training(make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=30), train,
                                "reference")[0]
    run = submit_training(cluster, train, "chained")[0]
    for n, at in enumerate((5, 12, 20), start=1):
        wait_for(lambda at=at: last_step(run.run_dir) >= at, 300, f"step {at}")
        # the time limit's warning, as Slurm sends it to the job's ranks
        subprocess.run(["scancel", "--signal=USR2", run.current_job_id], check=True)
        wait_for(lambda n=n: len(events(run, "start")) > n, 300, f"follow-up {n} to start")
    assert wait_chain_done(run, 600) == "COMPLETED", run.tail(60)
    assert wait_done(reference.job_id, 600) == "COMPLETED"

    chain = run.chain()
    assert len(chain) == 4 and chain[0] == run.job_id
    requeues = events(run, "requeue")
    assert [(e["reason"], e["by"], e["follow_up"]) for e in requeues] == [
        ("timeout", "follow-up", job) for job in chain[1:]]
    assert all("presently disabled" in e["requeue_refused"] for e in requeues)
    assert [e["job_id"] for e in events(run, "start")] == chain
    steps = [row["step"] for row in metrics(run.run_dir) if "loss" in row]
    assert steps == list(range(1, 31))  # every step once, across four jobs
    _, ref_state, _ = final_state(reference.run_dir)
    step, state, _ = final_state(run.run_dir)
    assert step == 30
    for key in ("params", "exp_avg", "exp_avg_sq", "optimizer_step"):
        assert_identical({key: ref_state[key]}, {key: state[key]})

    # Slurm's record: each handed-over job FAILED with the follow-up's exit code, the last COMPLETED
    ends = {r["JobID"]: (r["State"], r["ExitCode"]) for r in sacct_records() if r["JobID"] in chain}
    assert [ends[j] for j in chain] == [("FAILED", f"{FOLLOW_UP_EXIT_CODE}:0")] * 3 + [("COMPLETED", "0:0")]
    registry = Registry.load(tmp_path)
    assert registry.job_ids().count(chain[-1]) == 1 and not set(chain[:-1]) & set(registry.job_ids())
    shown = cli("jobs.status", "--job-dir", str(tmp_path), "--format", "json")
    rows = [r for r in json.loads(shown.stdout) if r["run"] == "chained"]
    assert len(rows) == 1 and rows[0]["state"] == "COMPLETED" and rows[0]["requeues"] == 3, shown.stdout
    goodput = JobHandle.attach("chained", tmp_path).goodput()
    assert list(goodput["attempt"]) == [0, 1, 2, 3] and int(goodput["steps_kept"].sum()) == 30
    assert goodput["queue_s"].notna().all() and (goodput["allocated_node_s"] > 0).all()


def test_a_cancelling_preemption_goes_on_as_a_follow_up_job(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=10, requeue="follow_up")
    run = submit(CountingTask(80, step_s=0.1), cluster, "cancelled-by-preemption")
    script = (run.folder / f"{run.job_id}_submission.sh").read_text()
    assert "#SBATCH --no-requeue" in script and "#SBATCH --requeue" not in script
    wait_for(lambda: (run.run_dir / "steps.txt").exists()
             and len((run.run_dir / "steps.txt").read_text().split()) >= 10, 120, "the job to train")
    subprocess.run(["scancel", "--signal=TERM", run.job_id], check=True)
    assert wait_chain_done(run, 300) == "COMPLETED", run.tail(60)
    (requeue,) = events(run, "requeue")
    assert (requeue["reason"], requeue["by"]) == ("preempted", "follow-up")
    trained = [int(n) for n in (run.run_dir / "steps.txt").read_text().split()]
    assert sorted(set(trained)) == list(range(1, 81)) and len(run.chain()) == 2


def test_after_a_job_slurm_does_not_know_is_refused_before_anything_is_queued(tmp_path: Path) -> None:
    done = cli("jobs.submit", "--cluster", "configs/cluster/testbed.yaml", "--set", f"job_dir={tmp_path}",
               "--after", "999999", cwd=REPO)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: --after 999999: Slurm knows no job 999999 (neither squeue nor sacct lists it): check the id "
        "(`squeue --me`, `taehv status`)"]
    assert not JobDir(tmp_path).registry.exists()
