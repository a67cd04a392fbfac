"""JobHandle and the status/logs/cancel/submit CLIs against real jobs on the Slurm testbed.

One module fixture submits every job at once (they run side by side on the testbed's two nodes, so
the module's wall time is about that of its longest job):

- `train`: tiny training, 1 node × 2 tasks — observed RUNNING, requeued once with `scontrol requeue`,
  then COMPLETED; its TensorBoard files and rank-0 log are read back.
- `doomed`: a long training, cancelled with `python -m jobs.cancel` once it trains → CANCELLED.
- `crash`: tests.tasks.CrashAfterStart with requeue_on_failure off → FAILED with its error.
- a sweep of two learning rates through `python -m jobs.submit --sweep --max-parallel 1` → one job
  array whose runs go one at a time.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm import jobstates
from taehv_slurm.cli.watch import MetricsTail, progress_line
from taehv_slurm.common.runfolder import EventLog, JobDir, RunFolder
from taehv_slurm.handle import JobHandle
from taehv_slurm.reports import registry_frame
from taehv_slurm.runs import runs_frame
from taehv_slurm.submission import submit
from taehv_slurm.training import submit_training
from tests.helpers import (
    REPO,
    cli,
    documented,
    in_terminal,
    make_cluster,
    quick_train,
    read_strictly,
    tiny_train,
    unreachable_accounting_conf,
    unreachable_controller_conf,
    wait_done,
)
from tests.tasks import CrashAfterStart

pytestmark = pytest.mark.usefixtures("slurm_cluster")

TRAIN_STEPS = 40
REQUEUE_AT = 8  # requeue once the run logged this step
SECRET = "s3cr3t-do-not-write"
LRS = (1e-4, 2e-4)
EXPECTED_TB_TAGS = {"train/loss", "train/psnr", "train/reconstruction_loss", "train/latent_loss", "lr",
                    "samples_per_second"}  # + gpu_memory on GPUs (the testbed computes on the CPU: no value)


@dataclass
class Jobs:
    job_dir: Path
    train: JobHandle
    doomed: JobHandle
    crash: JobHandle
    sweep_cli: subprocess.CompletedProcess | None = None
    follower: subprocess.Popen | None = None  # `jobs.logs --follow` on the train job, started while it runs
    notes: dict = field(default_factory=dict)



@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> Iterator[Jobs]:
    job_dir = tmp_path_factory.mktemp("handle")
    # A secret in the cluster env: reaches the job through sbatch's environment, never the registry.
    two = make_cluster(job_dir, nodes=1, gpus_per_node=2, time_min=10,
                       env={"WANDB_API_KEY": SECRET, "TAEHV_NOTE": "public"})
    one = make_cluster(job_dir, nodes=1, gpus_per_node=1, time_min=10)
    steady = {"intervals.log_every": 2, "intervals.val_every": 20, "intervals.ckpt_every": 10_000}
    # The CLI sweep is started first: its process imports torch while the other jobs are submitted.
    sweep = subprocess.Popen(
        [sys.executable, "-m", "jobs.submit", "--cluster", "configs/cluster/testbed.yaml", "--train",
         "configs/train/tiny.yaml", "--nodes", "1", "--gpus-per-node", "1", "--time-min", "10",
         "--set", f"job_dir={job_dir}", "--set", "steps=6", "--set", "intervals.log_every=2",
         "--sweep", "optim.lr=" + ",".join(f"{lr:g}" for lr in LRS),
         "--max-parallel", "1", "--name", "lr-sweep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    submitted = Jobs(
        job_dir=job_dir,
        train=submit_training(two, tiny_train(steps=TRAIN_STEPS, **steady), "observed")[0],
        doomed=submit_training(one, quick_train(steps=100_000, **{"intervals.log_every": 1,
                                                                  "intervals.ckpt_every": 10}), "doomed")[0],
        crash=submit(CrashAfterStart(),
                     make_cluster(job_dir, nodes=1, gpus_per_node=1, requeue_on_failure=False), "crash"),
    )
    out, err = sweep.communicate(timeout=300)
    submitted.sweep_cli = subprocess.CompletedProcess(sweep.args, sweep.returncode, out, err)
    try:
        yield submitted
    finally:  # never leave a job of ours running (the long one above would run for its whole time limit)
        ids = [submitted.train.job_id, submitted.doomed.job_id, submitted.crash.job_id]
        ids += re.findall(r"submitted job (\S+)", out)
        subprocess.run(["scancel", *ids], capture_output=True)
        if submitted.follower is not None and submitted.follower.poll() is None:
            submitted.follower.kill()


def allocation_rows(handle: JobHandle) -> list[dict]:
    """sacct's allocation records of the job (one per run attempt); [] until the last attempt ended."""
    acct = handle.accounting()
    alloc = acct[acct["JobID"] == handle.job_id].to_dict("records")
    return alloc if alloc and alloc[-1]["State"].split()[0] not in ("PENDING", "RUNNING", "REQUEUED") else []


