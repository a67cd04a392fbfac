"""Zero-loss checkpoint-requeue on the real Slurm testbed (CPU, gloo, tiny config).

Every interrupted run is compared with an uninterrupted run of the same config submitted at the
same time: the final weights and optimizer state must be bit-identical, and no step may run twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from submitit.helpers import DelayedSubmission

from bench.faults import children, rank_record, slowed_down, wait_for
from taehv_slurm.backends import LocalBackend
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.common.security import make_private_dir, private_umask
from taehv_slurm.handle import JobHandle
from taehv_slurm.runtime.context import StopFlag, grace_seconds
from taehv_slurm.runtime.controller import LOCAL_REQUEUE_EXIT_CODE
from taehv_slurm.runtime.provenance import read_attempts
from taehv_slurm.runtime.requeue import RequeueableTask
from taehv_slurm.submission import submit
from taehv_slurm.training import submit_training
from tests.helpers import (
    LOCAL_TASK_ENV,
    STEP_BY_STEP,
    assert_identical,
    events,
    final_state,
    last_step,
    make_cluster,
    metrics,
    quick_train,
    tiny_train,
    wait_done,
)
from tests.tasks import CountingTask, CrashAfterStart, SlowToLoad, StopAtFirstBoundary
from tests.wandb_offline import offline_runs

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def sacct_states(handle: JobHandle) -> list[str]:
    """sacct's record of each run of the job, oldest first (waits until accounting has its end)."""
    frame = handle.accounting()
    return [state.split()[0] for state in frame[frame["JobID"] == handle.job_id]["State"]]


def trained_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in metrics(run_dir) if "loss" in row]


def test_preempted_three_times_finishes_bit_identical(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path, nodes=2, gpus_per_node=1, time_min=30)  # a rank on each of 2 nodes
    # Without the teacher, at 32×32 (quick_train): what is resumed here is the student, its optimizer and the
    # data order; the time-limit test below resumes the whole distillation, teacher included.
    train = quick_train(steps=45, **STEP_BY_STEP)
    reference = submit_training(cluster, train, "reference")[0]
    # the preempted run also logs to W&B (offline) and MLflow (a file store): one tracker run throughout
    trackers = {"tracking.wandb": True, "tracking.wandb_mode": "offline", "tracking.mlflow": True}
    tracked = quick_train(steps=45, **STEP_BY_STEP, **trackers)
    preempted = submit_training(cluster, tracked, "preempted")[0]
    rng = random.Random(7)
    for n, at in enumerate(sorted(rng.sample(range(4, 40), 3)), start=1):
        wait_for(lambda at=at: last_step(preempted.run_dir) >= at, 600, f"step {at}")
        subprocess.run(["scontrol", "requeue", preempted.job_id], check=True)
        # its first step trained, so that each attempt has a time to first step (goodput, below)
        wait_for(lambda n=n: len(events(preempted, "first_step")) > n, 600, f"restart {n}")
    assert wait_done(preempted.job_id, 900) == "COMPLETED", preempted.tail(60)
    assert wait_done(reference.job_id, 900) == "COMPLETED", reference.tail(60)

    requeues = events(preempted, "requeue")
    assert [e["reason"] for e in requeues] == ["preempted"] * 3
    assert all(e["signal_to_saved_s"] < 10 and e["seconds_lost"] == 0 for e in requeues)
    assert trained_steps(preempted.run_dir) == list(range(1, 46))  # every step exactly once
    assert [e["step"] for e in events(preempted, "start")] == [0] + [e["step"] for e in requeues]
    _, ref_state, _ = final_state(reference.run_dir)
    step, state, _ = final_state(preempted.run_dir)
    assert step == 45
    for key in ("params", "exp_avg", "exp_avg_sq", "optimizer_step"):
        assert_identical({key: ref_state[key]}, {key: state[key]})
    assert_one_tracker_run(preempted.run_dir, attempts=4, side=train.data.height)
    # every attempt recorded what its ranks talked over between the 2 nodes (gloo: TCP), and logged it
    networks = [a["network"] for a in read_attempts(preempted.run_dir)]
    assert len(networks) == 4 and all((n["backend"], n["transport"], n["nodes"]) == ("gloo", "Socket", 2)
                                      for n in networks)
    assert preempted.tail(10_000).count("network between the ranks: gloo over Socket") == 4
    frame = preempted.accounting()  # real sacct: one REQUEUED record per interrupted run, then COMPLETED
    allocations = frame[frame["JobID"] == preempted.job_id]
    assert list(allocations["State"]) == ["REQUEUED"] * 3 + ["COMPLETED"]

    # Goodput, one row per attempt: the allocation is sacct's, and every step trained is kept exactly once.
    goodput = preempted.goodput()
    assert list(goodput["attempt"]) == [0, 1, 2, 3]
    sacct_node_s = float((allocations["ElapsedSeconds"] * allocations["NNodes"].astype(int)).sum())
    assert goodput.attrs["allocated_node_s"] == pytest.approx(sacct_node_s, rel=0.01)
    assert int(goodput["steps_kept"].sum()) == 45 and list(goodput["lost_steps"]) == [0, 0, 0, 0]
    assert goodput["time_to_first_step_s"].notna().all() and (goodput["save_s"] > 0).all()
    start_up = goodput["start_up_s"]
    assert (start_up > 0).all() and (start_up < goodput["time_to_first_step_s"]).all()
    assert 0 < goodput.attrs["ettr"] < 1


