"""Checkpoint-requeue: a preempted or timed-out job saves on every rank and continues by itself.

Protocol (one agreed flag, no collectives inside a signal handler):

1. `RequeueableTask.__call__` installs handlers for USR2 (Slurm's `--signal` before the time limit →
   "timeout") and SIGTERM (preemption, `scontrol requeue`, `scancel` → "preempted"), and replays the
   signals the entry point held while the task was starting. A handler only records the reason and
   arms a watchdog that ends the process if it cannot exit in time.
2. The training loop calls `ctx.should_stop()` at every step boundary: one all-reduce (MAX) of the
   local flag, so every rank learns of a signal that reached any rank at the same step.
3. All ranks save that step, then `ctx.requeue_after_save()` writes the requeue event and, for a
   timeout, rank 0 requeues the job (Slurm requeues preempted jobs itself); every rank exits cleanly.

The events file (`events.jsonl` in the run folder) records each start, requeue (reason, step, seconds
from signal to saved, seconds lost), failure and stop. It is also what the guards read: at most
`max_requeues` restarts, and a run whose last restarts all began at the same step stops with a reason.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from . import startup_signals
from .checkpoint import Checkpointer
from .distenv import DistEnv
from .security import make_private_dir

LOCAL_REQUEUE_EXIT_CODE = 144  # submitit's local controller restarts the tasks on this exit code
_REASON_CODES = {None: 0, "preempted": 1, "timeout": 2}
_CODE_REASONS = {v: k for k, v in _REASON_CODES.items()}


class RequeueExit(SystemExit):
    """Raised on every rank after the state is saved: ends the process without a result (submitit
    then leaves the job to its requeue) — never caught as an ordinary exception."""


class StopRequested(RuntimeError):
    """The run must not continue (requeue limits); the message is the reason."""


class EventLog:
    """Append-only JSON lines; each line is one event dict with `event` and `time`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "time": time.time(), **fields}, default=str)
        # Owner-only, or group-readable where the cluster config shares runs with a group.
        mode = 0o640 if os.environ.get("TAEHV_SHARED_GROUP") else 0o600
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
        try:
            os.write(fd, (line + "\n").encode())  # one write of one line: appends do not interleave
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill mid-write: skip it
                continue
        return events


class StopFlag:
    """Set from a signal handler; read at step boundaries."""

    def __init__(self, grace_s: dict[str, float]) -> None:
        self.reason: str | None = None
        self.signal_time: float | None = None
        self.exit_code = 0
        self._grace_s = grace_s
        self._watchdog: threading.Timer | None = None

    def handle(self, signum: int, _frame: Any = None) -> None:
        self.record(signum, time.time())

    def record(self, signum: int, at: float) -> None:
        """A signal that arrived at time `at` (now, or while the task was starting)."""
        reason = "timeout" if signum == signal.SIGUSR2 else "preempted"
        if self.reason is None or _REASON_CODES[reason] > _REASON_CODES[self.reason]:
            self.reason = reason
        if self.signal_time is None:
            self.signal_time = at
            print(f"[taehv] caught {signal.Signals(signum).name} on {socket.gethostname()}: "
                  f"saving at the next step boundary ({reason})", flush=True)
            # If a peer died and a collective hangs, the save never comes: leave before SIGKILL does.
            self._watchdog = threading.Timer(max(0.0, self._grace_s[reason] - (time.time() - at)), self._give_up)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _give_up(self) -> None:
        print(f"[taehv] could not save and exit within {self._grace_s[self.reason or 'preempted']:.0f} s "
              "of the signal; exiting without saving (the last checkpoint is intact)", flush=True)
        sys.stdout.flush()
        os._exit(self.exit_code or 1)

    def disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()


