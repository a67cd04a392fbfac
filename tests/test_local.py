"""`python -m jobs.submit --local` tells the truth (no Slurm: the local backend's controller, real processes).

- a run whose task raises ends FAILED, the CLI exits 1 and prints the error once in one line naming the
  log that holds the traceback; `jobs.status` shows the error as the run's note;
- `jobs.status` run from another process shows a running local job as RUNNING;
- `jobs.cancel` and Ctrl-C stop a local run the way a preemption does on Slurm: every rank saves at its
  next step, the job ends CANCELLED, and the same --name resumes from the saved step;
- a rank that dies takes the job down at once (srun's --kill-on-bad-exit), naming that rank;
- a closed terminal (SIGHUP to the command's process group) leaves the run training; `jobs.logs --follow`
  follows it again to its end and `jobs.cancel` stops it with a save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm.common.config import load_cluster
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.runtime.supervisor import RankCommand, Supervisor
from taehv_slurm.submission import submit
from tests.helpers import REPO, cli, metrics, read_strictly

TRAIN = ["--train", "configs/train/tiny.yaml"]



def start(job_dir: Path, name: str, *sets: str, flags: tuple[str, ...] = (),
          own_session: bool = False) -> subprocess.Popen:
    argv = [sys.executable, "-m", "jobs.submit", "--local", *TRAIN, "--name", name, *flags,
            "--set", f"job_dir={job_dir}",
            "--set", "intervals.log_every=1", *[a for s in sets for a in ("--set", s)]]
    # As a terminal's foreground job: SIGINT and SIGHUP at their default actions. Under a shell that
    # started the tests in the background (or under nohup) they are ignored, and an ignored signal stays
    # ignored across exec (Ctrl-C, a closed terminal would be lost). `own_session`: as a login shell's,
    # whose terminal signals its whole process group.
    def as_a_terminals_job() -> None:
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)

    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_a_terminals_job, start_new_session=own_session)


def events(run_dir: Path) -> list[dict]:
    return read_strictly(RunFolder(run_dir).events(), missing_ok=True)


def train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in metrics(run_dir) if "loss" in r]


def test_a_failing_run_ends_failed_with_its_error_once(tmp_path: Path) -> None:
    # The job's own start-up check: submit's is skipped, as where the login node cannot see the data.
    proc = start(tmp_path, "broken", "data.source=video", f"data.path={tmp_path / 'no-videos'}",
                 flags=("--skip-data-checks",))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err
    # what the terminal shows: where the run is, how it ended, and the error once (submitit's notes and
    # the traceback stay in the log)
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["submitted", "logs:", "follow:", "status:", "job"], out
    assert lines[-1].endswith("ended: FAILED")
    errors = err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: ValueError: video folder "
                                                     f"'{tmp_path / 'no-videos'}' does not exist")
    log = errors[0].rsplit("full traceback: ", 1)[1]
    assert Path(log).is_file() and Path(log).read_text().count("Traceback (most recent call last)") == 1
    status = cli("jobs.status", "--job-dir", str(tmp_path)).stdout
    assert "FAILED" in status and "video folder" in status


def test_status_running_then_cancel_saves_and_the_name_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "cancelled"
    proc = start(tmp_path, "cancelled", "steps=300")
    wait_for(lambda: len(train_steps(run_dir)) >= 3, 240, "step 3")
    job_id = events(run_dir)[0]["job_id"]
    status = cli("jobs.status", job_id, "--job-dir", str(tmp_path))
    assert status.returncode == 0 and " RUNNING " in status.stdout, status.stdout + status.stderr
    cancel = cli("jobs.cancel", job_id, "--job-dir", str(tmp_path))
    assert cancel.returncode == 0 and f"cancelled job {job_id}" in cancel.stdout
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and f"job {job_id} ended: CANCELLED" in out, out[-2000:] + err[-2000:]
    (stop,) = [e for e in events(run_dir) if e["event"] == "cancelled"]
    saved = stop["step"]
    assert saved >= 3 and f"saved at step {saved}; resume with: python -m jobs.submit --name cancelled" in err
    assert (RunFolder(run_dir).checkpoints / f"step_{saved:08d}").is_dir()
    assert "CANCELLED" in cli("jobs.status", job_id, "--job-dir", str(tmp_path)).stdout

    resumed = start(tmp_path, "cancelled", f"steps={saved + 3}")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and "ended: COMPLETED" in out, out[-2000:] + err[-2000:]
    assert f"resumed from step {saved}" in out
    assert train_steps(run_dir) == list(range(1, saved + 4))  # every step once, none lost
    # The resumed job logged one line (its last step): its pace comes from its first step on, so its ETTR
    # is known (it read 0 when it counted log lines only).
    rows = json.loads(cli("jobs.status", "--job-dir", str(tmp_path), "--format", "json").stdout)
    (resumed_row,) = [r for r in rows if r["run"] == "cancelled" and r["job_id"] != job_id]
    assert 0 < resumed_row["ettr"] <= 1, resumed_row


def test_a_closed_terminal_leaves_the_run_going_to_follow_again_and_cancel(tmp_path: Path) -> None:
    # A dropped SSH connection: the terminal's SIGHUP ends the command that followed the run, not the run
    # (its controller and ranks run in their own session, their output in the run's logs), as a Slurm job
    # outlives the shell that submitted it.
    run_dir = tmp_path / "detached"
    proc = start(tmp_path, "detached", "steps=300", own_session=True)
    wait_for(lambda: len(train_steps(run_dir)) >= 3, 240, "step 3")
    os.killpg(proc.pid, signal.SIGHUP)  # the terminal's hangup, to every process of its group
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGHUP
    job_id = events(run_dir)[0]["job_id"]
    trained = len(train_steps(run_dir))
    wait_for(lambda: len(train_steps(run_dir)) >= trained + 3, 240, "three more steps without the command")
    status = cli("jobs.status", job_id, "--job-dir", str(tmp_path))
    assert status.returncode == 0 and " RUNNING " in status.stdout, status.stdout + status.stderr
    # from a new terminal: follow it again, stop it with a save
    follow = subprocess.Popen([sys.executable, "-m", "jobs.logs", job_id, "--follow", "--job-dir",
                               str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    assert cli("jobs.cancel", job_id, "--job-dir", str(tmp_path)).returncode == 0
    out, err = follow.communicate(timeout=120)
    (stop,) = [e for e in events(run_dir) if e["event"] == "cancelled"]
    assert follow.returncode == 0, out[-2000:] + err[-2000:]
    # it streamed to the job's end: the save at the cancel, then the state
    assert f"rank 0: saved step {stop['step']}; the job was cancelled" in out
    assert out.rstrip().endswith(f"job {job_id} ended: CANCELLED")
    assert "CANCELLED" in cli("jobs.status", job_id, "--job-dir", str(tmp_path)).stdout
    assert (RunFolder(run_dir).checkpoints / f"step_{stop['step']:08d}").is_dir()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_saves_like_a_preemption(tmp_path: Path, stop: signal.Signals) -> None:
    run_dir = tmp_path / "interrupted"
    proc = start(tmp_path, "interrupted", "steps=300")
    wait_for(lambda: len(train_steps(run_dir)) >= 3, 240, "step 3")
    # what a terminal's Ctrl-C sends the CLI, or `kill`, `timeout` or a stopping container: only the CLI
    # hears it (the ranks run in their own session), so it must stop the job, not leave it running
    proc.send_signal(stop)
    out, err = proc.communicate(timeout=120)
    # docs/errors.md's exit codes: 130 for Ctrl-C, 143 for SIGTERM, as a shell reports a process they end
    assert proc.returncode == 128 + stop, out[-2000:] + err[-2000:]
    heard = "interrupted" if stop == signal.SIGINT else "terminated (SIGTERM)"
    assert f"{heard}: every rank saves at its next step" in out and "ended: CANCELLED" in out
    assert ("Ctrl-C" in out + err) == (stop == signal.SIGINT)  # a SIGTERM is not called a Ctrl-C
    (cancelled,) = [e for e in events(run_dir) if e["event"] == "cancelled"]
    assert f"saved at step {cancelled['step']}" in err and "Traceback" not in out + err
    assert (RunFolder(run_dir).checkpoints / f"step_{cancelled['step']:08d}").is_dir()


class DiesOnRankOne:
    """Rank 1 dies a moment after the start, leaving no error of its own. Rank 0 either waits for it forever
    in a collective, or has already recorded an error of its own and is still shutting down when rank 1's
    exit is seen (as when a collective fails because its peer is gone: the consequence, not the cause)."""

    def __init__(self, rank0_raises: bool) -> None:
        self.rank0_raises = rank0_raises

    def __call__(self, ctx) -> None:
        import atexit
        import time

        import torch.distributed as dist

        from taehv_slurm.runtime.distenv import init_distributed

        init_distributed(ctx.env, "gloo", timeout_s=3600)
        ctx.started(0)
        if ctx.env.rank == 1:
            time.sleep(2)
            os._exit(7)
        if self.rank0_raises:
            atexit.register(time.sleep, 30)  # still shutting down when rank 1 exits
            raise RuntimeError("Connection closed by peer: typically caused by a remote worker crashing")
        dist.barrier()  # never returns: rank 1 is gone


@pytest.mark.parametrize("rank0_raises", [False, True], ids=["rank0-hangs", "rank0-fails-after"])
def test_a_rank_that_dies_takes_the_job_down(tmp_path: Path, rank0_raises: bool) -> None:
    cluster = load_cluster(REPO / "configs/cluster/local.yaml", job_dir=str(tmp_path),
                           requeue_on_failure=False)
    handle = submit(DiesOnRankOne(rank0_raises), cluster, "dies")
    assert handle.wait(timeout_s=120, progress=False) == "FAILED"
    assert handle.error == "rank 1 exited with code 7"  # the cause, not rank 0's consequence


def test_the_gpus_a_local_run_may_use_are_those_cuda_visible_devices_names(tmp_path: Path) -> None:
    """`taehv submit --local` on a shared machine with CUDA_VISIBLE_DEVICES=1,3 runs on GPUs 1 and 3 (it used
    to set 0,1: another user's GPUs); unset, every GPU of the driver's device files, in CUDA's order."""
    from taehv_slurm.common.machine import visible_gpus

    for name in ("nvidia0", "nvidia1", "nvidia10", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, tmp_path) == ["0", "1", "2", "3", "10"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}, tmp_path) == ["1", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5e1c,2"}, tmp_path) == ["GPU-5e1c", "2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,3"}, tmp_path) == ["2"]  # CUDA stops at -1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == []


def test_a_restart_after_a_requeue_is_not_ended_by_the_grace_of_the_stop_before_it() -> None:
    """The controller runs the ranks again with the same Supervisor after a requeue: the grace it gave the
    ranks that saved and asked for a restart ends with them, not a few seconds into the restart."""
    supervisor = Supervisor(grace_s=2, requeue_code=3, say=lambda line: None)
    assert supervisor.run([RankCommand([sys.executable, "-c", "raise SystemExit(3)"], os.environ)]).requeue
    began = time.monotonic()
    restart = supervisor.run([RankCommand([sys.executable, "-c", "import time; time.sleep(4)"], os.environ)])
    assert restart.exit_codes == [0] and not restart.killed and time.monotonic() - began >= 4
