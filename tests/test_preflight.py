"""jobs.preflight against the real Slurm testbed: a passing run with a job on 2 nodes, and failing runs
that exit non-zero naming the failing row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.videos import write_garbage, write_video

pytestmark = pytest.mark.usefixtures("slurm_cluster")

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(.+?)\s{2,}(PASS|FAIL|WARN|SKIP)\s+(.*)$")


def preflight(tmp: Path, *args: str, nodes: int = 2,
              env: dict[str, str] | None = None) -> tuple[int, dict[str, tuple[str, str]], str]:
    """Run the CLI on the testbed config (2 GPUs per node); returns (exit code, {check: (result, detail)},
    output)."""
    cmd = [sys.executable, "-m", "jobs.preflight", "--nodes", str(nodes),
           "--cluster", "configs/cluster/testbed.yaml", "--train", "configs/train/tiny.yaml",
           "--gpus-per-node", "2", "--set", f"job_dir={tmp / 'runs'}", *args]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                         capture_output=True, text=True, timeout=600)
    rows = {m.group(1).strip(): (m.group(2), m.group(3)) for m in map(ROW.match, out.stdout.splitlines())
            if m}
    return out.returncode, rows, out.stdout + out.stderr


def test_passing_run_with_a_job_on_two_nodes(tmp_path: Path) -> None:
    videos = tmp_path / "videos"
    (videos / "b").mkdir(parents=True)
    write_video(videos / "a.mp4", 16, 64, 48)
    write_video(videos / "b" / "c.mp4", 16, 64, 48)
    write_garbage(videos / "b" / "broken.mp4")  # skipped and counted, not fatal
    code, rows, out = preflight(tmp_path, "--job", "--bandwidth-mib", "1,4", "--set", "data.source=video",
                                "--set", f"data.path={videos}")
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("preflight passed")
    # the job's two nodes: whichever two of the testbed's three Slurm gave it (other tests' jobs run beside)
    nodes = sorted(check for check in rows if check.startswith("node "))
    assert len(nodes) == 2, rows
    for check in ("cluster config", "train config", "plan", "dependencies", "checkpoint folder", "partition",
                  "GPUs (gres)", "CPUs", "nodes", "accounting", "requeue", "job", "rendezvous", *nodes,
                  "all-reduce 1 MiB", "all-reduce 4 MiB"):
        assert rows[check][0] == "PASS", (check, rows.get(check))
    assert "torch 2" in rows["dependencies"][1] and "deepspeed" in rows["dependencies"][1]
    assert rows["accounting"][1].startswith("accounting_storage/slurmdbd: sacct keeps each attempt")
    assert rows["requeue"][1].startswith("PreemptMode=OFF, JobRequeue=1; the job asks --requeue")
    assert rows["dataset"][0] == "WARN"
    assert ("2 of 3 sampled decode" in rows["dataset"][1]
            and "1 skipped and counted: skipping b/broken.mp4: unreadable" in rows["dataset"][1])
    assert rows["rendezvous"][1].startswith("4/4 ranks joined")
    for node, ranks in zip(nodes, ("ranks 0-1", "ranks 2-3")):
        detail = rows[node][1]
        # Honest about what was measured on a CPU testbed: Slurm's allocation, not CUDA devices.
        assert detail.startswith(f"{ranks} (2 tasks); Slurm allocated 2 of 2 GPUs (SLURM_GPUS_ON_NODE")
        assert "no CUDA device was checked" in detail and "driver none" in detail
    assert "GB/s" in rows["all-reduce 4 MiB"][1]
    # what the collectives travel over between the nodes (gloo on CPUs: TCP), with the bandwidth measured
    assert rows["network"][0] == "PASS"
    pattern = r"gloo over Socket \(\S+\); [\d.]+ GB/s bus bandwidth at 4 MiB"
    assert re.fullmatch(pattern, rows["network"][1]), rows


def test_missing_partition_fails_that_row_and_submits_nothing(tmp_path: Path) -> None:
    code, rows, out = preflight(tmp_path, "--job", "--set", "partition=nosuch")
    assert code == 1, out
    assert rows["partition"] == ("FAIL", "partition 'nosuch' not found; sinfo lists: tb: set partition "
                                         "(or --partition) to one of them")
    assert rows["job"][0] == "SKIP"  # no job is submitted when a row already failed
    assert out.strip().splitlines()[-1] == "preflight FAILED: partition"


def test_more_nodes_than_the_partition_has(tmp_path: Path, slurm_cluster) -> None:
    code, rows, out = preflight(tmp_path, nodes=slurm_cluster.nodes + 1)
    assert code == 1, out
    result, detail = rows["nodes"]
    assert (result == "FAIL" and f"need {slurm_cluster.nodes + 1}" in detail
            and f"lower --nodes to {slurm_cluster.nodes}" in detail)
    assert out.strip().splitlines()[-1] == "preflight FAILED: nodes"


def test_missing_dataset(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    code, rows, out = preflight(tmp_path, "--set", "data.source=video", "--set", f"data.path={missing}")
    assert code == 1, out
    assert rows["dataset"] == ("FAIL", f"ValueError: video folder '{missing}' does not exist "
                                       "or is not a directory; "
                                       "point the data root at a folder of .mp4/.webm/.mkv/.mov files")
    assert out.strip().splitlines()[-1] == "preflight FAILED: dataset"
    # without --job it writes nothing: the job folder is probed, not created
    assert rows["checkpoint folder"][0] == "PASS" and "(to be created in " in rows["checkpoint folder"][1]
    assert list(tmp_path.iterdir()) == []


def test_a_job_folder_others_can_write_fails_as_submit_would(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)
    code, rows, out = preflight(tmp_path)
    assert code == 1, out
    assert rows["checkpoint folder"][0] == "FAIL"
    assert rows["checkpoint folder"][1].startswith(f"{runs} can be written by every user (mode 0777): ")
    assert list(runs.iterdir()) == [] and oct(runs.stat().st_mode & 0o777) == oct(0o777)  # untouched


def test_gres_cpus_and_memory_the_nodes_do_not_have(tmp_path: Path, slurm_cluster) -> None:
    code, rows, out = preflight(tmp_path, "--set", "gres=gpu:a100:2", "--set", "cpus_per_task=9",
                                "--set", "mem_gb=64")
    assert code == 1, out
    usable = f"0 of {slurm_cluster.nodes} usable node(s)"
    assert rows["GPUs (gres)"] == ("FAIL", f"{usable} offer gpu:a100:2 (nodes have gpu:8): "
                                           "set gpus_per_node (or gres) to what the nodes have")
    assert rows["CPUs"] == ("FAIL", f"18 CPUs per node = 2 tasks × 9 cpus_per_task; {usable} "
                                    "have that many (at most 16): lower cpus_per_task to 8")
    assert rows["memory"][0] == "FAIL" and "mem_gb 64 per node" in rows["memory"][1]
    assert out.strip().splitlines()[-1] == "preflight FAILED: GPUs (gres), CPUs, memory, nodes"


def test_a_broken_diffusers_fails_only_a_config_whose_teacher_needs_it(tmp_path: Path) -> None:
    # A diffusers that fails to import, ahead of the real one on the path (as a half-upgraded environment).
    shadow = tmp_path / "shadow" / "diffusers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('half-upgraded')\n")
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{shadow.parent}"}
    # HunyuanVideo's teacher is read without diffusers: diffusers only shows its installed version
    code, rows, out = preflight(tmp_path, nodes=1, env=env)
    assert rows["dependencies"][0] == "PASS" and "diffusers 0." in rows["dependencies"][1], out
    code, rows, out = preflight(tmp_path, "--set", "teacher.kind=cogvideox",
                                "--set", f"teacher.path={tmp_path}", nodes=1, env=env)
    assert code == 1 and rows["dependencies"] == (
        "FAIL", "missing: diffusers (ImportError: half-upgraded; needed for teacher.kind cogvideox); "
                "install them in the job's environment (pip install -e . installs all)"), out
