"""The Slurm testbed itself, against the real cluster: its nodes, a 2 × 8 job, requeue, accounting."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from taehv_slurm.slurm import expand_hosts, is_final, job_state
from tests.slurm_testbed import REPO, Testbed
from tests.slurm_testbed_gpus import shares_gpus, split_gpus
from tests.testbed_processes import TestbedError

T = TypeVar("T")


def sh(*argv: str, timeout_s: float = 120) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    assert done.returncode == 0, f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}"
    return done.stdout


def sbatch(*args: str) -> str:
    """Submit, return the job id."""
    return sh("sbatch", "--parsable", *args).strip().split(";")[0]


def wait_for(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.2)


def test_sinfo_lists_every_node_idle_with_8_gpus_and_16_cpus(slurm_cluster: Testbed) -> None:
    def nodes() -> dict[str, list[str]] | None:
        out = sh("sinfo", "-h", "-N", "-p", slurm_cluster.partition, "-o", "%N|%t|%G|%c|%C")
        # A trailing '-' means the backfill scheduler has planned the node for another test's pending job;
        # that is a healthy node. Other suffixes ('*' not responding, '~' powered off, ...) stay and fail.
        rows = {f[0]: [f[1].removesuffix("-"), *f[2:]] for f in (line.split("|") for line in out.split())}
        # A node may still run another test's job: then it is allocated, not idle; otherwise idle. A job
        # ending there (COMPLETING, 'comp') is waited out.
        settled = all((state == "idle") == (cpus.split("/")[0] == "0") and state != "comp"
                      for state, _, _, cpus in rows.values())
        return rows if settled else None

    rows = wait_for(nodes, 30, "every node without jobs to be idle")
    assert sorted(rows) == slurm_cluster.node_names == ["tb1", "tb2", "tb3"]
    for name, (state, gres, cpus, _) in rows.items():
        assert state in ("idle", "mix", "alloc"), f"{name} is {state}"
        assert (gres, cpus) == ("gpu:8", "16"), name


def test_two_nodes_times_eight_tasks(slurm_cluster: Testbed, tmp_path: Path) -> None:
    out = tmp_path / "tasks.out"
    report = ('echo "$SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $(hostname) '
              '$SLURM_GPUS_ON_NODE $SLURM_JOB_NODELIST"')
    sbatch("--wait", "--nodes=2", "--ntasks-per-node=8", "--gres=gpu:8", f"--output={out}",
           "--wrap", f"srun bash -c '{report}'")
    rows = [line.split() for line in out.read_text().splitlines() if line.strip()]
    assert len(rows) == 16, out.read_text()
    assert sorted(int(r[0]) for r in rows) == list(range(16))
    hosts = sorted({r[3] for r in rows})  # the two nodes Slurm chose (another test's job may hold the third)
    assert len(hosts) == 2 and set(hosts) <= set(slurm_cluster.node_names)
    for node_id, host in enumerate(hosts):
        mine = [r for r in rows if r[3] == host]
        assert sorted(int(r[1]) for r in mine) == list(range(8)), host
        assert {r[2] for r in mine} == {str(node_id)}, host
    assert {r[4] for r in rows} == {"8"}  # --gres=gpu:8 reached every task
    assert all(expand_hosts(r[5]) == hosts for r in rows)


def test_requeue_runs_the_job_again_with_restart_count_1(slurm_cluster: Testbed, tmp_path: Path) -> None:
    marks = tmp_path / "runs.txt"
    # First run: mark, then wait to be requeued. The rerun marks and ends at once.
    script = (f'echo "run ${{SLURM_RESTART_COUNT:-0}} $(hostname)" >> {marks}; '
              '[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ] && exit 0; sleep 120')
    job = sbatch("--requeue", "--output=/dev/null", "--wrap", script)
    wait_for(lambda: marks.exists() and marks.read_text(), 30, "the first run to start")
    sh("scontrol", "requeue", job)
    requeued = time.monotonic()
    wait_for(lambda: marks.read_text().count("run") >= 2, 60, "the requeued job to run again")
    print(f"requeued job ran again {time.monotonic() - requeued:.1f} s after `scontrol requeue`")
    runs = [line.split()[:2] for line in marks.read_text().splitlines()]
    assert runs == [["run", "0"], ["run", "1"]]
    # sacct in this Slurm has no restart counter; the controller has it.
    assert "Restarts=1" in sh("scontrol", "show", "job", job)


def test_sacct_lists_finished_jobs_with_state_and_exit_code(slurm_cluster: Testbed) -> None:
    ok = sbatch("--output=/dev/null", "--wrap", "true")
    failed = sbatch("--output=/dev/null", "--wrap", "exit 3")

    def finished() -> dict[str, tuple[str, str]] | None:
        out = sh("sacct", "-n", "-P", "-X", "-j", f"{ok},{failed}", "-o", "JobID,State,ExitCode")
        rows = {f[0]: (f[1], f[2]) for f in (line.split("|") for line in out.splitlines()) if len(f) == 3}
        return rows if {s for s, _ in rows.values()} <= {"COMPLETED", "FAILED"} and len(rows) == 2 else None

    rows = wait_for(finished, 60, "sacct to list both jobs as finished")
    assert rows == {ok: ("COMPLETED", "0:0"), failed: ("FAILED", "3:0")}


def test_cli_status_shows_the_daemons_and_nodes(slurm_cluster: Testbed) -> None:
    out = sh(sys.executable, "-m", "tests.slurm_testbed", "status", "--dir", str(slurm_cluster.root),
             timeout_s=60)
    assert "slurmctld: pid" in out and "slurmdbd: pid" in out
    assert all(f"slurmd-{n}: pid" in out for n in slurm_cluster.node_names)
    assert "tb1 tb* " in out and "gpu:8" in out


def test_gpus_are_split_evenly_or_taken_in_turn_by_more_nodes_than_gpus() -> None:
    four = [f"/dev/nvidia{i}" for i in range(4)]
    assert split_gpus(four, 2) == [four[:2], four[2:]] and not shares_gpus(split_gpus(four, 2))
    assert split_gpus(four[:1], 3) == [four[:1]] * 3  # a 1-GPU host holds a 3-node cluster
    assert split_gpus(four[:2], 4) == [[four[0]], [four[1]], [four[0]], [four[1]]]
    assert shares_gpus(split_gpus(four[:1], 3))
    for devices, nodes in ((four, 3), (four[:2], 3), ([], 2)):
        with pytest.raises(TestbedError, match="cannot be split evenly"):
            split_gpus(devices, nodes)


@pytest.fixture(scope="module")
def gpu_testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    """The GPU cluster's setup (`--real-gpus`, no accounting) with character devices standing in for a 4-GPU
    host's /dev/nvidia0..3 (no driver needed: Slurm only checks that they are devices)."""
    devices = tmp_path_factory.mktemp("dev")
    files = [str(devices / f"nvidia{i}") for i in range(4)]
    for i, file in enumerate(files):
        os.mknod(file, 0o600 | stat.S_IFCHR, os.makedev(195, i))
    bed = Testbed(tempfile.mkdtemp(prefix="tbgpu", dir="/tmp"), nodes=2, cpus_per_node=2, accounting=False,
                  gpu_devices=files)
    try:
        bed.start()
        yield bed
    finally:
        bed.stop()
        shutil.rmtree(bed.root, ignore_errors=True)


