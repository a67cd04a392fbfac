"""Ranks in a container image, with every Slurm command the library needs run outside it.

On the real testbed, Charliecloud's `ch-run` (a container runtime of HPC sites, from Debian's packages) runs
every rank of a 2-node job inside a Debian 12 image built by scripts/setup.sh, which holds no Slurm: no
scontrol on the ranks' PATH, no slurm.conf. The job is preempted (`scontrol requeue`) and then warned of its
time limit (USR2): each time every rank saves, rank 0 learns what Slurm does with the job and requeues it
itself — through the job's Slurm relay in the batch script — and the next attempt resumes where it saved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm.submission import submit
from tests.helpers import REPO, events, make_cluster, wait_done
from tests.tasks import SaysWhereItRuns

pytestmark = pytest.mark.usefixtures("slurm_cluster")
IMAGE = REPO / ".container-image"


def steps_trained(run_dir: Path) -> list[int]:
    path = run_dir / "steps.txt"
    return [int(n) for n in path.read_text().split()] if path.exists() else []


def test_ranks_in_a_container_save_requeue_and_resume_with_slurm_outside(tmp_path: Path) -> None:
    assert (IMAGE / "etc" / "taehv-test-image").exists(), "run scripts/setup.sh: it builds the test image"
    python = Path(sys.executable)
    folders = list(dict.fromkeys(map(str, (REPO, "/tmp", Path(sys.base_prefix).resolve(),
                                           Path(sys.prefix).resolve()))))
    for folder in folders:  # Charliecloud binds only onto folders the image has, as a site's image would
        (IMAGE / folder.lstrip("/")).mkdir(parents=True, exist_ok=True)
    mounts = [f"{f}:{f}" for f in folders]
    cluster = make_cluster(tmp_path, nodes=2, gpus_per_node=1, time_min=10, container_image=str(IMAGE),
                           container_runtime="charliecloud", container_mounts=mounts,
                           container_python=str(python))
    run = submit(SaysWhereItRuns(200, step_s=0.1), cluster, "contained")
    script = (run.folder / f"{run.job_id}_submission.sh").read_text()
    assert f"ch-run -b {mounts[0].split(':')[0]}" in script and f"{IMAGE} -- {python} -u -m" in script

    wait_for(lambda: len(steps_trained(run.run_dir)) >= 20, 180, "the job to train")
    subprocess.run(["scontrol", "requeue", run.job_id], check=True)  # a preemption
    wait_for(lambda: len(events(run, "start")) >= 2 and len(steps_trained(run.run_dir)) >= 60, 180,
             "the next attempt to train")
    subprocess.run(["scancel", "--signal=USR2", run.job_id], check=True)  # the time limit's warning
    assert wait_done(run.job_id, 300) == "COMPLETED", run.tail(60)

    preempted, warned = events(run, "requeue")
    assert (preempted["reason"], preempted["by"]) == ("preempted", "slurm")
    assert (warned["reason"], warned["by"]) == ("timeout", "self")  # rank 0's own scontrol requeue
    assert all(e["signal_to_saved_s"] < 10 for e in (preempted, warned))
    assert sorted(set(steps_trained(run.run_dir))) == list(range(1, 201))
    seen = [json.loads(p.read_text()) for p in sorted(run.run_dir.glob("seen-*.json"))]
    assert len(seen) == 6  # 2 ranks × 3 attempts, every one inside the image, without Slurm
    assert all(s == {"scontrol": None, "in_image": True, "slurm_conf": False} for s in seen), seen


def dry_run(tmp_path: Path, *settings: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "jobs.submit", "--cluster", "configs/cluster/testbed.yaml",
                           "--dry-run", "--skip-data-checks", "--set", f"job_dir={tmp_path / 'runs'}",
                           *(a for s in settings for a in ("--set", s))],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("runtime, image, mounts, problem", [
    ("pyxis", "/nowhere/pytorch.sqsh", "RUNS", "container_image /nowhere/pytorch.sqsh does not exist"),
    ("pyxis", "nvcr.io/nvidia/pytorch:24.05-py3", "RUNS",
     "Pyxis separates a registry with '#' (write nvcr.io#nvidia/pytorch:24.05-py3)"),
    ("pyxis", "nvcr.io#nvidia/pytorch:24.05-py3", "/nowhere:/data",
     "container_mounts: /nowhere does not exist"),
    ("pyxis", "nvcr.io#nvidia/pytorch:24.05-py3", "", "the run folders ("),
    ("charliecloud", "IMAGE", "RUNS", "is no folder in the image"),
])
def test_a_container_the_ranks_could_not_use_is_refused_in_one_line(tmp_path: Path, runtime: str, image: str,
                                                                    mounts: str, problem: str) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "image").mkdir()
    mounts = mounts.replace("RUNS", f"{runs}:{runs}")
    code, out = dry_run(tmp_path, f"container_runtime={runtime}",
                        f"container_image={image.replace('IMAGE', str(tmp_path / 'image'))}",
                        f"container_mounts=[{json.dumps(mounts)}]" if mounts else "container_mounts=[]")
    (row,) = [line for line in out.splitlines() if line.startswith("container ")]
    assert code == 2 and problem in row and "FAIL" in row, out


def test_each_runtime_starts_the_ranks_in_the_image_and_the_rest_outside(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    mount = f"container_mounts=[\"{tmp_path}:{tmp_path}\"]"
    code, out = dry_run(tmp_path, "container_runtime=apptainer", "container_image=docker://pytorch/pytorch",
                        mount, "gpus_per_node=1")
    assert code == 0, out
    srun = next(line for line in out.splitlines() if line.strip().startswith("srun "))
    image = "docker://pytorch/pytorch"
    assert f'apptainer exec --nv --bind {tmp_path}:{tmp_path} --pwd "$PWD" {image} python3 -u -m' in srun
    relay = next(line for line in out.splitlines() if "taehv_slurm.relay start" in line)
    assert relay.startswith(f"relay=$({sys.executable} -m taehv_slurm.relay")  # outside: the host's Python
