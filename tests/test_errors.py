"""The bad-input catalogue (docs/errors.md): each message there is what a user really sees.

Every test here produces an error for real (CLI, read-only mount, corrupt file, real checkpoint) and
compares it with the text docs/errors.md shows for it (`<!-- msg: KEY -->` before a ```text block).
Entries whose behaviour other test files already cover name those tests in the doc instead.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.videos import write_garbage, write_video
from taehv_slurm.picklecheck import UnpicklableTaskError, check_picklable
from taehv_slurm.runtime.checkpoint import Checkpointer, CheckpointError
from taehv_slurm.runtime.distenv import DistributedSetupError
from taehv_slurm.runtime.node_launcher import choose_ranks
from taehv_slurm.trainer.data import ClipSpec, VideoFolderClips
from tests.helpers import REPO, cli, documented, mounted_tmpfs, tiny_train

HOST = socket.gethostname()


def as_documented(text: str) -> str:
    # The doc was copied on a machine named "vm"; other machines print their own name there.
    return text.replace(HOST, "vm") if HOST != "vm" else text


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """A CLI run from `cwd` (relative paths in messages stay short): (exit code, stderr)."""
    done = cli(*args, cwd=cwd, env=env)
    return done.returncode, done.stderr.strip()


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A real read-only filesystem (tmpfs mounted ro): even root cannot write there."""
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as mount:
        yield mount


# ------------------------------------------------------------------------------------- configs

CONFIG_CASES = {
    "malformed-yaml": ("bad.yaml", "nodes: 2\npartition: [gpu\ntime_min: 5\n", ["--cluster", "bad.yaml"]),
    "unknown-key": ("typo.yaml", "nodse: 2\n", ["--cluster", "typo.yaml"]),
    "unknown-set-key": (None, None, ["--set", "nodez=2"]),
    "wrong-type": (None, None, ["--set", "nodes=two"]),
    "batch-split": (None, None, ["--nodes", "17"]),
    "batch-memory": (None, None, ["--set", "batch.per_gpu=64", "--set", "batch.effective=512"]),
    "tasks-gpus-mismatch": (None, None, ["--set", "tasks_per_node=16"]),
    "time-limit-too-short": (None, None, ["--set", "time_min=4"]),
    "signal-delay-too-short": (None, None, ["--set", "signal_delay_s=0"]),
}


@pytest.mark.parametrize("key", list(CONFIG_CASES))
def test_config_errors_are_one_line_on_the_command_line(key: str, tmp_path: Path) -> None:
    name, text, args = CONFIG_CASES[key]
    shutil.copy(REPO / "configs/cluster/h100_8gpu.yaml", tmp_path / "cluster.yaml")
    if name:
        (tmp_path / name).write_text(text)
    else:
        args = ["--cluster", "cluster.yaml", *args]
    code, err = run("jobs.submit", *args, "--dry-run", cwd=tmp_path)
    assert code == 2 and err == documented(key)


