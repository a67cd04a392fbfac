"""Faults inflicted from outside on a run's processes, as a cluster inflicts them (a slow or starved host,
stopped loader workers, a slower device), and what it takes to aim and time them: a rank's record (its pid,
host, step), its child processes, waiting for a condition. One home for the tests and the bench scripts
(bench/ never imports tests/)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from taehv_slurm.common.runfolder import RunFolder

SLOWER_DEVICE = Path(__file__).resolve().parent / "slower_device"


def slower_device_env(rank: int, seconds: float, pythonpath: str | None = None) -> dict[str, str]:
    """What the environment of the process that starts a job adds so that the job's rank `rank` does
    `seconds` more device work every step, as on a slower GPU (bench/slower_device/sitecustomize.py);
    `pythonpath`: the PYTHONPATH it adds to (os.environ's)."""
    from bench.slower_device.sitecustomize import EXTRA_COMPUTE_ENV

    path = os.pathsep.join(filter(None, [str(SLOWER_DEVICE), pythonpath or os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, EXTRA_COMPUTE_ENV: f"{rank}:{seconds}"}


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


def rank_record(run: Any, rank: int) -> dict[str, Any]:
    """The rank's record in the run folder (`run`: a JobHandle or the folder); {} before it wrote one."""
    try:
        return json.loads(RunFolder(getattr(run, "run_dir", run)).rank_record(rank).read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def slowed_down(pids: int | list[int], stopped_s: float, running_s: float) -> Iterator[None]:
    """The process(es) stopped (SIGSTOP) for stopped_s of every stopped_s + running_s, as on a slow node,
    until the block ends or a process is gone; running again (SIGCONT) after it."""
    pids = [pids] if isinstance(pids, int) else pids
    done = threading.Event()

    def duty_cycle() -> None:
        with contextlib.suppress(ProcessLookupError):
            while not done.is_set():
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                time.sleep(stopped_s)
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                time.sleep(running_s)

    cycling = threading.Thread(target=duty_cycle, daemon=True)
    cycling.start()
    try:
        yield
    finally:
        done.set()
        cycling.join()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def children(pid: int) -> list[int]:
    """The processes `pid` started (a rank's loader workers), from /proc."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]
