"""The loop around a run as a user types it (`python -m jobs.submit ...` in a subprocess, `--local`):
the live bar in a terminal and the closing summary, resubmitting a finished run, a local sweep
followed to its end, and a sweep's dry run showing the job-array script."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from taehv_slurm.common.runfolder import JobDir, RunFolder
from tests.helpers import LOCAL_JOB_ID, cli, in_terminal


def test_live_bar_summary_and_resubmitting_a_finished_run(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "jobs.submit", "--local", "--train", "configs/train/tiny.yaml",
            "--name", "bar",
            "--set", "steps=24", "--set", "intervals.log_every=2", "--set", "intervals.val_every=12"]
    code, shown = in_terminal(argv, tmp_path)
    assert code == 0, shown[-3000:]
    bars = re.findall(rf"\r\x1b\[2K(job {LOCAL_JOB_ID} RUNNING [^\r\n]*)", shown)
    assert bars, shown[-3000:]
    drawn = bars[-1]  # the bar as last drawn while the job ran
    assert re.search(r"\[#+-*\] \d+/24", drawn) and "clips/s" in drawn and "ETA " in drawn, drawn
    assert "loss " in drawn and " dB" in drawn, drawn
    assert "train step 2/24" in shown  # rank 0's log lines scroll above the bar
    end = shown[shown.index("ended: COMPLETED"):]
    assert re.search(r"final: train PSNR [\d.]+ dB \(loss [\d.e-]+\), "
                     r"validation PSNR [\d.]+ dB at step 24", end), end
    assert re.search(r"steps: 24/24, \d+:\d\d wall, last [\d.]+ clips/s, requeued 0×", end), end
    # goodput, as README shows it: one attempt, so no interruption part
    assert re.search(r"\ngoodput: ETTR \d+ % of [\d.]+ node-h; first step after \d+ s \(start-up \d+ s\); "
                     r"saves [\d.]+ s\r?\n", end), end
    run = tmp_path / "runs" / "bar"
    assert f"checkpoint:  {Path('runs/bar/checkpoints/step_00000024')}" in end
    assert "tensorboard --logdir runs/bar/tb" in end
    # the export as printed writes inside the run folder (under job_dir), beside none of the user's files
    (export,) = re.findall(r"export: +python -m (jobs\.export runs/bar --out runs/bar/bar\.safetensors)\r?\n",
                           end)
    exported = cli(*export.split(), cwd=tmp_path)
    assert exported.returncode == 0 and (run / "bar.safetensors").is_file(), exported.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]

    registry = JobDir(tmp_path / "runs").registry.read_text()
    again = cli("jobs.submit", "--local", "--train", "configs/train/tiny.yaml", "--name", "bar",
                "--set", "steps=24", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "bar (step 24 of 24) already trained every step; nothing submitted" in again.stdout
    assert "--set steps=48" in again.stdout
    assert JobDir(tmp_path / "runs").registry.read_text() == registry  # no job was started
    assert [p.name for p in RunFolder(run).checkpoints.glob("step_*")] == ["step_00000024"]


def test_local_sweep_follows_every_run_and_fails_if_one_does(tmp_path: Path) -> None:
    done = cli("jobs.submit", "--local", "--train", "configs/train/tiny.yaml", "--name", "sw",
               "--set", "steps=4", "--set", "tasks_per_node=1", "--set", "requeue_on_failure=false",
               "--sweep", "model.init_from=null,missing.pth", cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.rindex("job_id"):].splitlines()
    assert len(table) == 3
    assert "COMPLETED" in table[1] and "4/4" in table[1] and "None" in table[1]
    assert "FAILED" in table[2] and "missing.pth" in table[2]
    assert re.search(rf"error: sw/init_from=missing\.pth \(job {LOCAL_JOB_ID}\) ended FAILED: "
                     "FileNotFoundError",
                     done.stderr), done.stderr
    # The CLI returned only once every run had ended.
    job_ids = re.findall(rf"submitted job ({LOCAL_JOB_ID})", done.stdout)
    for job_id in job_ids:
        state = json.loads(next(JobDir(tmp_path / "runs").run("sw").submitit.glob(f"{job_id}_local.json"))
                           .read_text())
        assert state["state"] in ("COMPLETED", "FAILED")
    # Local ids never repeat: a pid is reused, but not with the same start second.
    assert len(set(job_ids)) == 2
    assert all(abs(int(job_id.split("-")[1], 36) - time.time()) < 900 for job_id in job_ids), job_ids


@pytest.mark.usefixtures("slurm_cluster")  # a dry run asks Slurm about the partition
def test_sweep_dry_run_prints_the_job_array_script(tmp_path: Path) -> None:
    done = cli("jobs.submit", "--nodes", "2", "--sweep", "optim.lr=1e-4,2e-4,4e-4", "--max-parallel", "2",
               "--name", "lrs", "--dry-run", "--skip-data-checks", cwd=tmp_path)  # the script, not the data
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    out = done.stdout
    assert "#SBATCH --array=0-2%2" in out and "#SBATCH --nodes=2" in out
    assert "%A_%a_0_log.out" in out and "%A_%a_%t_log.out" in out
    assert "3 runs, one job array: runs/lrs/lr=0.0001, runs/lrs/lr=0.0002, runs/lrs/lr=0.0004" in out
    assert list(tmp_path.iterdir()) == []
