"""Run the ranks of one node as child processes and watch them, as srun does on Slurm.

Used by the platform launcher (`taehv launch`: one process per node starts a rank per GPU) and by the
local backend's controller (`taehv_slurm.local`). Both need the same four things:

- each rank in its own session, so a terminal's Ctrl-C reaches the supervisor only (which asks the
  ranks to save instead of letting the interrupt kill them), and killed with the supervisor if that dies;
- stop signals passed on: SIGTERM and USR2 as they are, SIGINT as SIGTERM (the ranks save on SIGTERM);
  a second stop signal kills at once; ranks still alive `grace_s` after a stop are killed;
- one rank failing ends the others at once (srun's --kill-on-bad-exit), and the rank that failed
  FIRST is the one reported, not a sibling that failed because of it;
- a rank exiting with `requeue_code` is not a failure: it asked to be restarted after saving, so the
  others are asked to save too (SIGTERM) and given `grace_s`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1
try:  # loaded here, not in the forked child: dlopen after fork can deadlock on the loader's lock
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


@dataclass
class RankCommand:
    argv: list[str]
    environ: Mapping[str, str]
    stdout: Any = None  # a file object, or None for the supervisor's own stdout
    label: str = ""  # how messages name the rank ("rank 3 (local rank 1)")


@dataclass
class Outcome:
    """How the ranks ended."""

    exit_codes: list[int | None] = field(default_factory=list)
    failed: int | None = None  # index of the rank that failed first (no stop signal, not a requeue)
    stopped_others: int = 0  # ranks still running when it failed, ended by the supervisor
    requeue: bool = False  # a rank exited with the requeue code
    stop_signal: int | None = None  # the first stop signal, as heard from outside (or a deadline's)
    killed: bool = False  # ranks were still alive after the grace and were killed
    timed_out: bool = False  # the time limit (a SIGTERM deadline) was reached

    def describe_failure(self, labels: Sequence[str]) -> str:
        """'rank 3 exited with code 7' for the rank that failed first ('' when none did)."""
        if self.failed is None:
            return ""
        code = self.exit_codes[self.failed]
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            how = f"was killed by {name}" + (" (often the kernel's out-of-memory killer)"
                                             if name == "SIGKILL" else "")
        else:
            how = f"exited with code {code}"
        return f"{labels[self.failed]} {how}"


class Supervisor:
    """Start the ranks, pass stop signals on, end every rank when one fails (see the module docstring)."""

    def __init__(self, grace_s: float, requeue_code: int | None = None, say: Callable[[str], None] = print,
                 on_stop: Callable[[int], None] | None = None) -> None:
        self.grace_s = grace_s
        self.requeue_code = requeue_code
        self.say = say
        self.on_stop = on_stop  # called with a SIGTERM/SIGINT from outside, before it is passed on
        self.procs: list[subprocess.Popen] = []
        self.outcome = Outcome()
        self.stop_deadline = float("inf")
        self.deadlines: list[tuple[float, int]] = []  # (monotonic time, signal) to send to every rank
        self._exits: queue.Queue[int] = queue.Queue()
        self._lock = threading.Lock()

    def run(self, commands: Sequence[RankCommand], deadlines: Sequence[tuple[float, int]] = ()) -> Outcome:
        """Start every rank and wait until all have exited. `deadlines`: (seconds from now, signal) to send
        them (a time limit: USR2 as the warning, then SIGTERM, which starts the grace and marks a timeout)."""
        now = time.monotonic()
        self.deadlines = sorted((now + delay, sig) for delay, sig in deadlines)
        self.stop_deadline = float("inf")  # a grace the last run's ranks left unused ends with them
        self.outcome = Outcome(exit_codes=[None] * len(commands))
        labels = [c.label or f"rank {i}" for i, c in enumerate(commands)]
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            for command in commands:
                with self._lock:
                    if self.outcome.stop_signal is not None:
                        break
                    self.procs.append(subprocess.Popen(command.argv, env=dict(command.environ),
                                                       stdout=command.stdout,
                                                       stderr=subprocess.STDOUT if command.stdout else None,
                                                       start_new_session=True, preexec_fn=_die_with_parent))
            for index, proc in enumerate(self.procs):
                threading.Thread(target=self._wait_for, args=(index, proc), daemon=True).start()
            self._watch(labels)
            return self.outcome
        finally:
            self._kill(self.procs)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.procs = []

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask every rank to save and exit (as a stop signal from outside would)."""
        self._on_signal(signum)

    def _wait_for(self, index: int, proc: subprocess.Popen) -> None:
        proc.wait()
        self._exits.put(index)

    def _watch(self, labels: list[str]) -> None:
        done = 0
        while done < len(self.procs):
            try:
                index = self._exits.get(timeout=0.2)
            except queue.Empty:
                self._check_deadlines(labels)
                continue
            done += 1
            code = self.procs[index].returncode
            self.outcome.exit_codes[index] = code
            if code == 0:
                continue
            if self.requeue_code is not None and code == self.requeue_code:
                self.outcome.requeue = True
                if self.outcome.stop_signal is None:  # the others save too, then everything restarts
                    self._forward(signal.SIGTERM, grace=True)
                continue
            if self.outcome.stop_signal is None and self.outcome.failed is None and not self.outcome.requeue:
                self.outcome.failed = index
                others = [p for p in self.procs if p.poll() is None]
                self.outcome.stopped_others = len(others)
                self._kill(others)

    def _check_deadlines(self, labels: list[str]) -> None:
        now = time.monotonic()
        while self.deadlines and now >= self.deadlines[0][0]:
            _, sig = self.deadlines.pop(0)
            if sig == signal.SIGTERM:
                self.outcome.timed_out = True
            self._forward(sig, grace=sig != signal.SIGUSR2)
        if now > self.stop_deadline:
            alive = [p for p in self.procs if p.poll() is None]
            if alive:
                self.say(f"{len(alive)} rank(s) still running {self.grace_s:.0f} s after the stop signal; "
                         "killing them "
                         "(the last checkpoint is intact)")
                self.outcome.killed = True
                self._kill(alive)
            self.stop_deadline = float("inf")

    def _on_signal(self, signum: int, _frame: Any = None) -> None:
        if self.on_stop is not None and signum != signal.SIGUSR2:
            self.on_stop(signum)
        if signum != signal.SIGUSR2 and self.outcome.stop_signal not in (None, signal.SIGUSR2):
            alive = [p for p in self.procs if p.poll() is None]  # a second stop: do not wait for the save
            self.say(f"second {signal.Signals(signum).name}: killing {len(alive)} rank(s) "
                     "without waiting for the save")
            self.outcome.killed = True
            self._kill(alive)
            return
        # SIGINT is passed on as SIGTERM: the ranks save on SIGTERM, while SIGINT would end them unsaved.
        forward = signal.SIGTERM if signum == signal.SIGINT else signum
        alive = sum(p.poll() is None for p in self.procs)
        self.say(f"caught {signal.Signals(signum).name}; sending {signal.Signals(forward).name} "
                 f"to {alive} rank(s): "
                 "they save at the next step and exit")
        self._forward(forward, grace=signum != signal.SIGUSR2, heard=signum)

    def _forward(self, signum: int, grace: bool, heard: int | None = None) -> None:
        """Send `signum` to every live rank; `heard`: the signal from outside it stands for (SIGINT is
        passed on as SIGTERM, and the launcher's exit code still says SIGINT)."""
        with self._lock:
            if self.outcome.stop_signal in (None, signal.SIGUSR2):
                self.outcome.stop_signal = heard or signum
            if grace:
                self.stop_deadline = min(self.stop_deadline, time.monotonic() + self.grace_s)
            for proc in self.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        # the rank only: its data-loader workers must outlive the save
                        proc.send_signal(signum)

    @staticmethod
    def _kill(procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the rank and its data-loader workers
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def _die_with_parent() -> None:
    # Runs in the child before exec: the rank gets SIGKILL if the supervisor dies (e.g. killed with SIGKILL),
    # instead of lingering in a rendezvous no one will join. Linux only.
    if _LIBC is not None:
        with contextlib.suppress(AttributeError):
            _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