def test_a_preemption_that_also_signals_the_loader_workers_is_saved_not_a_failure(tmp_path: Path) -> None:
    """Slurm's proctrack/cgroup signals every process of a job step, a rank's data-loader workers with it
    (the testbed's proctrack/linuxproc reaches only the ranks). On 4 H200s a `scontrol requeue` so ended
    each rank in "DataLoader worker exited unexpectedly", a failure, before it could save. Here each rank's
    workers get SIGTERM with the requeue: the ranks save, the run resumes, every step is trained once."""
    cluster = make_cluster(tmp_path, nodes=2, gpus_per_node=1, time_min=30)
    train = quick_train(steps=24, **STEP_BY_STEP, **{"data.num_workers": 2})
    handle = submit_training(cluster, train, "workers")[0]
    wait_for(lambda: last_step(handle.run_dir) >= 4, 600, "step 4")
    workers = [pid for rank in (0, 1) for pid in children(rank_record(handle, rank)["pid"])]
    assert len(workers) >= 4, workers  # 2 loader workers a rank
    requeue = subprocess.Popen(["scontrol", "requeue", handle.job_id])
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    assert requeue.wait(60) == 0
    assert wait_done(handle.job_id, 600) == "COMPLETED", handle.tail(60)
    assert events(handle, "failure") == []
    assert [e["reason"] for e in events(handle, "requeue")] == ["preempted"]
    assert trained_steps(handle.run_dir) == list(range(1, 25))


def assert_one_tracker_run(run_dir: Path, attempts: int, side: int) -> None:
    """One MLflow run for the training run, with every step of metrics.jsonl once; one W&B run id for every
    attempt, and the last attempt's W&B history has every step once too (a preempted attempt's W&B lines
    die with W&B's service process at Slurm's SIGTERM; each attempt replays what metrics.jsonl kept:
    taehv_slurm/trainer/trackers.py)."""
    from mlflow import MlflowClient  # the trackers extra: installed by scripts/setup.sh
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = [row["step"] for row in metrics(run_dir) if "loss" in row]
    ids = json.loads(RunFolder(run_dir).trackers.read_text())
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [f.name.rsplit("-", 1)[1] for f in folders] == [ids["wandb"]] * attempts
    (last,) = offline_runs(run_dir)[-1:]
    assert last.run_id == ids["wandb"] and last.steps == logged, last.steps
    assert "val/sample" in last.keys  # the sample frames of the last validation
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the trainer reads its default store
        client = MlflowClient(ids["mlflow_tracking_uri"])
        (experiment,) = [e for e in client.search_experiments() if e.name == "taehv"]
        (run,) = client.search_runs([experiment.experiment_id])
        history = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
        images = [a.path for a in client.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png")]
        (image,) = images
        sample = Image.open(client.download_artifacts(run.info.run_id, image, str(run_dir)))
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    assert history == logged
    # val/sample at the one validation (the last step): 4 frames of a clip above their reconstruction
    assert image.startswith(f"images/val~sample+step+{logged[-1]}+") and sample.size == (4 * side, 2 * side)
    tensorboard_events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0}).Reload()
    (tensorboard,) = tensorboard_events.Images("val/sample")
    assert (tensorboard.step, tensorboard.width, tensorboard.height) == (logged[-1], 4 * side, 2 * side)
    assert run.data.params["steps"] == str(logged[-1]) and "optim.lr" in run.data.params  # the config