def sweep_ids(jobs: Jobs) -> list[str]:
    assert jobs.sweep_cli is not None and jobs.sweep_cli.returncode == 0, jobs.sweep_cli.stderr[-2000:]
    return re.findall(r"submitted job (\S+)", jobs.sweep_cli.stdout)


# --------------------------------------------------------------------------------------- RUNNING


def test_running_job_through_handle_and_clis(jobs: Jobs) -> None:
    train = jobs.train
    wait_for(lambda: (train.last_step() or 0) >= 4, 300, "the train job to log step 4")
    assert train.state == "RUNNING"
    assert not train.done()
    frame = train.metrics()
    assert not frame.empty and set(frame["event"]) <= {"train", "val"}
    assert {"step", "time", "loss", "psnr", "samples_per_second", "lr", "gpu_memory_gb"} <= set(frame.columns)

    status = cli("jobs.status", train.job_id, "--job-dir", str(jobs.job_dir))
    assert status.returncode == 0, status.stderr
    header, row = status.stdout.splitlines()[:2]
    assert header.split()[:3] == ["job_id", "run", "state"]
    assert row.split()[:3] == [train.job_id, "observed", "RUNNING"]
    assert re.search(rf"\b\d+/{TRAIN_STEPS}\b", row)

    logs = cli("jobs.logs", train.job_id, "-n", "200", "--job-dir", str(jobs.job_dir))
    assert logs.returncode == 0 and f"train step 4/{TRAIN_STEPS}" in logs.stdout
    # each rank's own file: submitit's first line there names the rank; only rank 0 logs the steps
    by_rank = [cli("jobs.logs", train.job_id, "--rank", str(rank), "-n", "200", "--job-dir",
                   str(jobs.job_dir)) for rank in (0, 1)]
    assert [done.returncode for done in by_rank] == [0, 0], [done.stderr for done in by_rank]
    assert [re.findall(r"global_rank=(\d)\(2\)", done.stdout) for done in by_rank] == [["0"], ["1"]]
    assert f"[rank 0] train step 4/{TRAIN_STEPS}" in by_rank[0].stdout
    assert "train step" not in by_rank[1].stdout

    # Follow rank 0's log from now until the job ends: across the requeue below.
    jobs.follower = subprocess.Popen([sys.executable, "-m", "jobs.logs", train.job_id, "--follow",
                                      "--job-dir", str(jobs.job_dir)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    # Preempt it as the scheduler would; the run saves, Slurm requeues it, and it resumes.
    train.wait(until_step=REQUEUE_AT, timeout_s=300, poll_s=0.5, progress=False)
    train.requeue()
    jobs.notes["requeued_at"] = time.time()
    wait_for(lambda: len(train.requeues) == 1, 120, "the requeue event")


def test_status_logs_and_wait_go_on_from_accounting_while_the_controller_is_out_of_reach(
        jobs: Jobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The user's commands pointed at a controller that does not answer (as while slurmctld is down or
    restarting; accounting still answers): status shows the running job from accounting, with ETTR from
    accounting's elapsed time and the steps its files hold, and every command says once why."""
    doomed = jobs.doomed
    wait_for(lambda: (RunFolder(doomed.run_dir).checkpoints / "latest").exists(), 300,
             "the long job's first save")
    away = {"SLURM_CONF": str(unreachable_controller_conf(tmp_path))}
    follower = subprocess.Popen([sys.executable, "-m", "jobs.logs", doomed.job_id, "--follow",
                                 "--job-dir", str(jobs.job_dir)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO), **away})
    try:
        status = cli("jobs.status", doomed.job_id, "--format", "json", "--job-dir", str(jobs.job_dir),
                     env=away)
        (row,) = json.loads(status.stdout)
        # sacct answered first, the files were read after squeue gave up (about 18 s): trained on meanwhile
        assert row["state"] == "RUNNING" and 0 < row["ettr"] <= 1, row
        (note,) = [line for line in status.stderr.splitlines() if line.startswith("note: ")]
        assert "note: squeue failed (" in note, note
        assert "Unable to contact slurm controller" in note and "`scontrol ping`" in note
        # Following the log: the same note (its first squeue gave up while the status above waited).
        assert select.select([follower.stderr], [], [], 60)[0], "no note from jobs.logs --follow in 60 s"
        first = follower.stderr.readline()
        assert first.startswith("note: squeue failed ("), first
    finally:
        follower.kill()
        follower.wait()
    # JobHandle.wait: on accounting meanwhile, one note; then, the controller answering again, another.
    monkeypatch.setenv("SLURM_CONF", away["SLURM_CONF"])
    step = doomed.last_step() or 0
    assert doomed.wait(until_step=step + 5, timeout_s=120, poll_s=0.5, progress=False) == "RUNNING"
    assert capsys.readouterr().err.count("note: squeue failed (") == 1
    watch = jobstates.SilenceWatch()
    assert len(watch.changes()) == 1 and watch.changes() == []  # said once while it lasts
    monkeypatch.undo()
    assert jobstates.job_states([doomed.job_id], max_age_s=0)[doomed.job_id] == "RUNNING"
    assert watch.changes() == ["squeue answers again"] and watch.changes() == []
    assert jobstates.controller_silence() is None


# ---------------------------------------------------------------------------- CANCELLED, FAILED


def test_cancel_cli_cancels_a_running_job(jobs: Jobs) -> None:
    doomed = jobs.doomed
    wait_for(lambda: (doomed.last_step() or 0) >= 1, 300, "the long job to train")
    out = cli("jobs.cancel", doomed.job_id, "--job-dir", str(jobs.job_dir))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"cancelled job {doomed.job_id} (was RUNNING)")
    assert "--name doomed" in out.stdout
    assert wait_done(doomed.job_id, 120) == "CANCELLED"
    attached = JobHandle.attach(doomed.job_id, jobs.job_dir)
    assert attached.state.startswith("CANCELLED") and attached.done()
    # It saved on the SIGTERM of the cancel: that is no requeue.
    wait_for(lambda: (RunFolder(doomed.run_dir).checkpoints / "latest").exists(), 60, "the save on cancel")
    assert attached.requeues.empty and attached.requeue_count == 0
    assert "requeue" not in set(attached.metrics()["event"])
    alloc = wait_for(lambda: allocation_rows(attached), 60, "sacct to record the end")
    assert [r["State"].split()[0] for r in alloc] == ["CANCELLED"]
    again = cli("jobs.cancel", doomed.job_id, "--job-dir", str(jobs.job_dir))
    assert again.returncode == 0 and "already ended (CANCELLED" in again.stdout


