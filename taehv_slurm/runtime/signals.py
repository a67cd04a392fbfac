"""Signals that reach a task while it is still starting, held until the training loop can act on them.

Slurm's time-limit warning (USR2) or a preemption (SIGTERM) can arrive while a task is still importing
and loading its pickle, seconds before any handler of submitit's or ours exists. At their default
action they end the process, and Slurm records the job FAILED. The entry point calls `hold()` first
thing; `RequeueableTask` then installs its own handlers and replays what arrived (`take()`). This
module imports nothing but the standard library, so `hold()` runs within milliseconds of the start.
"""

from __future__ import annotations

import signal
import time
from typing import Any

WATCHED = (signal.SIGUSR2, signal.SIGTERM)
_held: list[tuple[int, float]] = []


def _hold(signum: int, _frame: Any) -> None:
    _held.append((signum, time.time()))


def hold() -> None:
    """Record USR2 and SIGTERM (with their arrival time) instead of ending the process."""
    for signum in WATCHED:
        signal.signal(signum, _hold)


def ignore_in_worker(_worker_id: int = 0) -> None:
    """A data-loader worker's `worker_init_fn`: USR2 and SIGTERM ignored. Slurm signals every process of a
    job step (proctrack/cgroup), a rank's loader workers too; at torch's worker handler they die, and the
    rank sees "DataLoader worker exited unexpectedly" instead of the preemption it can save for. The rank
    acts on the signal, and its workers end with it."""
    for signum in WATCHED:
        signal.signal(signum, signal.SIG_IGN)


def take() -> list[tuple[int, float]]:
    """The (signal, arrival time) pairs held so far, oldest first; they are handed over once."""
    held = list(_held)
    del _held[: len(held)]
    return held