def test_time_limit_requeues_itself_and_finishes_bit_identical(tmp_path: Path) -> None:
    # The shortest limit the config allows: USR2 45 s before a 2-minute limit comes 15-75 s into each run
    # (Slurm may send it up to 60 s early), so the run needs several.
    # One rank (the preemption test above resumes two), to spare the suite's CPU: 30 steps of 4 micro-batches
    # take ~18 s on an idle core (0.6 s a step), and the first attempt runs on a slow node (stopped 80 % of
    # the time, from outside: ~3 s a step) until its first requeue, so it trains past the latest first
    # warning (75 s) without the CPU of 75 s of steps; the next attempt or two finish (60 steps took 7 min).
    short = make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=2, signal_delay_s=45)
    relaxed = make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=30)
    steps = 30
    train = tiny_train(steps=steps, **STEP_BY_STEP)
    reference = submit_training(relaxed, train, "reference")[0]
    timed = submit_training(short, train, "timed")[0]
    # Beside it, a site whose time-limit warning never arrives (the task drops USR2): at the limit only
    # SIGTERM comes. It must count as a timeout (Slurm does not requeue a job killed for its limit), so the
    # task saves and requeues itself, and only what Slurm accepted is recorded.
    no_warning = submit(CountingTask(10_000, 0.2, ignore_warning=True, steps_after_restart=5),
                        make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=2), "no-warning")
    first = wait_for(lambda: rank_record(timed, 0).get("pid"), 300, "the timed run's rank to start")
    with slowed_down(first, stopped_s=0.4, running_s=0.1):
        wait_for(lambda: events(timed, "requeue"), 300, "the time limit's first requeue")
    assert wait_done(timed.job_id, 1200) == "COMPLETED", timed.tail(60)
    assert wait_done(reference.job_id, 600) == "COMPLETED", reference.tail(60)
    requeues = events(timed, "requeue")
    assert requeues and all((e["reason"], e["by"]) == ("timeout", "self") for e in requeues)
    # each recorded requeue happened
    assert sacct_states(timed) == ["REQUEUED"] * len(requeues) + ["COMPLETED"]
    assert trained_steps(timed.run_dir) == list(range(1, steps + 1))
    assert wait_done(no_warning.job_id, 600) == "COMPLETED", no_warning.tail(60)
    sigterm = events(no_warning, "requeue")
    assert sigterm and all((e["reason"], e["by"]) == ("timeout", "self") for e in sigterm)  # not "preempted"
    assert sacct_states(no_warning) == ["REQUEUED"] * len(sigterm) + ["COMPLETED"]
    steps = [int(s) for s in (Path(no_warning.run_dir) / "steps.txt").read_text().split()]
    assert steps == list(range(1, sigterm[0]["step"] + 6))  # every step once, none lost, 5 after the restart
    _, ref_state, _ = final_state(reference.run_dir)
    _, state, _ = final_state(timed.run_dir)
    for key in ("params", "exp_avg", "exp_avg_sq", "optimizer_step"):
        assert_identical({key: ref_state[key]}, {key: state[key]})


def test_crash_loop_stops_with_a_reason(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path, nodes=1, gpus_per_node=1, max_requeues_without_progress=2)
    handle = submit(CrashAfterStart(varying=True), cluster, "crashing")
    assert wait_done(handle.job_id, 600) == "FAILED", handle.tail(60)
    assert len(events(handle, "start")) == 3  # the first run and two requeues without progress
    assert (handle.stop_reason
            and handle.stop_reason.startswith("no progress: 3 starts in a row began at step 0"))
    assert "simulated crash right after the restart" in handle.stop_reason
    assert "not requeueing: no progress" in handle.tail(200)
    attached = JobHandle.attach(handle.job_id, tmp_path)
    assert attached.stop_reason == handle.stop_reason and attached.state == "FAILED"


# A run that ends within signal_delay_s of its time limit gets USR2 after it has finished; a preemption
# can come as late. Python restores the default action (terminate) as it shuts down, so such a
# signal turned a completed job into FAILED. Here the signals keep coming until the process is gone.
SIGNALLED_AFTER_FINISHING = """
import os, subprocess, sys, time
from pathlib import Path
from taehv_slurm.runtime.provenance import read_attempts
from taehv_slurm.runtime.requeue import RequeueableTask

def train(ctx):
    ctx.started(0)
    ctx.finished(0)
    return "trained"

run_dir = Path(sys.argv[1])
print(RequeueableTask(train, run_dir)(), flush=True)
marker = run_dir / "signalled"
subprocess.Popen(["sh", "-c", f"while kill -USR2 {os.getpid()} && kill -TERM {os.getpid()}; "
                  f"do touch {marker}; sleep 0.001; done"],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while not marker.exists():
    time.sleep(0.001)
"""