def test_the_gpu_cluster_gives_each_node_its_share_of_the_host_gpus(gpu_testbed: Testbed) -> None:
    """The second node's tasks get the host's GPUs 2 and 3, where Slurm alone would give every node 0 and 1
    (tests/slurm_testbed_gpus.py)."""
    env = {**os.environ, **gpu_testbed.env}

    def visible(*srun: str) -> list[str]:
        done = subprocess.run(["srun", *srun, "sh", "-c", 'echo "$(hostname) $CUDA_VISIBLE_DEVICES"'],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return sorted(done.stdout.split("\n")[:-1])

    assert visible("-N2", "--ntasks-per-node=1", "--gres=gpu:2") == ["tb1 0,1", "tb2 2,3"]
    assert visible("-N1", "-w", "tb2", "--gres=gpu:1") in (["tb2 2"], ["tb2 3"])
    assert "gpu:2" in gpu_testbed.status()


def test_a_finished_job_s_state_is_known_without_accounting(gpu_testbed: Testbed,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Where sacct has nothing (no accounting: small sites, the GPU cluster), the controller still lists a
    finished job for MinJobAge: `taehv submit --follow` once never saw its job end there."""
    for key, value in gpu_testbed.env.items():
        monkeypatch.setenv(key, value)
    ok = sbatch("--output=/dev/null", "--wrap", "true")
    failed = sbatch("--output=/dev/null", "--wrap", "exit 3")

    def ended() -> tuple[str | None, ...] | None:
        states = (job_state(ok), job_state(failed))
        return states if all(s and is_final(s) for s in states) else None

    assert wait_for(ended, 60, "both jobs to end") == ("COMPLETED", "FAILED")
