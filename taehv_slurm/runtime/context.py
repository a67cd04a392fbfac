"""The run context: what a task gets from the requeue machinery, and the stop flag behind it.

A task receives its `RunContext` and calls `ctx.step_boundary(step, save)` at every step. All ranks
agree on the stop flag with one all-reduce; when a signal reached any rank, every rank calls `save()`
at that step, then rank 0 asks the backend what happens to the job (taehv_slurm.runtime.rank_backend) and
records it in the run's events (`RunFolder.events`) as it happened:
  - Slurm is requeueing it already (preemption, `scontrol requeue`: its Restarts went up) → `requeue`;
  - the job was cancelled (`scancel`, `taehv cancel`) → `cancelled`;
  - a SIGTERM that is no job event where the batch script restarts the ranks (srun ending the step after a
    peer died, a stray SIGTERM) → `step_ended`: the script decides what follows;
  - otherwise (the time-limit warning, SIGTERM at the time limit, a stray SIGTERM) rank 0 asks Slurm to
    requeue it: `requeue` when Slurm accepted, else `requeue_failed` with Slurm's answer, and rank 0
    exits non-zero with one line naming the cause, the fix and how to resume, so the job ends FAILED.
Then every rank exits (`RequeueExit`). A task that does not reach a step boundary within the grace
cannot save: the watchdog (`StopFlag`) says so in one line, records it, and ends the rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taehv_slurm.common.messages import command
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.common.security import make_private_dir
from taehv_slurm.runtime import collector
from taehv_slurm.runtime.distenv import DistEnv
from taehv_slurm.runtime.provenance import record_attempt
from taehv_slurm.runtime.rank_backend import RankBackend
from taehv_slurm.runtime.ranks import node_name

if TYPE_CHECKING:
    from taehv_slurm.runtime.watchdog import Watchdog

REQUEUE_FAILED_EXIT_CODE = 3  # saved, but the job could not be requeued: the job must end FAILED
SETTLE_MARGIN_S = 3.0  # of a signal's grace, kept for recording the outcome and exiting
_REASON_CODES = {None: 0, "preempted": 1, "timeout": 2}
_CODE_REASONS = {v: k for k, v in _REASON_CODES.items()}


def grace_seconds(signal_delay_s: float, kill_wait_s: float) -> dict[str, float]:
    """Seconds a rank may take from a signal to its exit, by reason, before the watchdog ends it: the
    time-limit warning leaves `signal_delay_s` (minus a margin for the requeue itself), SIGTERM leaves
    the site's KillWait (minus a margin for the exit)."""
    return {"timeout": max(10.0, signal_delay_s - 10.0), "preempted": max(5.0, kill_wait_s - 5.0)}


class FatalTaskError(RuntimeError):
    """Raised by a task (on every rank alike) for a failure a restart would only repeat — a diverged run, an
    input the task refuses: rank 0 records it, the job ends FAILED with this one line, nothing requeues."""


class RequeueExit(SystemExit):
    """Raised on every rank after the state is saved: ends the process without a result (submitit
    then leaves the job to its requeue) — never caught as an ordinary exception."""


