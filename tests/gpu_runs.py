"""The training runs tests/test_gpu.py checks, started in the background at the first GPU test of pytest.

`python3 -m pytest -m gpu -n 0` is meant to run whole in five minutes on one H200
(`bash bench/run_gpu_benchmarks.sh gpu_tests` times it). A run of the shipped config through `jobs.submit
--local` spends most of its time starting and compiling, on the CPU; so the runs go on beside the in-process
GPU tests (kernels, engine, teacher, prepared windows) and beside each other, and share one compile cache
folder (the cluster config's `compile_cache_dir`): each graph compiles once for all. tests/conftest.py
starts them before the first GPU test of a pytest run that holds tests/test_gpu.py, and runs that module's
tests, which wait for them, last.

The runs: configs/train/taehv.yaml made small (128×192 synthetic clips, 12 steps of 32 micro-batches of 2 —
the shipped config's accumulation on one GPU —, lr 2e-4 after 4 warmup steps, validation and checkpoints
in between):
- `default` and `graphs` (CUDA graphs, `reduce-overhead`) start at once, with `zero3` (uncompiled). Once
  `default` has logged step 5 its rank is stopped from outside while `jobs.cancel` runs, then let go: the
  signal lands well before its last step whatever the GPU's speed, the rank saves and the job ends
  CANCELLED; the same --name then resumes it to step 12;
- `zero2` (compiled) starts with that resume, its graphs then in the cache;
- the logged-speed run is its test's own, after every run here ended: it times the GPU alone.
TAEHV_GPU_TESTS_ON_CPU=1 runs the same sequence on CPU ranks with the tiny config (nothing compiles there):
a check of this module's sequence, not of anything the GPU tests prove.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.faults import wait_for
from taehv_slurm.common.runfolder import RunFolder
from tests.helpers import QUICK, REPO, metrics, read_strictly

ON_CPU = os.environ.get("TAEHV_GPU_TESTS_ON_CPU") == "1"
STEPS, PER_GPU, ACCUMULATION = 12, 2, 32
TRAIN = REPO / ("configs/train/tiny.yaml" if ON_CPU else "configs/train/taehv.yaml")
SMALL = {"data.source": "synthetic", "data.height": 128, "data.width": 192, "data.num_clips": 512,
         "data.val_clips": 4, "teacher.kind": "none", "steps": STEPS, "optim.warmup_steps": 4,
         "optim.lr": 2e-4,
         "intervals.log_every": 1, "intervals.val_every": 5, "intervals.ckpt_every": 4,
         "batch.per_gpu": PER_GPU, "batch.effective": PER_GPU * ACCUMULATION,
         **({**QUICK, "engine.compile": True} if ON_CPU else {})}
RUNS = {"default": {"engine.compile_mode": "default"}, "graphs": {"engine.compile_mode": "reduce-overhead"},
        "zero2": {"engine.kind": "zero2", "batch.effective": PER_GPU * 4},
        "zero3": {"engine.kind": "zero3", "batch.effective": PER_GPU * 4}}
CANCEL_AT_STEP = 5
RUN_TIMEOUT_S = 900


def cluster_file(folder: Path, name: str, cpus: int) -> Path:
    """A 1-GPU local cluster config, as a user with one GPU writes it; one compile cache for every run."""
    path = folder / f"{name}.yaml"
    device = "device: cpu\ngpus_per_node: 0\n" if ON_CPU else "device: cuda\ngpus_per_node: 1\n"
    path.write_text(f"backend: local\nnodes: 1\n{device}cpus_per_task: {cpus}\ntime_min: 60\n"
                    f"signal_delay_s: 30\njob_dir: {folder / 'runs'}\n"
                    f"compile_cache_dir: {folder / 'compile-cache'}\n")
    return path


def submit_args(cluster: Path, name: str, **overrides: object) -> list[str]:
    settings = {**SMALL, **overrides}
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    return [sys.executable, "-m", "jobs.submit", "--local", "--cluster", str(cluster), "--train", str(TRAIN),
            "--name", name, *sets]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in metrics(run_dir) if "loss" in r]


def run_events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_strictly(RunFolder(run_dir).events()) if e["event"] == kind]


class Runs:
    """The runs, driven by a thread: `attempts[name]` holds each attempt's exit and output."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        cores = os.cpu_count() or 2
        # three runs at once beside the in-process tests, a share of the cores each; alone, the timed run
        self.cluster = cluster_file(folder, "shared", 1 if ON_CPU else max(2, cores // 4))
        self.alone = cluster_file(folder, "alone", 1 if ON_CPU else min(12, cores))
        self.attempts: dict[str, list[subprocess.CompletedProcess]] = {}
        self.cancel: subprocess.CompletedProcess | None = None
        self.saved_at_cancel: list[str] = []  # the checkpoints the cancelled attempt left (later ones rotate)
        self.error: BaseException | None = None
        self._running: list[subprocess.Popen] = []
        self._thread = threading.Thread(target=self._drive, name="gpu-runs", daemon=True)
        self._thread.start()

    def run_dir(self, name: str) -> Path:
        return self.folder / "runs" / name

    def finished(self) -> dict[str, list[subprocess.CompletedProcess]]:
        """Every run's attempts, once all have ended (a failure of the sequence itself is raised here)."""
        self._thread.join(timeout=3 * RUN_TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"the GPU runs had not ended after {3 * RUN_TIMEOUT_S} s: {self.folder}")
        if self.error is not None:
            raise RuntimeError(f"the GPU runs' sequence failed: {self.error!r}") from self.error
        return self.attempts

    def stop(self) -> None:
        for proc in self._running:
            if proc.poll() is None:
                proc.kill()

    def _drive(self) -> None:
        try:
            first = {name: self._start(name) for name in ("default", "graphs", "zero3")}
            self._cancel_mid_run("default")
            self._ended("default", first.pop("default"))
            saved = self.run_dir("default").glob("checkpoints/*/state.pt")
            self.saved_at_cancel = sorted(path.parent.name for path in saved)
            then = {"default": self._start("default"), "zero2": self._start("zero2")}
            for name, proc in [*first.items(), *then.items()]:
                self._ended(name, proc)
        except BaseException as err:  # noqa: BLE001 - handed to the tests, which raise it
            self.error = err
            self.stop()

    def _start(self, name: str) -> subprocess.Popen:
        log = self.folder / f"{name}-{len(self.attempts.get(name, []))}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(submit_args(self.cluster, name, **RUNS[name]), cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, text=True)
        proc.log = log  # type: ignore[attr-defined]
        self._running.append(proc)
        return proc

    def _ended(self, name: str, proc: subprocess.Popen) -> None:
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        output = proc.log.read_text()  # type: ignore[attr-defined]
        print(f"{name}: exit {proc.returncode}; {output.strip().splitlines()[-1:]}", flush=True)
        self.attempts.setdefault(name, []).append(subprocess.CompletedProcess(proc.args, proc.returncode,
                                                                              output, ""))

    def _cancel_mid_run(self, name: str) -> None:
        """`jobs.cancel` while the run's rank is stopped (SIGSTOP) past step CANCEL_AT_STEP: the signal is
        there when the rank runs on, several steps before the run's end whatever the GPU's speed."""
        run_dir = self.run_dir(name)
        wait_for(lambda: len(train_rows(run_dir)) >= CANCEL_AT_STEP, RUN_TIMEOUT_S, f"{name} at step 5",
                 poll_s=0.02)
        pid = json.loads(RunFolder(run_dir).rank_record(0).read_text())["pid"]
        job_id = read_strictly(RunFolder(run_dir).events())[0]["job_id"]
        os.kill(pid, signal.SIGSTOP)
        try:
            cancel = [sys.executable, "-m", "jobs.cancel", job_id, "--job-dir", str(self.folder / "runs")]
            self.cancel = subprocess.run(cancel, cwd=REPO, capture_output=True, text=True, timeout=60)
            time.sleep(1.0)
        finally:
            os.kill(pid, signal.SIGCONT)


_RUNS: Runs | None = None


def wanted() -> bool:
    """A CUDA device is here (or the CPU sequence was asked for)."""
    import torch

    return ON_CPU or torch.cuda.is_available()


def start(factory: pytest.TempPathFactory) -> Runs:
    """This pytest run's runs, started at the first call."""
    global _RUNS
    if _RUNS is None:
        _RUNS = Runs(factory.mktemp("gpu-runs"))
    return _RUNS


def stop() -> None:
    if _RUNS is not None:
        _RUNS.stop()