def test_a_zero_engine_without_deepspeed_is_one_line(tmp_path: Path) -> None:
    # An environment without DeepSpeed (an optional extra): the import system finds no such module.
    without = ("import sys; sys.modules['deepspeed'] = None; from taehv_slurm.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", without, "submit", "--local", "--train",
                           "configs/train/tiny.yaml", "--set", "engine.kind=zero2", "--set", "job_dir=runs"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and done.stderr.strip() == documented("zero-without-deepspeed")
    assert not (tmp_path / "runs").exists()  # nothing submitted


def test_a_tracker_without_its_package_is_one_line(tmp_path: Path) -> None:
    without = ("import sys; sys.modules['mlflow'] = None; from taehv_slurm.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", without, "submit", "--local", "--train",
                           "configs/train/tiny.yaml", "--set", "tracking.mlflow=true",
                           "--set", "job_dir=runs"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and done.stderr.strip() == documented("tracker-not-installed")
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("slurm_cluster")
def test_missing_partition_on_the_command_line(tmp_path: Path) -> None:
    shutil.copy(REPO / "configs/cluster/testbed.yaml", tmp_path / "cluster.yaml")
    code, err = run("jobs.submit", "--cluster", "cluster.yaml", "--task", "smoke",
                    "--set", "partition=nosuch", "--set", "job_dir=runs", cwd=tmp_path)
    assert code == 2 and err == documented("missing-partition")  # sbatch's own lines are not repeated
    assert not (tmp_path / "runs").exists()  # a refused submit leaves no run folder


@pytest.mark.usefixtures("slurm_cluster")
def test_slurm_commands_that_cannot_reach_munged_are_one_line(tmp_path: Path) -> None:
    """A login node whose munged is down, or a container without the host's munge socket: every Slurm
    command fails to sign its request, and the last of sbatch's four lines ('Protocol authentication
    error') names neither munge nor the fix."""
    conf = Path(os.environ["SLURM_CONF"]).read_text()
    assert re.search(r"^AuthInfo=", conf, re.M)
    munge_socket = tmp_path / "munge" / "munge.socket.2"
    conf = re.sub(r"^(AuthInfo=.*)$", rf"\1,socket={munge_socket}", conf, flags=re.M)
    (tmp_path / "slurm.conf").write_text(conf)
    shutil.copy(REPO / "configs/cluster/testbed.yaml", tmp_path / "cluster.yaml")
    env = {"SLURM_CONF": str(tmp_path / "slurm.conf")}
    code, err = run("jobs.submit", "--cluster", "cluster.yaml", "--task", "smoke", "--set", "job_dir=runs",
                    cwd=tmp_path, env=env)
    expected = documented("munge-unreachable").replace("$TMP", str(tmp_path))
    assert code == 2 and err == expected
    assert not (tmp_path / "runs").exists()  # nothing submitted, nothing left behind
    preflight = cli("jobs.preflight", "--cluster", "cluster.yaml", "--nodes", "1", cwd=tmp_path, env=env)
    rows = {line.split()[0]: line for line in preflight.stdout.splitlines() if line.strip()}
    reason = expected.removeprefix("error: sbatch could not submit the job: ")
    assert rows["partition"].split(None, 2)[1:] == ["FAIL", f"sinfo failed: {reason}"], preflight.stdout


@pytest.mark.usefixtures("slurm_cluster")
def test_a_munge_key_other_than_the_controllers_is_one_line(tmp_path: Path) -> None:
    """A login node or container whose munged has a key of its own: the controller cannot verify the
    requests and drops them, and Slurm's commands end on 'Zero Bytes were transmitted or received'."""
    folder = tmp_path / "munge"
    folder.mkdir(mode=0o700)
    (folder / "munge.key").write_bytes(os.urandom(1024))
    (folder / "munge.key").chmod(0o600)
    subprocess.run(["munged", "--force", f"--socket={folder / 'sock'}", f"--key-file={folder / 'munge.key'}",
                    f"--pid-file={folder / 'pid'}", f"--log-file={folder / 'log'}",
                    f"--seed-file={folder / 'seed'}"], check=True)
    try:
        conf = Path(os.environ["SLURM_CONF"]).read_text()
        conf = re.sub(r"^(AuthInfo=.*)$", rf"\1,socket={folder / 'sock'}", conf, flags=re.M)
        (tmp_path / "slurm.conf").write_text(conf)
        shutil.copy(REPO / "configs/cluster/testbed.yaml", tmp_path / "cluster.yaml")
        code, err = run("jobs.submit", "--cluster", "cluster.yaml", "--task", "smoke", "--set",
                        "job_dir=runs", cwd=tmp_path, env={"SLURM_CONF": str(tmp_path / "slurm.conf")})
        assert (code, err) == (2, documented("munge-key-differs"))
        assert not (tmp_path / "runs").exists()  # nothing submitted, nothing left behind
        preflight = cli("jobs.preflight", "--cluster", "cluster.yaml", "--nodes", "1", cwd=tmp_path,
                        env={"SLURM_CONF": str(tmp_path / "slurm.conf")})
        rows = {line.split()[0]: line for line in preflight.stdout.splitlines() if line.strip()}
        reason = err.removeprefix("error: sbatch could not submit the job: ")
        assert rows["partition"].split(None, 2)[1:] == ["FAIL", f"sinfo failed: {reason}"], preflight.stdout
    finally:
        subprocess.run(["munged", "--stop", f"--socket={folder / 'sock'}"], capture_output=True)


def test_no_slurm_here_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    cases = [({**env, "PATH": str(tmp_path)}, documented("no-slurm")),  # no Slurm commands at all
             ({**env, "SLURM_CONF": str(tmp_path / "nowhere.conf")}, documented("no-slurm-conf").replace(
                 "$TMP", str(tmp_path)))]
    # Slurm installed but no configuration: sbatch's DNS lookup fails
    if not Path("/etc/slurm/slurm.conf").exists():
        cases.append((env, documented("no-slurm")))
    # Each CLI path once (the training submit, a task submit, preflight's partition row), each cause once.
    commands = [["jobs.submit", "--nodes", "1"], ["jobs.submit", "--task", "smoke"],
                ["jobs.preflight", "--nodes", "1"]]
    for n, (environ, expected) in enumerate(cases):
        for args in (commands if n == 0 else commands[::2]):
            out = subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=300, env={**environ, "PYTHONPATH": str(REPO)})
            if args[0] == "jobs.preflight":  # the reason is a row; the rows that need Slurm say so
                rows = {line.split()[0]: line for line in out.stdout.splitlines()}
                assert rows["Slurm"] == f"Slurm              SKIP    {expected.removeprefix('error: ')}"
                assert rows["partition"].startswith("partition          SKIP    not checked here (no Slurm)")
                assert out.returncode == 1 and "preflight FAILED: dataset" in out.stdout  # data/prepared
            else:
                assert out.returncode == 2 and out.stderr.strip() == expected, out.stderr
    # nothing submitted, and preflight's writable check probes the job folder without creating it
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ launcher


def test_launcher_setup_errors(tmp_path: Path) -> None:
    code, err = run("jobs.launch", "--task", "smoke", cwd=tmp_path)
    assert code == 2 and as_documented(err) == documented("launch-no-gpu")
    code, err = run("jobs.launch", "--task", "smoke", "--procs-per-node", "2", cwd=tmp_path,
                    env={"RANK": "1", "WORLD_SIZE": "2"})
    assert code == 2 and err == documented("launch-no-master")


def test_launcher_refuses_more_gpus_per_node_than_the_node_has() -> None:
    # The platform form of '1 x 16 on 2 x 8': asking one node for 16 GPUs where torch sees 8.
    with pytest.raises(DistributedSetupError) as err:
        choose_ranks(16, None, "auto", gpus=8, num_nodes=1)
    assert as_documented(f"error: {err.value}") == documented("launch-gpus-per-node")


# ---------------------------------------------------------------------------------------- data


def test_dataset_missing_or_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths, as a config would give them
    spec = ClipSpec(8, 64, 64)
    with pytest.raises(ValueError) as err:
        VideoFolderClips("videos", spec)
    assert f"ValueError: {err.value}" == documented("dataset-missing")
    Path("videos").mkdir()
    Path("videos/README.txt").write_text("videos go here")
    with pytest.raises(ValueError) as err:
        VideoFolderClips("videos", spec)
    assert f"ValueError: {err.value}" == documented("dataset-empty")


def test_dataset_missing_in_a_launched_job(tmp_path: Path) -> None:
    code, err = run("jobs.launch", "--cluster", "configs/platform/cluster.yaml",
                    "--train", "configs/train/tiny.yaml", "--procs-per-node", "1",
                    "--set", "torch_threads=1", "--set", "data.source=video", "--set", "data.path=videos",
                    "--run-dir", "runs/tiny", cwd=tmp_path)
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "\n".join(lines) == documented("dataset-missing-job")


def test_corrupt_video_is_skipped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    Path("videos").mkdir()
    write_video("videos/good.mp4", 16, 64, 48)
    write_garbage("videos/broken.mp4")
    with caplog.at_level(logging.WARNING, logger="taehv_slurm.trainer.data"):
        clips = VideoFolderClips("videos", ClipSpec(8, 48, 64))
    assert clips.skipped == {"unreadable": 1} and len(clips) == 2  # the good file's two windows remain
    assert [r.getMessage() for r in caplog.records] == [documented("corrupt-video")]


# --------------------------------------------------------------------------------- checkpoints


@pytest.mark.usefixtures("slurm_cluster")  # a dry run asks Slurm about the partition
def test_checkpoint_folder_not_writable(read_only: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    # In a running job: the save fails with one line, the run keeps its earlier checkpoint.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as err:
        Checkpointer("ro/ck").save({"w": torch.zeros(4)}, 1)
    assert f"CheckpointError: {err.value}" == documented("checkpoint-not-writable")
    # Before submitting: the CLI refuses to create its run folders there ...
    code, out = run("jobs.submit", "--cluster", "configs/cluster/testbed.yaml", "--task", "smoke", "--set",
                    "job_dir=ro/runs", cwd=tmp_path)
    assert code == 2 and out == documented("job-dir-not-writable")
    # ... and preflight names the row.
    result = subprocess.run([sys.executable, "-m", "jobs.preflight", "--nodes", "1",
                             "--cluster", "configs/cluster/local.yaml",
                             "--train", "configs/train/tiny.yaml", "--set", "job_dir=ro/runs"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 1
    row = [line for line in result.stdout.splitlines() if line.startswith("checkpoint folder")]
    assert row == [documented("preflight-job-dir")]


def test_checkpoint_from_another_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from taehv_slurm.trainer.build import IncompatibleCheckpointError
    from taehv_slurm.trainer.task import TrainTask

    monkeypatch.chdir(tmp_path)
    runtime = {"device": "cpu", "torch_threads": 1, "run_dir": "runs/tiny"}
    short = {"intervals.log_every": 1, "intervals.val_every": 1000}
    result = TrainTask(tiny_train(steps=1, **short).to_dict(), runtime)()
    assert result["step"] == 1
    wider = tiny_train(steps=2, **short, **{"model.encoder_width": 32}).to_dict()
    with pytest.raises(IncompatibleCheckpointError) as err:
        TrainTask(wider, runtime)()
    assert f"IncompatibleCheckpointError: {err.value}" == documented("incompatible-checkpoint")
    assert Checkpointer("runs/tiny/checkpoints").latest_step() == 1  # nothing was overwritten


# ----------------------------------------------------------------------------------- submitting


class TaskWithALock:
    """A task that keeps a lock made in __init__: it cannot travel to the nodes."""

    def __init__(self) -> None:
        self.steps = 10
        self.progress = {"lock": threading.Lock(), "done": 0}

    def __call__(self, ctx: object) -> None:
        pass


def test_unpicklable_task_names_the_attribute() -> None:
    with pytest.raises(UnpicklableTaskError) as err:
        check_picklable(TaskWithALock())
    assert f"UnpicklableTaskError: {err.value}" == documented("unpicklable-task")
    check_picklable(lambda ctx: None)  # notebook lambdas and closures travel by value: fine


def test_the_exit_code_table_is_the_codes_the_commands_use() -> None:
    """docs/errors.md's exit codes are the CLI's (taehv_slurm.cli.conventions); the tests it names run each
    one."""
    import signal

    from taehv_slurm.cli.conventions import EXIT_DONE, EXIT_FAILED, EXIT_REFUSED, stopped_exit_code

    text = (REPO / "docs/errors.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    codes = [int(row.split("|")[1]) for row in section.splitlines() if re.match(r"\| \d+ \|", row)]
    assert codes == [EXIT_DONE, EXIT_FAILED, EXIT_REFUSED, stopped_exit_code(signal.SIGINT),
                     stopped_exit_code(signal.SIGTERM)] == [0, 1, 2, 130, 143]
    cited = set(re.findall(r"tests/(test_\w+)\.py::", section))
    assert {"test_local", "test_prepare", "test_launch"} <= cited  # every command's codes, run for real


def test_every_test_the_docs_name_exists() -> None:
    """README.md and docs/*.md point at tests (`tests/FILE.py::NAME`, a block's `copied from`): each named
    test is defined in that file, so a renamed or removed test cannot leave the docs citing nothing."""
    named = {(file, name) for doc in (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
             for file, name in re.findall(r"(tests/\w+\.py)::(\w+)", doc.read_text())}
    assert len(named) > 20  # the pattern finds what the docs cite
    missing = []
    for file, name in sorted(named):
        path = REPO / file
        tree = ast.parse(path.read_text()) if path.is_file() else None
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)} if tree else set()
        if name not in defined:
            missing.append(f"{file}::{name}")
    assert not missing, missing