class RunContext:
    """What the training loop needs from the requeue machinery; passed to the task."""

    def __init__(self, run_dir: Path, env: DistEnv, stop: StopFlag, segment: int, backend: str) -> None:
        self.run_dir = run_dir
        self.env = env
        self.stop = stop
        self.segment = segment
        self.backend = backend
        self.events = EventLog(run_dir / "events.jsonl")
        self.start_step: int | None = None
        self.start_time = time.time()
        self.step = 0

    @classmethod
    def standalone(cls, run_dir: str | os.PathLike) -> RunContext:
        """A context for a task called directly (no submitit): no signal handling, same files."""
        return cls(make_private_dir(run_dir), DistEnv.from_environ(), StopFlag({"timeout": 60.0, "preempted": 25.0}), 0, "direct")

    def started(self, step: int, **info: Any) -> None:
        """Call once the state is loaded (all ranks): marks the segment's start step."""
        self.start_step = self.step = step
        self.start_time = time.time()
        if self.env.rank == 0:
            self.events.write("start", segment=self.segment, step=step, job_id=self.env.job_id,
                              restart_count=self.env.restart_count, world_size=self.env.world_size,
                              host=socket.gethostname(), **info)

    def should_stop(self, device: Any = None) -> str | None:
        """Collective: the stop reason if a signal reached any rank, else None. Call at every step boundary."""
        import torch
        import torch.distributed as dist

        code = _REASON_CODES[self.stop.reason]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([code], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return _CODE_REASONS[code]

    def requeue_after_save(self, step: int, reason: str, saved_at: float | None = None) -> None:
        """After every rank saved `step`: record the requeue, requeue (timeouts) and exit all ranks."""
        saved_at = saved_at or time.time()
        self.stop.exit_code = self._exit_code(reason)
        if self.env.rank == 0:
            since = self.stop.signal_time or saved_at
            self.events.write("requeue", segment=self.segment, reason=reason, step=step,
                              signal_to_saved_s=round(saved_at - since, 3), seconds_lost=0.0)
            if reason == "timeout":
                self._requeue()
        print(f"[taehv] rank {self.env.rank}: saved step {step}, exiting for requeue ({reason})", flush=True)
        raise RequeueExit(self.stop.exit_code)

    def finished(self, step: int) -> None:
        self.stop.disarm()
        if self.env.rank == 0:
            self.events.write("finished", segment=self.segment, step=step)

    def _exit_code(self, reason: str) -> int:
        # The local controller restarts the tasks only when one exits with its requeue code. On Slurm
        # every rank exits 0: srun's --kill-on-bad-exit must not cut a slower rank's save short.
        return LOCAL_REQUEUE_EXIT_CODE if self.backend == "local" and self.env.rank == 0 else 0

    def _requeue(self) -> None:
        if self.backend == "slurm":
            job_id = submitit.JobEnvironment().job_id
            result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
            if result.returncode != 0:
                print(f"[taehv] scontrol requeue {job_id} failed: {result.stderr.strip()}", flush=True)


class RequeueableTask(submitit.helpers.Checkpointable):
    """Wrap a training callable `task(ctx: RunContext)` so it saves and requeues on signals.

    run_dir holds `events.jsonl` and `checkpoints/` (the task saves there; the guards read it).
    """

    def __init__(self, task: Callable[[RunContext], Any], run_dir: str | os.PathLike, max_requeues: int = 20,
                 max_requeues_without_progress: int = 2, requeue_on_failure: bool = True,
                 signal_delay_s: int = 120, kill_wait_s: int = 30) -> None:
        self.task = task
        self.run_dir = str(run_dir)
        self.max_requeues = max_requeues
        self.max_requeues_without_progress = max_requeues_without_progress
        self.requeue_on_failure = requeue_on_failure
        # Time a rank may take from the signal to its exit before the watchdog ends it.
        self.grace_s = {"timeout": max(10.0, signal_delay_s - 10.0), "preempted": max(5.0, kill_wait_s - 5.0)}

    def __call__(self) -> Any:
        stop = StopFlag(self.grace_s)
        for signum in startup_signals.WATCHED:
            signal.signal(signum, stop.handle)
        for signum, at in startup_signals.take():
            stop.record(signum, at)
        run_dir = make_private_dir(self.run_dir, os.environ.get("TAEHV_SHARED_GROUP") or None)  # launched directly too
        env = DistEnv.from_environ()
        backend = os.environ.get("SUBMITIT_EXECUTOR", "debug")
        events = EventLog(run_dir / "events.jsonl")
        history = events.read()  # read before any rank of this segment writes (rank 0 writes after rendezvous)
        segment = sum(1 for e in history if e["event"] == "start")
        reason = self._refuse_reason(history, run_dir, env.job_id)
        if reason:
            if env.rank == 0:
                events.write("stopped", segment=segment, reason=reason, job_id=env.job_id)
            print(f"[taehv] not starting: {reason}", flush=True)
            raise StopRequested(reason)
        ctx = RunContext(run_dir, env, stop, segment, backend)
        try:
            result = self.task(ctx)
        except RequeueExit:
            raise
        except Exception as err:
            self._on_failure(ctx, err)
            raise
        stop.disarm()
        # Finished: a time-limit warning or preemption arriving now has nothing left to save. Python
        # restores the default action (terminate) as it shuts down, and Slurm would record a completed
        # run as FAILED; ignored signals stay ignored through shutdown.
        for signum in startup_signals.WATCHED:
            signal.signal(signum, signal.SIG_IGN)
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        # Reached only when submitit's own handler sees the signal before __call__ installed ours:
        # nothing has trained yet, so requeueing the same task loses nothing.
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def _refuse_reason(self, history: list[dict[str, Any]], run_dir: Path, job_id: str) -> str | None:
        mine = [e for e in history if e.get("job_id", job_id) == job_id or e["event"] != "start"]
        stopped = [e for e in history if e["event"] == "stopped" and e.get("job_id") == job_id]
        if stopped:
            return stopped[-1]["reason"]
        starts = [e for e in mine if e["event"] == "start"]
        if len(starts) > self.max_requeues:
            return f"requeue limit reached: the job started {len(starts)} times (max_requeues={self.max_requeues})"
        return self._no_progress_reason(history, job_id, Checkpointer(run_dir / "checkpoints").latest_step() or 0)

    def _no_progress_reason(self, history: list[dict[str, Any]], job_id: str, now: int) -> str | None:
        """Stop when more than `max_requeues_without_progress` segments in a row of this job began at
        step `now` and ended (failure or timeout, not preemption) without a later checkpoint."""
        stuck = 0
        for start in reversed([e for e in history if e["event"] == "start" and e.get("job_id") == job_id]):
            ends = [e for e in history if e.get("segment") == start["segment"] and e["event"] == "requeue"]
            if start["step"] != now or any(e["reason"] == "preempted" for e in ends):
                break
            stuck += 1
        if stuck <= self.max_requeues_without_progress:
            return None
        errors = [e for e in history if e["event"] == "failure"]
        last = f"; last error: {errors[-1]['error']}" if errors else ""
        return (f"no progress: {stuck} starts in a row began at step {now} and ended without saving a later "
                f"step (max_requeues_without_progress={self.max_requeues_without_progress}){last}")

    def _on_failure(self, ctx: RunContext, err: Exception) -> None:
        error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        ctx.events.write("failure", segment=ctx.segment, rank=ctx.env.rank, step=ctx.step, error=error,
                         host=socket.gethostname())
        traceback.print_exc()
        if not (self.requeue_on_failure and ctx.start_step is not None):
            return  # failed before training started (bad config, data, environment): requeueing cannot help
        claim = ctx.run_dir / f".requeue-claim-{ctx.segment}"
        try:  # exactly one failing rank requeues this segment
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            raise RequeueExit(ctx._exit_code("failure")) from None
        # The same guards a restart would apply, now, so a hopeless job is not requeued just to stop.
        stop_reason = self._refuse_reason(ctx.events.read(), ctx.run_dir, ctx.env.job_id)
        if stop_reason:
            ctx.events.write("stopped", segment=ctx.segment, reason=stop_reason, job_id=ctx.env.job_id)
            print(f"[taehv] not requeueing: {stop_reason}", flush=True)
            raise StopRequested(stop_reason) from err
        saved = Checkpointer(ctx.run_dir / "checkpoints").read_meta()
        lost = time.time() - max(saved["saved_at"] if saved else 0.0, ctx.start_time)
        ctx.events.write("requeue", segment=ctx.segment, reason="failure", step=saved["step"] if saved else 0,
                         failed_at_step=ctx.step, signal_to_saved_s=None, seconds_lost=round(lost, 1))
        if ctx.backend == "local":
            os.kill(os.getppid(), signal.SIGTERM)  # the controller forwards it: siblings save or exit
        ctx._requeue()
        raise RequeueExit(LOCAL_REQUEUE_EXIT_CODE if ctx.backend == "local" else 0) from None