def test_failed_job_reports_its_error(jobs: Jobs) -> None:
    crash = jobs.crash
    assert wait_done(crash.job_id, 300) == "FAILED", crash.tail(60)
    assert crash.state == "FAILED" and crash.done()
    assert crash.error == "RuntimeError: simulated crash right after the restart"
    assert crash.stop_reason is None  # requeue_on_failure off: it failed, nothing stopped it
    assert crash.requeues.empty and crash.requeue_count == 0
    alloc = wait_for(lambda: allocation_rows(crash), 60, "sacct to record the end")
    assert [r["State"] for r in alloc] == ["FAILED"] and alloc[0]["ExitCode"] != "0:0"
    status = cli("jobs.status", crash.job_id, "--job-dir", str(jobs.job_dir))
    assert status.returncode == 0 and "FAILED" in status.stdout
    assert "RuntimeError: simulated crash right after the restart" in status.stdout
    logs = cli("jobs.logs", crash.job_id, "--job-dir", str(jobs.job_dir))
    assert "RuntimeError: simulated crash right after the restart" in logs.stdout


def test_status_says_when_slurms_accounting_does_not_answer(jobs: Jobs, tmp_path: Path) -> None:
    """sacct pointed where no slurmdbd listens (as if it were down): status says so; --accounting fails."""
    crash, away = jobs.crash, {"SLURM_CONF": str(unreachable_accounting_conf(tmp_path))}
    said = documented("sacct-unreachable")
    assert wait_done(crash.job_id, 300) == "FAILED", crash.tail(60)
    status = cli("jobs.status", crash.job_id, "--job-dir", str(jobs.job_dir), env=away)
    assert status.returncode == 0 and status.stdout.splitlines()[1].split()[:2] == [crash.job_id, "crash"]
    assert status.stderr.splitlines() == [f"note: {said}"]
    acct = cli("jobs.status", crash.job_id, "--accounting", "--format", "json", "--job-dir",
               str(jobs.job_dir), env=away)
    assert (acct.returncode, acct.stdout, acct.stderr) == (1, "", f"error: {said}\n")


