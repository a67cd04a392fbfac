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


def take() -> list[tuple[int, float]]:
    """The (signal, arrival time) pairs held so far, oldest first; they are handed over once."""
    held = list(_held)
    del _held[: len(held)]
    return held