class StopFlag:
    """Set from a signal handler; read at step boundaries; a watchdog ends the rank if no save comes."""

    def __init__(self, grace_s: dict[str, float]) -> None:
        self.reason: str | None = None
        self.polled = False  # the task asked at a step boundary at least once (it can save at a signal)
        self.signal_time: float | None = None
        self.saved_step: int | None = None  # set once every rank saved at the signal
        self.exit_code = 0
        self.on_give_up: Callable[[str], None] | None = None  # records why the rank gave up (rank 0)
        self._grace_s = grace_s
        self._watchdog: threading.Timer | None = None
        self._deadline = math.inf  # when the watchdog ends this rank (set by the first signal)
        self._armed_grace_s = 0.0  # the grace that deadline came from

    def handle(self, signum: int, _frame: Any = None) -> None:
        self.record(signum, time.time())

    def record(self, signum: int, at: float) -> None:
        """A signal that arrived at time `at` (now, or while the task was starting). Each signal that
        raises the reason (preempted → timeout) or brings the watchdog's deadline closer is announced."""
        reason = "timeout" if signum == signal.SIGUSR2 else "preempted"
        deadline = at + self._grace_s[reason]
        raises_reason = _REASON_CODES[reason] > _REASON_CODES[self.reason]
        if raises_reason:
            self.reason = reason
        if self.signal_time is None:
            self.signal_time = at
        elif not raises_reason and deadline >= self._deadline:
            return
        print(f"[taehv] caught {signal.Signals(signum).name} on {socket.gethostname()}: "
              f"saving at the next step boundary ({self.reason})", flush=True)
        if deadline < self._deadline:  # a SIGTERM after USR2: Slurm's SIGKILL comes sooner
            # If a peer died and a collective hangs, the save never comes: leave before SIGKILL does.
            self._deadline, self._armed_grace_s = deadline, self._grace_s[reason]
            self.disarm()
            self._watchdog = threading.Timer(max(0.0, deadline - time.time()), self._give_up)
            self._watchdog.daemon = True
            self._watchdog.start()

    def deadline(self) -> float:
        """When the watchdog ends this rank: the earliest signal's arrival plus its grace."""
        return self._deadline if self.signal_time is not None else time.time() + self._grace_s["preempted"]

    def _give_up(self) -> None:
        grace = self._armed_grace_s
        if self.saved_step is not None:
            why = (f"saved step {self.saved_step}, but the requeue was not settled within {grace:.0f} s "
                   "of the signal; "
                   "exiting (the saved step is kept)")
        elif self.polled:
            why = (f"could not save and exit within {grace:.0f} s of the signal (a peer may have died); "
                   "exiting "
                   "without saving (the last checkpoint is intact)")
        else:
            why = (f"the task never called ctx.step_boundary (or ctx.should_stop) in the {grace:.0f} s "
                   "after the signal: it cannot save at a signal, so the work since its last own checkpoint "
                   "is lost; call "
                   "ctx.step_boundary(step, save) at each step")
        print(f"[taehv] {why}", flush=True)
        if self.on_give_up is not None:
            with contextlib.suppress(Exception):  # the exit below must happen whatever the record does
                self.on_give_up(why)
        sys.stdout.flush()
        os._exit(self.exit_code or 1)

    def disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()