# ------------------------------------------------------------------------- REQUEUED → COMPLETED


def completed_train(jobs: Jobs) -> JobHandle:
    """The train job once it completed (the first test below waits for it; run alone, a test waits here)."""
    assert wait_done(jobs.train.job_id, 600) == "COMPLETED", jobs.train.tail(80)
    return jobs.train


def test_a_requeued_job_completes_and_wait_prints_plain_progress_lines(
        jobs: Jobs, capsys: pytest.CaptureFixture[str]) -> None:
    train = jobs.train
    final = train.wait(timeout_s=600, poll_s=1)
    assert final == "COMPLETED", train.tail(80)
    shown = capsys.readouterr().out  # wait()'s progress: plain lines under pytest (no TTY)
    assert "\r" not in shown and f"job {train.job_id}: COMPLETED · step {TRAIN_STEPS}/{TRAIN_STEPS}" in shown
    assert "requeued 1×" in shown


def test_the_terminal_bar_fits_the_width_and_keeps_loss_and_psnr(jobs: Jobs) -> None:
    train = completed_train(jobs)
    tail = MetricsTail(train.run_dir).poll()
    lines = {width: progress_line(train, "COMPLETED", tail, train.requeue_count, width)
             for width in (200, 100, 79, 60)}
    assert all(len(line) <= width for width, line in lines.items()), lines
    assert all(f"{TRAIN_STEPS}/{TRAIN_STEPS}" in line and "loss " in line and "psnr " in line
               for width, line in lines.items() if width >= 60), lines
    assert "[####################]" in lines[200] and "clips/s" in lines[200] and "requeued 1×" in lines[200]


def test_the_metrics_mark_the_requeue_and_log_every_step_once(jobs: Jobs) -> None:
    train = completed_train(jobs)
    requeues = train.requeues
    assert list(requeues["reason"]) == ["preempted"]
    step = int(requeues["step"].iloc[0])
    assert REQUEUE_AT <= step < TRAIN_STEPS

    frame = train.metrics()
    steps = list(frame[frame["event"] == "train"]["step"])
    # every logged step once, across the requeue
    assert steps == sorted(set(steps)) and steps[-1] == TRAIN_STEPS
    marks = frame[frame["event"] == "requeue"]
    assert list(marks["step"]) == [step] and list(marks["reason"]) == ["preempted"]
    assert frame["time"].notna().all() and (frame["elapsed_s"] >= 0).all()


