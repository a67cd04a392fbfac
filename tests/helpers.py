"""Shared by the tests: configs for the Slurm testbed, waiting, a run's files, Triton's CPU interpreter."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# The fault tools live with the benchmarks that also inflict them (bench/ never imports tests/); tests
# import them from here as well.
from bench.faults import children, rank_record, slowed_down, wait_for  # noqa: F401
from taehv_slurm.common.config import ClusterConfig, TrainConfig, load_cluster, load_train
from taehv_slurm.common.runfolder import EventLog, RunFileWarning, RunFolder
from taehv_slurm.runtime.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[1]
LOCAL_JOB_ID = r"\d+-[0-9a-z]+"  # a local job's id: its controller's pid, '-', its start second in base 36
# The environment submitit's local executor gives the single task of job 4242 (for running the entry point
# directly).
LOCAL_TASK_ENV = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "4242", "SUBMITIT_LOCAL_NTASKS": "1",
                  "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0",
                  "SUBMITIT_LOCAL_GLOBALID": "0",
                  "SUBMITIT_LOCAL_LOCALID": "0"}
TRITON_INTERPRETER = REPO / ".triton-interpreter"  # scripts/setup.sh installs Triton here


def run_interpreted(check: str, done_line: str) -> None:
    """Run ``check`` (Python) in a process where Triton's kernels run on CPU (TRITON_INTERPRET=1), with the
    interpreter kept outside the suite's packages (a CPU machine has no Triton, and importing it would slow
    every process); assert that it printed ``done_line``."""
    import pytest

    if not (TRITON_INTERPRETER / "triton").is_dir():
        pytest.fail(f"Triton's interpreter is not installed in {TRITON_INTERPRETER}: run scripts/setup.sh")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(TRITON_INTERPRETER)]))
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done_line in done.stdout, done.stderr[-3000:]


def documented(key: str, tmp: Path | None = None) -> str:
    """The message block docs/errors.md shows under `<!-- msg: KEY -->` (`$TMP` there: `tmp`)."""
    text = (REPO / "docs/errors.md").read_text()
    blocks = dict(re.findall(r"<!-- msg: (\S+) -->\n```text\n(.*?)\n```", text, re.S))
    assert key in blocks, f"docs/errors.md has no message block '{key}'"
    return blocks[key].replace("$TMP", str(tmp)) if tmp is not None else blocks[key]


def make_cluster(job_dir: Path, **overrides: Any) -> ClusterConfig:
    """The CI cluster config (2 nodes × 8 fake GPUs), with a private job_dir per test."""
    return load_cluster(REPO / "configs/cluster/testbed.yaml", job_dir=str(job_dir), **overrides)


def tiny_train(**overrides: Any) -> TrainConfig:
    """configs/train/tiny.yaml, what `taehv submit --local` trains: the distillation end to end."""
    return load_train(REPO / "configs/train/tiny.yaml", **overrides)


# The tiny config without its teacher and at 32×32: a job of it costs about 2.5× less CPU (40 steps on
# 2 ranks: 7.8 s against 19 s). For the tests of what happens around training (requeues, hangs,
# failures, handles), not of the distillation itself.
QUICK = {"teacher.kind": "none", "data.height": 32, "data.width": 32}
# Every step logged, no validation or periodic save between: the tests that compare runs step by step
# (bit-identical after a requeue, a follow-up job, another world size).
STEP_BY_STEP = {"intervals.log_every": 1, "intervals.val_every": 10_000, "intervals.ckpt_every": 10_000,
                "batch.per_gpu": 2}


def quick_train(**overrides: Any) -> TrainConfig:
    return tiny_train(**{**QUICK, **overrides})


# Launcher variables of the test process that a user's shell would not have.
_NOT_A_USERS_SHELL = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TAEHV_JOB_DIR")


def cli(*args: str, cwd: Path = REPO, env: Mapping[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ARGS` as a user runs it from a checkout (e.g. cli("jobs.submit", "--local", ...)): the
    checkout on PYTHONPATH, the test session's launcher variables and job_dir left out; `env` adds to it."""
    base = {k: v for k, v in os.environ.items() if k not in _NOT_A_USERS_SHELL}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd,
                          env={**base, "PYTHONPATH": str(REPO), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def unreachable_controller_conf(folder: Path) -> Path:
    """A copy of this Slurm's slurm.conf with nothing listening at its controller's port: Slurm's commands
    given it find the controller out of reach, as while it is down, and accounting (slurmdbd) answers."""
    return _unreachable_conf(folder, "SlurmctldPort")


def unreachable_accounting_conf(folder: Path) -> Path:
    """Likewise with nothing listening at slurmdbd's port: sacct finds accounting out of reach, as while
    slurmdbd is down, and the controller answers."""
    return _unreachable_conf(folder, "AccountingStoragePort")


def _unreachable_conf(folder: Path, key: str) -> Path:
    port = int(re.search(rf"^{key}=(\d+)", Path(os.environ["SLURM_CONF"]).read_text(), re.M).group(1))
    return slurm_conf_with(folder, **{key: str(port + 7)})


def slurm_conf_with(folder: Path, **settings: str) -> Path:
    """A copy of this Slurm's slurm.conf with `settings` in place of its own, for Slurm's commands given it
    through SLURM_CONF (the daemons keep theirs)."""
    conf = Path(os.environ["SLURM_CONF"]).read_text()
    for key, value in settings.items():
        conf = re.sub(rf"^{key}=.*$", f"{key}={value}", conf, flags=re.M)
    path = folder / f"slurm-{'-'.join(settings)}.conf"
    path.write_text(conf)
    return path


def read_strictly(log: EventLog, missing_ok: bool = False) -> list[dict[str, Any]]:
    """Every line of a run file, through the library's reader, as a test needs it: a damaged line (which the
    reader skips with a warning) fails the test, and so does a missing file unless `missing_ok` ([])."""
    if not missing_ok and not log.path.exists():
        raise FileNotFoundError(f"no {log.path}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunFileWarning)
        return log.read()


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Rank 0's metrics lines, every one ([] before the first); a damaged line fails the test."""
    return read_strictly(RunFolder(run_dir).metrics(), missing_ok=True)


def events(handle: Any, kind: str | None = None) -> list[dict[str, Any]]:
    """The events of a JobHandle's run folder (every job of it), of one kind if given."""
    return [e for e in handle.events(run_wide=True) if kind is None or e["event"] == kind]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics(run_dir) if "loss" in row}


def last_step(run_dir: Path) -> int:
    rows = [r for r in metrics(run_dir) if "loss" in r]
    return rows[-1]["step"] if rows else 0


def final_state(run_dir: Path) -> tuple[int, dict, dict]:
    loaded = Checkpointer(RunFolder(run_dir).checkpoints).load_latest()
    assert loaded is not None, f"no checkpoint in {run_dir}"
    return loaded


def job_state(job_id: str) -> str:
    """The library's answer (squeue with every state, then accounting: a cluster without accounting shows a
    job's end only in squeue, for MinJobAge), or UNKNOWN."""
    from taehv_slurm.slurm import job_state as state

    return state(job_id) or "UNKNOWN"


def wait_done(job_id: str, timeout_s: float) -> str:
    final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    return wait_for(lambda: (s := job_state(job_id)) in final and s, timeout_s, f"job {job_id} to end")


def assert_identical(a: dict, b: dict, what: str = "state") -> None:
    import torch

    assert a.keys() == b.keys(), f"{what}: keys differ"
    for key in a:
        if isinstance(a[key], dict):
            assert_identical(a[key], b[key], f"{what}.{key}")
        elif torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), (f"{what}.{key} differs "
                                                 f"(max {float((a[key] - b[key]).abs().max())})")
        else:
            assert a[key] == b[key], f"{what}.{key}: {a[key]!r} != {b[key]!r}"


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, options: str) -> Iterator[Path]:
    """A real small (or read-only) filesystem at `mount` for the test's duration; needs root."""
    import pytest

    mount.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs ({options}) for this test (needs root): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def in_terminal(argv: list[str], cwd: Path, columns: int = 150, timeout: float = 600) -> tuple[int, str]:
    """Run argv with a pseudo-terminal as stdin/stdout/stderr, as in an interactive shell: (exit code,
    output)."""
    parent, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns)}
    proc = subprocess.Popen(argv, stdin=child, stdout=child, stderr=child, cwd=cwd, env=env, close_fds=True)
    os.close(child)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([parent], [], [], 1)[0]:
            try:
                data = os.read(parent, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    code = proc.wait(timeout=60)
    os.close(parent)
    return code, b"".join(chunks).decode(errors="replace")
