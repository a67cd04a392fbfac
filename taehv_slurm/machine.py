"""This machine's GPUs and memory, read without torch (the submit path imports none): for the local backend's
plan and checks, which run where the jobs will."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path


def gpus_here() -> int:
    """NVIDIA GPUs on this machine, from the driver's device files (no torch import on the submit path)."""
    return len(list(Path("/dev").glob("nvidia[0-9]*")))


@functools.lru_cache(maxsize=1)
def gpu_memory_here() -> float | None:
    """GB of memory of this machine's first GPU (nvidia-smi; no torch import), None without one."""
    if not gpus_here():
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        return float(out[0]) / 1024 if out else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def host_memory_here() -> float | None:
    """GB of this machine's memory (/proc/meminfo), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return kib / 1024**2
    except (OSError, StopIteration, ValueError):
        return None