def test_sacct_records_the_requeued_attempt_then_the_completed_one(jobs: Jobs) -> None:
    train = completed_train(jobs)
    # Real sacct: one REQUEUED allocation record, then the COMPLETED one.
    alloc = wait_for(lambda: allocation_rows(train), 60, "sacct to record the end")
    assert [(r["State"], r["Attempt"]) for r in alloc] == [("REQUEUED", 0), ("COMPLETED", 1)]
    assert all(r["ElapsedSeconds"] > 0 for r in alloc)
    assert train.accounting().attrs["requeues"] == 1 and train.requeue_count == 1


def test_a_handle_attached_by_id_from_another_directory_reads_the_whole_run(jobs: Jobs) -> None:
    train = completed_train(jobs)
    # Re-opened from another working directory by id, through $TAEHV_JOB_DIR-style relative paths.
    here = os.getcwd()
    try:
        os.chdir(jobs.job_dir.parent)
        attached = JobHandle.attach(train.job_id, jobs.job_dir.name)
        assert attached.run_dir == Path(jobs.job_dir.name) / "observed"
        assert attached.last_step() == TRAIN_STEPS and len(attached.requeues) == 1
        assert "train step 40/40" in attached.tail(30)
    finally:
        os.chdir(here)


def test_status_cli_shows_the_requeue_as_a_table_json_and_csv(jobs: Jobs) -> None:
    train = completed_train(jobs)
    step = int(train.requeues["step"].iloc[0])  # where it saved for its requeue
    status = cli("jobs.status", "--all", cwd=jobs.job_dir.parent, env={"TAEHV_JOB_DIR": jobs.job_dir.name})
    assert status.returncode == 0, status.stderr
    row = next(line for line in status.stdout.splitlines() if line.startswith(train.job_id + " "))
    assert row.split()[1:6] == ["observed", "COMPLETED", "1", "2", f"{TRAIN_STEPS}/{TRAIN_STEPS}"]
    assert row.split()[6] == "1" and f"requeued at step {step}" in row
    as_json = json.loads(cli("jobs.status", train.job_id, "--format", "json", "--job-dir",
                             str(jobs.job_dir)).stdout)
    # numbers stay numbers for programs: the step and the total in their own fields
    assert [(r["job_id"], r["state"], r["step"], r["steps"], r["requeues"]) for r in as_json] == \
        [(train.job_id, "COMPLETED", TRAIN_STEPS, TRAIN_STEPS, 1)]
    as_csv = list(csv.DictReader(io.StringIO(cli("jobs.status", train.job_id, "--format", "csv", "--job-dir",
                                                 str(jobs.job_dir)).stdout)))
    assert [(r["run"], r["state"], r["step"], r["steps"], r["requeues"]) for r in as_csv] == \
        [("observed", "COMPLETED", str(TRAIN_STEPS), str(TRAIN_STEPS), "1")]


def test_status_cli_accounting_shows_one_row_per_attempt(jobs: Jobs) -> None:
    train = completed_train(jobs)
    wait_for(lambda: allocation_rows(train), 60, "sacct to record the end")
    # Slurm's accounting from the CLI: one row per attempt (the requeued one, then the one that completed).
    acct = json.loads(cli("jobs.status", train.job_id, "--accounting", "--format", "json", "--job-dir",
                          str(jobs.job_dir)).stdout)
    assert [(r["attempt"], r["state"]) for r in acct] == [(0, "REQUEUED"), (1, "COMPLETED")]
    assert all(r["gpus"] == 2 and r["nodes"] == 1 and r["elapsed_s"] > 0 and r["max_rss_gb"] > 0.05
               for r in acct), acct
    table = cli("jobs.status", train.job_id, "--accounting", "--job-dir",
                str(jobs.job_dir)).stdout.splitlines()
    assert table[0].split()[:4] == ["job_id", "run", "attempt", "state"] and len(table) == 3
    rows = list(csv.DictReader(io.StringIO(cli("jobs.status", train.job_id, "--accounting", "--format", "csv",
                                               "--job-dir", str(jobs.job_dir)).stdout)))
    assert [r["state"] for r in rows] == ["REQUEUED", "COMPLETED"] and rows[1]["exit_code"] == "0:0"