class _FlagAgreement:
    """Every rank learns the largest stop code of all ranks with one all-reduce (MAX) per step boundary.

    On GPUs the reduction is read one boundary later: reading it at once would make the host wait for
    the step it just queued and leave the GPU idle at every boundary. Every rank reads the same
    reduction at the same boundary, so all ranks still stop at the same step (one step after the
    signal instead of at the next boundary). The first boundary reads its own reduction.
    """

    def __init__(self) -> None:
        self.pending: tuple[Any, Any] | None = None

    def exchange(self, code: int, device: Any = None) -> int:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return code
        if device is None or torch.device(device).type != "cuda":  # gloo: the reduction is synchronous anyway
            flag = torch.tensor([code], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return int(flag.item())
        flag = torch.tensor([code], dtype=torch.int32).pin_memory().to(device, non_blocking=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        result = torch.empty(1, dtype=torch.int32).pin_memory()
        result.copy_(flag, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        previous, self.pending = self.pending, (result, done)
        result, done = previous or self.pending
        done.synchronize()
        return int(result[0])


class RunContext:
    """What a task needs from the requeue machinery, passed to it: its run folder, who it is (`env`),
    the events file, and the one call it makes at every step boundary."""

    def __init__(self, run_dir: Path, env: DistEnv, stop: StopFlag, segment: int,
                 backend: RankBackend, watchdog: Watchdog | None = None) -> None:
        self.run_dir = run_dir
        self.watchdog = watchdog
        self.env = env
        self.stop = stop
        self.segment = segment
        self.backend = backend
        self.events = RunFolder(run_dir).events()
        self._agreement = _FlagAgreement()
        self.start_step: int | None = None
        self.start_time = self.began = time.time()
        self.step = 0

    @classmethod
    def standalone(cls, run_dir: str | os.PathLike) -> RunContext:
        """A context for a task called directly (no submitit): no signal handling, same files."""
        return cls(make_private_dir(run_dir), DistEnv.from_environ(), StopFlag(grace_seconds(70, 30)), 0,
                   RankBackend())

    def started(self, step: int, config: Mapping[str, Any] | None = None, **info: Any) -> None:
        """Call once the state is loaded (all ranks): marks the segment's start step. `config`: the task's
        resolved configuration, recorded with the code and versions of this attempt (provenance). The
        start's objects are frozen out of garbage collection from here on (`collector`)."""
        collector.resume()
        self.start_step = self.step = step
        self.start_time = time.time()
        self.began = float(os.environ.get("TAEHV_STARTED_AT") or self.start_time)  # set by the entry point
        if self.env.rank == 0:
            self.events.write("start", segment=self.segment, step=step, job_id=self.env.job_id,
                              restart_count=self.env.restart_count, world_size=self.env.world_size,
                              host=node_name(), began=self.began, **info)
            with contextlib.suppress(OSError):  # a record, never a reason for the attempt to fail
                record_attempt(self.run_dir, self.env.job_id, self.env.restart_count, self.segment, step,
                               config, info.get("network"))
        if self.watchdog is not None:
            self.watchdog.enter("step", step)
            self.watchdog.rank_file.write()  # the step it resumed from, for anyone who finds it dead

    def enter(self, section: str, step: int | None = None) -> None:
        """The task now does `section` (startup, step, data, validate, save, ...): its watchdog times each
        section against what it has seen of it, and a hang names the section a rank was stuck in."""
        if self.watchdog is not None:
            self.watchdog.enter(section, step)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """`with ctx.section("validate"): ...` — `enter(name)`, and back to the step afterwards."""
        self.enter(name)
        try:
            yield
        finally:
            self.enter("step")

    def step_boundary(self, step: int, save: Callable[[], int | None], device: Any = None) -> None:
        """Call at every step boundary (all ranks; `device`: where the collective runs, e.g. the GPU).

        Returns at once unless a signal reached any rank; then every rank calls `save()` for `step`
        (it may return the step it actually saved), rank 0 settles and records what happens to the
        job, and every rank exits (RequeueExit)."""
        if self.env.rank == 0 and self.start_step is not None and step == self.start_step + 1:
            self.events.write("first_step", segment=self.segment, step=step, job_id=self.env.job_id,
                              seconds=round(time.time() - self.began, 3))  # start-up, restore and compilation
        self.step = step
        self.enter("step", step)
        reason = self.should_stop(device)
        if reason:
            saved = save()
            self.requeue_after_save(step if saved is None else saved, reason)

    def should_stop(self, device: Any = None) -> str | None:
        """Collective: the stop reason if a signal reached any rank, else None (`step_boundary` uses it)."""
        self.stop.polled = True
        return _CODE_REASONS[self._agreement.exchange(_REASON_CODES[self.stop.reason], device)]

    def requeue_after_save(self, step: int, reason: str) -> None:
        """After every rank saved `step`: rank 0 settles and records what happens to the job; all ranks
        exit."""
        saved_at = time.time()
        self.stop.saved_step = step
        code = 0
        if self.env.rank == 0:
            since = self.stop.signal_time or saved_at
            fields = {"segment": self.segment, "step": step, "signal_to_saved_s": round(saved_at - since, 3),
                      "job_id": self.env.job_id}
            outcome = self.backend.settle(self.env.job_id, self.env.restart_count, reason,
                                          self.stop.deadline() - SETTLE_MARGIN_S)
            event, fields = outcome.event, {**fields, **outcome.fields}
            self.events.write(event, **fields)
            code = self.exit_code(event)
            if event == "requeue_failed":
                print(f"error: saved step {step}, but job {self.env.job_id} could not be requeued: "
                      f"{fields['error']}; {fields['fix']}; resume with "
                      f"`{command('submit')} --name {self.run_dir.name}` and the same "
                      "flags", file=sys.stderr, flush=True)
            else:
                outcome = {"requeue": f"requeued ({fields['reason']}, by {fields.get('by')})",
                           "cancelled": "the job was cancelled: submit the run name again to resume",
                           "exited_for_restart": f"exiting ({fields['reason']}) "
                                                 "for the platform to restart",
                           "step_ended": f"the job step ended ({fields['reason']}): the job starts its "
                                         "ranks again"}[event]
                print(f"[taehv] rank 0: saved step {step}; {outcome}", flush=True)
        else:
            print(f"[taehv] rank {self.env.rank}: saved step {step}, exiting ({reason})", flush=True)
        self.stop.exit_code = code
        raise RequeueExit(code)

    def finished(self, step: int) -> None:
        self.stop.disarm()
        if self.env.rank == 0:
            self.events.write("finished", segment=self.segment, step=step, job_id=self.env.job_id)

    def exit_code(self, event: str) -> int:
        """How every rank exits after `event`: non-zero where the job must end FAILED; the backend's
        requeue code where its controller restarts ranks by their exit code. On Slurm every rank exits 0
        otherwise: srun's --kill-on-bad-exit must not cut a slower rank's save short."""
        if event == "requeue_failed":
            return REQUEUE_FAILED_EXIT_CODE
        return self.backend.requeue_exit_code if event == "requeue" else 0
