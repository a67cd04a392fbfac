"""A Slurm job runs the code it was submitted with, whatever happens to the checkout while it waits.

On the real testbed, from a git checkout of its own: two jobs are submitted to start in an hour, then the
checkout is edited so that its entry point refuses to run, a 1-GiB data file appears in it (untracked), and
the jobs may start.
The job with the snapshot (the default) trains, is requeued, and trains on to its end on the
submitted code; the one submitted with `code_snapshot: false` runs the edited checkout and fails at once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm.common.runfolder import JobDir
from taehv_slurm.runtime.provenance import read_attempts
from tests.helpers import REPO, cli, wait_done

pytestmark = pytest.mark.usefixtures("slurm_cluster")

EDIT = 'sys.exit("[taehv] the edited checkout ran")'
SUBMIT = """
import sys
from pathlib import Path
from taehv_slurm.submission import submit
from tests.helpers import make_cluster
from tests.tasks import CountingTask
job_dir, name, snapshot = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "on"
cluster = make_cluster(job_dir, nodes=1, gpus_per_node=1, time_min=10, sbatch_args={"begin": "now+1hour"},
                       code_snapshot=snapshot)
print(submit(CountingTask(60, step_s=0.1), cluster, name).job_id)
"""


def checkout_of_this_tree(where: Path) -> Path:
    """A git checkout holding this tree's tracked files as they are now, committed."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, where / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "the submitted code"]):
        subprocess.run([*git, *args], cwd=where, check=True)
    return where


def submit_from(checkout: Path, job_dir: Path, name: str, snapshot: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", SUBMIT, str(job_dir), name, snapshot], cwd=checkout,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def test_a_job_trains_the_submitted_code_after_the_checkout_changes(tmp_path: Path) -> None:
    checkout = checkout_of_this_tree(tmp_path / "checkout")
    job_dir = tmp_path / "runs"
    kept = submit_from(checkout, job_dir, "kept", "on")
    live = submit_from(checkout, job_dir, "live", "off")

    entry = checkout / "taehv_slurm" / "runtime" / "entry.py"  # the first code of the ranks and of the script
    entry.write_text(entry.read_text().replace("    signals.hold()", f"    {EDIT}\n    signals.hold()", 1))
    with open(checkout / "data.bin", "wb") as big:  # untracked data inside the tree: 1 GiB, never copied
        big.truncate(1 << 30)
    for job in (kept, live):  # queued all this time: now they may start
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)

    assert wait_done(live, 120) == "FAILED"
    log = JobDir(job_dir).run("live").submitit / f"{live}_0_log.out"
    assert "the edited checkout ran" in log.read_text()
    wait_for(lambda: len((job_dir / "kept" / "steps.txt").read_text().split()) >= 10
             if (job_dir / "kept" / "steps.txt").exists() else False, 120, "the job to train")
    subprocess.run(["scontrol", "requeue", kept], check=True)  # its next attempt starts after the edit too
    assert wait_done(kept, 300) == "COMPLETED"

    attempts = read_attempts(job_dir / "kept")
    assert len(attempts) == 2
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True,
                          check=True).stdout.strip()
    copies = {Path(a["code"]["snapshot"]) for a in attempts}
    (copy,) = copies
    assert copy.parent == JobDir(job_dir).code and all(a["code"]["commit"] == head for a in attempts)
    assert EDIT not in (copy / "taehv_slurm" / "runtime" / "entry.py").read_text()
    assert not (copy / "data.bin").exists() and (copy / "tests" / "tasks.py").is_file()
    size = sum(p.stat().st_size for p in copy.rglob("*") if p.is_file())
    assert size < 64 << 20
    assert json.loads((copy / ".taehv-snapshot.json").read_text())["tree"] == str(checkout)


def test_the_dry_run_shows_the_copy_on_pythonpath_and_no_snapshot_drops_it(tmp_path: Path) -> None:
    base = ["jobs.submit", "--cluster", "configs/cluster/testbed.yaml", "--dry-run", "--skip-data-checks",
            "--set", f"job_dir={tmp_path}"]
    shown, code = cli(*base), JobDir(tmp_path).code
    assert shown.returncode == 0, shown.stderr
    assert f"export PYTHONPATH={code}/" in shown.stdout and not code.exists()
    plain = cli(*base, "--no-snapshot")
    assert plain.returncode == 0 and "PYTHONPATH" not in plain.stdout