def test_logs_follow_followed_the_job_across_the_requeue_to_its_end(jobs: Jobs) -> None:
    train = completed_train(jobs)
    step = int(train.requeues["step"].iloc[0])  # where it saved for its requeue
    # `jobs.logs --follow`, started while the job ran, followed it across the requeue to its end.
    assert jobs.follower is not None
    out, err = jobs.follower.communicate(timeout=60)
    assert jobs.follower.returncode == 0, err
    assert out.rstrip().endswith(f"job {train.job_id} ended: COMPLETED")
    assert f"resumed from step {step}" in out and f"train step {TRAIN_STEPS}/{TRAIN_STEPS}" in out


def test_the_plot_marks_the_requeue_with_a_dashed_line(jobs: Jobs) -> None:
    import matplotlib

    train = completed_train(jobs)
    step = int(train.requeues["step"].iloc[0])  # where it saved for its requeue
    matplotlib.use("Agg")
    fig = train.plot(jobs.job_dir / "observed.png")
    dashed = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == "--"]
    assert [line.get_xdata()[0] for line in dashed] == [step]
    assert (jobs.job_dir / "observed.png").stat().st_size > 10_000


def test_tensorboard_events_and_a_log_without_progress_bars_of_rank_0(jobs: Jobs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = jobs.train
    assert wait_done(train.job_id, 600) == "COMPLETED"
    acc = EventAccumulator(str(train.run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert EXPECTED_TB_TAGS.issubset(tags), tags
    assert "gpu_memory" not in tags  # CPU ranks: the trainer writes no GPU memory value
    assert {"val/psnr", "val/loss"} <= tags
    frame = train.metrics()
    logged = list(frame[frame["event"] == "train"]["step"])
    for tag in ("train/loss", "lr", "samples_per_second"):
        # Both segments' files together: each step once (the resumed writer purged nothing it kept).
        assert [e.step for e in acc.Scalars(tag)] == logged, tag
    losses = dict(zip(frame[frame["event"] == "train"]["step"], frame[frame["event"] == "train"]["loss"]))
    assert all(e.value == pytest.approx(losses[e.step], rel=1e-6) for e in acc.Scalars("train/loss"))
    assert len(list((train.run_dir / "tb").glob("events.out.tfevents.*"))) == 2  # one per segment
    assert not list(train.run_dir.glob("*/tb")) and not list(train.run_dir.glob("tb/*/"))  # rank 0 only
    log = train.log_path(0).read_text()  # progress in plain lines: a batch job has no TTY
    assert "\r" not in log and "it/s" not in log and "step/s" not in log and "%|" not in log
    lines = re.findall(rf"\[rank 0\] train step (\d+)/{TRAIN_STEPS} ", log)
    assert [int(s) for s in lines][-1] == TRAIN_STEPS and len(lines) >= TRAIN_STEPS // 2
    assert "train step" not in train.log_path(1).read_text()  # rank 1 shows no progress

    # The same writer under a terminal draws a tqdm bar instead.
    code = ("import sys, pathlib, tempfile; from taehv_slurm.trainer.metrics import MetricsWriter;"
            "w = MetricsWriter(pathlib.Path(tempfile.mkdtemp()), 0, True, 4);"
            "[w.write(s, {'loss': 1.0 / s}) for s in range(1, 5)]; w.close(); print('DONE')")
    # a 0-column terminal hides the bar
    _, shown = in_terminal([sys.executable, "-c", code], REPO, columns=100)
    assert "DONE" in shown and "\rtrain: 100%|" in shown and "4/4" in shown, shown[-2000:]
    assert "train step" not in shown


# ------------------------------------------------------------------------------------------ sweep


def test_sweep_cli_submits_one_job_array(jobs: Jobs) -> None:
    ids = sweep_ids(jobs)
    assert len(ids) == 2 and ids[0].split("_")[0] == ids[1].split("_")[0]  # one array: A_0, A_1
    assert "sweep of 2 runs (one job array)" in jobs.sweep_cli.stdout
    script = next(JobDir(jobs.job_dir).run("lr-sweep").submitit.glob("*_submission.sh")).read_text()
    assert "#SBATCH --array=0-1%1" in script  # --max-parallel 1: Slurm runs them one after the other
    for job_id in ids:
        assert wait_done(job_id, 600) == "COMPLETED", JobHandle.attach(job_id, jobs.job_dir).tail(60)
    handles = [JobHandle.attach(i, jobs.job_dir) for i in ids]
    spans = sorted((r["Start"], r["End"]) for h in handles
                   for r in wait_for(lambda h=h: allocation_rows(h), 60, "sacct"))
    assert len(spans) == 2 and spans[0][1] <= spans[1][0], spans  # never both at once
    frame = runs_frame(ids, job_dir=jobs.job_dir)
    assert {"job_id", "run", "optim.lr", "loss", "step"} <= set(frame.columns)
    assert sorted(frame["optim.lr"].unique()) == list(LRS)
    train = frame[frame["event"] == "train"]
    assert sorted(train.groupby("optim.lr")["step"].max()) == [6, 6]
    peak = train.groupby("optim.lr")["lr"].max()  # the schedule of each run follows its swept lr
    assert peak[LRS[1]] == pytest.approx(2 * peak[LRS[0]])
    final = runs_frame(ids, job_dir=jobs.job_dir, final=True)
    assert len(final) == 2 and list(final["optim.lr"]) == list(LRS) and list(final["step"]) == [6, 6]
    assert set(final["run"]) == {"lr-sweep/lr=0.0001", "lr-sweep/lr=0.0002"}

    status = cli("jobs.status", *ids, "--job-dir", str(jobs.job_dir))
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert "optim.lr" in lines[0] and len(lines) == 3
    assert all("COMPLETED" in line and "6/6" in line for line in lines[1:])
    assert "0.0001" in lines[1] and "0.0002" in lines[2]
    registry = registry_frame(jobs.job_dir)
    assert set(registry[registry["job_id"].isin(ids)]["optim.lr"]) == set(LRS)


# --------------------------------------------------------------------------------------- registry


def test_registry_lists_every_run_with_masked_secrets(jobs: Jobs) -> None:
    sweep_ids(jobs)
    registry = JobDir(jobs.job_dir).registry
    assert SECRET not in registry.read_text()
    records = read_strictly(EventLog(registry))
    runs = {r["run"]: r for r in records}
    assert set(runs) == {"observed", "doomed", "crash", "lr-sweep/lr=0.0001", "lr-sweep/lr=0.0002"}
    observed = runs["observed"]
    assert observed["cluster"]["env"] == {"WANDB_API_KEY": "***", "TAEHV_NOTE": "public"}
    assert observed["train"]["steps"] == TRAIN_STEPS and observed["plan"]["world_size"] == 2
    assert all(not Path(r["run"]).is_absolute() for r in records)  # relative to job_dir: relocatable
    assert SECRET not in RunFolder(jobs.train.run_dir).submitit.joinpath(
        f"{jobs.train.job_id}_submission.sh").read_text()
    table = JobHandle.registry(jobs.job_dir)
    assert set(table["run"]) == set(runs) and table["job_id"].is_unique


# ----------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("command", [["jobs.status", "999999"], ["jobs.logs", "999999"],
                                     ["jobs.cancel", "999999"], ["jobs.logs", "999999", "--follow"]])
def test_unknown_job_id_is_one_line_exit_2(jobs: Jobs, command: list[str]) -> None:
    out = cli(*command, "--job-dir", str(jobs.job_dir), timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: no job or run 999999 in ")
    assert "latest: " in out.stderr


def test_bad_rank_and_empty_job_dir_are_one_line_errors(jobs: Jobs, tmp_path: Path) -> None:
    out = cli("jobs.logs", jobs.crash.job_id, "--rank", "3", "--job-dir", str(jobs.job_dir), timeout=60)
    assert out.returncode == 2 and out.stderr == (f"error: job {jobs.crash.job_id} has ranks 0..0; "
                                                  f"--rank 3 does not exist\n")
    out = cli("jobs.status", "42", "--job-dir", str(tmp_path), timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "lists no runs" in out.stderr
    out = cli("jobs.status", "--job-dir", str(tmp_path), timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("no runs in ")
