"""The loader's shared memory (/dev/shm) as a container or a crowded node gives it: `taehv submit --local`
(real rank and loader processes) in a mount namespace of its own, where /dev/shm is a small tmpfs.

- too small for the plan's loader from the start (Docker's default is 64 MB; a shipped micro-batch holds 50 MB
  of frames): the loader is fitted to it, says so in one line, and the run trains to its end. Before, a
  worker's batch that found no room was dropped in the queue's feeder thread and the rank waited forever;
- filled by another process mid-run: the ranks fail with one line naming it and the fix, the run restarts
  with the loader fitted to what is left and trains to its end;
- `fit_loader`'s arithmetic.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.trainer.shared_memory import fit_loader
from tests.helpers import REPO, metrics, read_strictly

NO_ROOM = "RuntimeError: a loader worker found no room for a batch in /dev/shm"
# Another process taking every page of /dev/shm the loaders free, for 30 s or until the file argv[1] is
HOG = """
import os, sys, time
end, n = time.time() + 30, 0
while time.time() < end and not os.path.exists(sys.argv[1]):
    fs = os.statvfs("/dev/shm")
    if free := fs.f_bavail * fs.f_frsize:
        n += 1
        os.posix_fallocate(os.open(f"/dev/shm/hog{n}", os.O_CREAT | os.O_RDWR), 0, free)
    time.sleep(0.01)
"""


def submit_with_small_shm(job_dir: Path, shm: str, steps: int) -> subprocess.Popen:
    """`taehv submit --local` of the tiny config (2 ranks, 2 loader workers each) in a mount namespace whose
    /dev/shm is a tmpfs of `shm`; the process is the CLI itself (the namespace's first)."""
    sets = [f"job_dir={job_dir}", "teacher.kind=none", f"steps={steps}", "data.num_workers=2",
            "intervals.log_every=5", "intervals.ckpt_every=10"]
    argv = [sys.executable, "-m", "jobs.submit", "--local", "--train", "configs/train/tiny.yaml",
            "--name", "shm", *(a for one in sets for a in ("--set", one))]
    script = f"mount -t tmpfs -o size={shm} tmpfs /dev/shm && exec {' '.join(argv)}"
    return subprocess.Popen(["unshare", "--mount", "sh", "-c", script], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, job_dir: Path, timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:  # a hung run's ranks (sessions of their own) must not outlive the test
        subprocess.run(["pkill", "-KILL", "-f", str(job_dir)], capture_output=True)
        proc.kill()


def test_a_small_shared_memory_fits_the_loader_and_the_run_trains_to_its_end(tmp_path: Path) -> None:
    job_dir = tmp_path / "jobs"
    output = finish(submit_with_small_shm(job_dir, "2m", steps=30), job_dir, 180)
    assert "ended: COMPLETED" in output, output[-3000:]
    (note,) = [line for line in output.splitlines() if "loader: /dev/shm" in line]
    assert note.endswith("loader: /dev/shm has 2 MB free for 2 rank(s) on this node, and 2 workers × "
                         "prefetch 4 would hold 8 batches of ≈0.5 MB each: 1 worker, prefetch 1 instead; "
                         "give the job more shared memory for the full loader (a container's --shm-size, or "
                         "--ipc=host)"), note
    assert [r["step"] for r in metrics(job_dir / "shm") if "loss" in r][-1] == 30


def test_shared_memory_filled_mid_run_fails_in_one_line_and_a_restart_fits_the_loader(tmp_path: Path) -> None:
    job_dir, run = tmp_path / "jobs", RunFolder(tmp_path / "jobs" / "shm")
    proc = submit_with_small_shm(job_dir, "8m", steps=60)
    try:
        wait_for(lambda: any(r.get("step", 0) >= 12 for r in metrics(run.path)), 120, "step 12")
        hog = subprocess.Popen(["nsenter", "-t", str(proc.pid), "-m", sys.executable, "-c", HOG,
                                str(tmp_path / "failed")])
        failed = lambda: any(e["event"] == "failure" for e in read_strictly(run.events(), missing_ok=True))  # noqa: E731
        wait_for(failed, 60, "a failure")
        (tmp_path / "failed").touch()
        hog.wait(30)
    finally:
        output = finish(proc, job_dir, 240)
    assert "ended: COMPLETED" in output, output[-3000:]
    events = read_strictly(run.events())
    failures = [e for e in events if e["event"] == "failure"]
    assert failures and all(e["error"].startswith(NO_ROOM) for e in failures), failures
    assert failures[0]["error"].endswith("give the job more shared memory (a container's --shm-size, or "
                                         "--ipc=host) or free it; a restart fits the loader to what is free")
    assert [e["reason"] for e in events if e["event"] == "requeue"] == ["failure"]  # nothing killed after it
    assert "no workers (this rank reads its data itself) instead" in output
    assert [r["step"] for r in metrics(run.path) if "loss" in r][-1] == 60


@pytest.mark.parametrize(("free_mb", "ranks", "expected"), [
    (1000, 2, (2, 4)),   # room for all: unchanged
    (8, 2, (2, 2)),      # 4 batches a rank: the prefetch lowered first
    (4, 2, (2, 1)),      # 2 batches a rank: prefetch 1
    (2, 2, (1, 1)),      # 1 batch a rank: fewer workers
    (1, 2, (0, 4)),      # not one: no workers (the rank reads its data itself)
    (8, 8, (1, 1)),      # the node's ranks share it
])
def test_fit_loader_keeps_the_loaders_batches_in_half_the_free_shared_memory(free_mb, ranks, expected):
    workers, prefetch, note = fit_loader(2, 4, 0.5e6, ranks, int(free_mb * 1e6))
    assert (workers, prefetch) == expected and (note is None) == (expected == (2, 4))
    assert workers * prefetch * 0.5e6 * ranks <= 0.5 * free_mb * 1e6 or workers == 0
    assert fit_loader(0, 4, 0.5e6, 1, 0) == (0, 4, None) and fit_loader(2, 4, 0.5e6, 1, None) == (2, 4, None)
