"""Process helpers of the Slurm testbed: reading /proc, waiting for a condition, ending processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# Popen objects of the daemons this Python process started, by pid: kept so they can be reaped
# (waited for) when stopped, instead of lingering as zombies of the test process.
CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def read(path: str) -> str:
    try:
        return Path(path).read_bytes().decode(errors="replace")
    except OSError:
        return ""


def uts(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    child = CHILDREN.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        del CHILDREN[pid]  # reaped
        return False
    stat = read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")  # a zombie is dead


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def terminate(pids: list[int], sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10) -> None:
    """Send `sig` to each pid, wait for all to end, SIGKILL the ones that would not."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if not wait_until(lambda: not any(map(alive, pids)), timeout_s):
        for pid in filter(alive, pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(map(alive, pids)), 5)


def other_slurm_daemons() -> list[int]:
    """Slurm daemons still running on this machine (called once ours are stopped: so, someone else's)."""
    names = {"slurmctld", "slurmd", "slurmdbd", "slurmstepd"}
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and read(f"{p}/comm").strip() in names and alive(int(p.name))]
