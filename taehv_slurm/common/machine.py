"""This machine's GPUs and memory, read without torch (the submit path imports none): for the local backend's
plan and checks, which run where the jobs will."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path


def visible_gpus(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA GPUs this process may use, as CUDA numbers them for it: CUDA_VISIBLE_DEVICES's entries
    where it is set (up to the first negative one, where CUDA stops), else every GPU of the driver's
    device files (no torch import on the submit path)."""
    given = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return sorted((p.name[len("nvidia"):] for p in dev.glob("nvidia[0-9]*")), key=int)
    visible = []
    for entry in filter(None, (e.strip() for e in given.split(","))):
        if entry.startswith("-"):
            break
        visible.append(entry)
    return visible


def gpus_here() -> int:
    """How many GPUs this process may use on this machine (`visible_gpus`)."""
    return len(visible_gpus())


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