def test_signals_after_the_run_finished_do_not_fail_the_job(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SIGNALLED_AFTER_FINISHING, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["trained"]  # no "caught SIGUSR2 ... saving" for a finished run
    kinds = [e["event"] for e in RunFolder(tmp_path / "run").events().read()]
    assert kinds == ["start", "finished"]


def catches(pid: int, signum: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_signals_while_the_task_starts_are_kept_for_the_first_step_boundary(tmp_path: Path) -> None:
    # Before any handler of submitit's or ours exists (imports, the pickle's load), a time-limit warning
    # (USR2) or preemption (TERM) used to end the task, and Slurm recorded the job FAILED. Here they
    # arrive while the entry point still waits for its pickle, and the task must act on them once it runs.
    run_dir = make_private_dir(tmp_path / "run")
    folder = make_private_dir(RunFolder(run_dir).submitit)
    entry = subprocess.Popen([sys.executable, "-m", "taehv_slurm.runtime.entry", str(folder)], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, **LOCAL_TASK_ENV})
    # until the entry point's handlers are in (without them: signal it anyway)
    deadline = time.monotonic() + 10
    while not catches(entry.pid, signal.SIGUSR2) and entry.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(entry.pid, signal.SIGTERM)
    os.kill(entry.pid, signal.SIGUSR2)
    time.sleep(1.0)
    with private_umask():  # as submit() writes it
        DelayedSubmission(RequeueableTask(StopAtFirstBoundary(), run_dir, backend=LocalBackend())).dump(
            folder / "4242_submitted.pkl")
    output, _ = entry.communicate(timeout=120)

    assert entry.returncode == LOCAL_REQUEUE_EXIT_CODE, output  # saved and asked to be requeued, not killed
    assert ("caught SIGUSR2" in output
            and "saved step 0; requeued (timeout, by local controller)" in output), output
    start, requeue = RunFolder(run_dir).events().read()
    assert ((start["event"], requeue["event"], requeue["reason"], requeue["step"])
            == ("start", "requeue", "timeout", 0))
    assert requeue["signal_to_saved_s"] >= 1.0  # timed from the signal's arrival, not from the task's start


def test_on_slurm_a_signal_while_the_task_loads_is_kept_for_its_first_step_boundary(tmp_path: Path) -> None:
    """The same on a Slurm job: the time-limit warning (USR2, as `--signal` sends it to the job's tasks)
    reaches the rank while its pickle still loads; the task saves at its first step boundary and the job
    requeues itself, instead of ending FAILED by the signal's default action."""
    gate = tmp_path / "gate"
    gate.mkdir()
    cluster = make_cluster(tmp_path, nodes=1, gpus_per_node=1, time_min=10)
    handle = submit(SlowToLoad(str(gate), 100, 0.1, steps_after_restart=3), cluster, "slow-start")
    wait_for(lambda: (gate / "loading").exists(), 120, "the job's task to load")
    subprocess.run(["scancel", "--signal=USR2", handle.job_id], check=True)
    time.sleep(1.0)
    (gate / "released").touch()
    assert wait_done(handle.job_id, 300) == "COMPLETED", handle.tail(60)
    (requeue,) = events(handle, "requeue")
    assert (requeue["reason"], requeue["by"], requeue["step"]) == ("timeout", "self", 0)
    assert requeue["signal_to_saved_s"] >= 0.5  # timed from the signal's arrival, during the load
    assert "caught SIGUSR2" in handle.tail(200)
    assert sacct_states(handle) == ["REQUEUED", "COMPLETED"]
    assert (Path(handle.run_dir) / "steps.txt").read_text().split() == ["1", "2", "3"]  # after the restart


def test_a_sigterm_after_the_time_limit_warning_brings_the_save_deadline_closer(capsys) -> None:
    # USR2 comes SignalDelay before the limit; a SIGTERM after it means SIGKILL follows within KillWait,
    # so the rank must give up by the SIGTERM's shorter grace, and the run still counts as a timeout.
    stop = StopFlag(grace_seconds(signal_delay_s=120, kill_wait_s=30))
    now = time.time()
    stop.record(signal.SIGUSR2, now)
    assert stop.reason == "timeout" and stop.deadline() == pytest.approx(now + 110)
    stop.record(signal.SIGTERM, now + 5)
    try:
        assert stop.reason == "timeout" and stop.deadline() == pytest.approx(now + 5 + 25)
        printed = capsys.readouterr().out
        assert "caught SIGUSR2" in printed and "caught SIGTERM" in printed
        stop.record(signal.SIGTERM, now + 6)  # a repeat changes nothing and says nothing
        assert stop.deadline() == pytest.approx(now + 30) and capsys.readouterr().out == ""
    finally:
        stop.disarm()
