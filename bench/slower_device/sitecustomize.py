"""A slower device for one rank of a job, brought in from outside the product (tests/test_stragglers.py,
bench/slow_rank_faults.py): put this folder on the job's PYTHONPATH and set EXTRA_COMPUTE_ENV to
"RANK:SECONDS", and that rank's every timed step does SECONDS more device work, as a slower GPU would (on a
CPU: matrix products until the main thread used that much CPU time; a stopped or starved process still
owes it). The work is added where the step's compute begins, so the rank's StepClock times it as compute.

Python imports `sitecustomize` at every start; this one waits for taehv_slurm.trainer.stragglers to be
imported (a finder on sys.meta_path) rather than importing torch into every process of the job."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from typing import Any

EXTRA_COMPUTE_ENV = "TAEHV_EXTRA_COMPUTE"
TARGET = "taehv_slurm.trainer.stragglers"


def spin_for(seconds: float, cuda: bool) -> Any:
    """A function that adds `seconds` of work on the GPU (cuda) or this thread's CPU, without the host
    waiting for the GPU's."""
    import torch

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10**7)  # calibrates the spin: cycles per second of this GPU
        end.record()
        end.synchronize()
        cycles = int(seconds * 10**7 / (start.elapsed_time(end) / 1000))
        return lambda: torch.cuda._sleep(cycles)
    a = torch.ones(64, 64)

    def spin() -> None:
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            a @ a
    return spin


def slow_down(step_clock: type, rank: int, seconds: float) -> None:
    """StepClock.compute_begins, on rank `rank`, followed by `seconds` of device work."""
    import torch.distributed as dist

    begins, spin = step_clock.compute_begins, []  # the spin, made at the rank's first step

    def compute_begins(self: Any) -> None:
        begins(self)
        if (dist.get_rank() if dist.is_initialized() else 0) != rank:
            return
        if not spin:
            print(f"{EXTRA_COMPUTE_ENV}: rank {rank} does {seconds:.3f} s more work every step",
                  file=sys.stderr, flush=True)
            spin.append(spin_for(seconds, self.cuda))
        spin[0]()
    step_clock.compute_begins = compute_begins


class _SlowerDevice(importlib.abc.MetaPathFinder):
    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_slow_down(module: Any) -> None:
            exec_module(module)
            slow_down(module.StepClock, self.rank, self.seconds)
        spec.loader.exec_module = exec_and_slow_down
        return spec


if os.environ.get(EXTRA_COMPUTE_ENV):
    _rank, _, _seconds = os.environ[EXTRA_COMPUTE_ENV].partition(":")
    sys.meta_path.insert(0, _SlowerDevice(int(_rank), float(_seconds)))
