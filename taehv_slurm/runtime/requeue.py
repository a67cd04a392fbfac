"""Checkpoint-requeue: a preempted or timed-out job saves on every rank and continues by itself.

`RequeueableTask.__call__` (on every rank) installs handlers for USR2 (Slurm's time-limit warning) and
SIGTERM (preemption, `scontrol requeue`, `scancel`, or the time limit itself where no warning comes),
replays signals that arrived while the task was starting (taehv_slurm.runtime.signals), takes the run
folder's lock (one job per run), applies the guards, and runs the task with its `RunContext`
(taehv_slurm.runtime.context: the save at a signal and what happens to the job after it).

Guards, read from the events at each start: at most `max_requeues` restarts, and a run whose last
restarts all began at the same step stops with a reason (`stopped`). A rank that crashes mid-training
requeues the job where the backend can (once per restart, by an exclusive claim file), after the same
guards. The grace each signal gets comes from the cluster config (`grace_seconds`).
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from taehv_slurm.messages import one_line
from taehv_slurm.runtime import signals
from taehv_slurm.runtime.backend import RankBackend
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.runtime.context import RequeueExit, RunContext, StopFlag, grace_seconds
from taehv_slurm.runtime.distenv import DistEnv
from taehv_slurm.runtime.runfiles import EventLog
from taehv_slurm.runtime.runlock import RunLock
from taehv_slurm.security import make_private_dir


class ReportedError(RuntimeError):
    """A failure this rank already reported (its event recorded, one line or the traceback printed): the
    entry point exits 1 without printing it again."""


class TaskFailedError(ReportedError):
    """The task raised; the failure is recorded in events.jsonl and its traceback is in the rank's log."""


class StopRequested(ReportedError):
    """The run must not continue (requeue limits); the message is the reason."""


class RequeueImpossibleError(ReportedError):
    """The job could never requeue itself (no scontrol where it starts); the message names the fix."""


class NotRequeueableError(TypeError):
    """A callable submitted as requeueable cannot take the run context; the message says what to write."""


def check_takes_context(task: Callable[..., Any]) -> None:
    """Refuse, in one line, a callable that cannot be called with its RunContext (it could never save)."""
    if isinstance(task, RequeueableTask):
        return
    name = getattr(task, "__qualname__", None) or type(task).__qualname__
    try:
        signature = inspect.signature(task)
    except (TypeError, ValueError):  # a builtin without a signature: let it try
        return
    try:
        signature.bind(None)
    except TypeError:
        raise NotRequeueableError(
            f"task {name}{signature} cannot be called with its run context, so it could never save at a "
            f"signal: define it as `def {name.split('.')[-1]}(ctx)` and call "
            "`ctx.step_boundary(step, save)` at each step "
            "(see taehv_slurm.runtime.context), or submit it with requeueable=False"
        ) from None


class RequeueableTask(submitit.helpers.Checkpointable):
    """Wrap a task `task(ctx: RunContext)` so it saves and requeues on signals (see the module docstring).

    run_dir holds `events.jsonl`, the lock and `checkpoints/` (the task saves there; the guards read it).
    """

    def __init__(self, task: Callable[[RunContext], Any], run_dir: str | os.PathLike, max_requeues: int = 20,
                 max_requeues_without_progress: int = 2, requeue_on_failure: bool = True,
                 signal_delay_s: int = 120, kill_wait_s: int = 30,
                 backend: RankBackend | None = None) -> None:
        check_takes_context(task)
        self.task = task
        self.backend = backend or RankBackend()
        self.run_dir = str(run_dir)
        self.max_requeues = max_requeues
        self.max_requeues_without_progress = max_requeues_without_progress
        self.requeue_on_failure = requeue_on_failure
        self.grace_s = grace_seconds(signal_delay_s, kill_wait_s)

    def __call__(self) -> Any:
        stop = StopFlag(self.grace_s)
        for signum in signals.WATCHED:
            signal.signal(signum, stop.handle)
        for signum, at in signals.take():
            stop.record(signum, at)
        # launched directly too
        run_dir = make_private_dir(self.run_dir, os.environ.get("TAEHV_SHARED_GROUP") or None)
        env = DistEnv.from_environ()
        events = EventLog(run_dir / "events.jsonl")
        missing = self.backend.cannot_requeue_reason(socket.gethostname()) if env.rank == 0 else None
        if missing:
            events.write("failure", segment=None, rank=0, step=None,
                         error=f"RequeueImpossibleError: {missing}",
                         job_id=env.job_id, host=socket.gethostname())
            print(f"[taehv] {missing}", flush=True)
            raise RequeueImpossibleError(missing)
        lock = RunLock(run_dir, env.job_id, self.backend)
        if env.rank == 0:
            lock.acquire()  # refuses when another live job trains this folder
        # read before any rank of this segment writes (rank 0 writes after rendezvous)
        history = events.read()
        segment = sum(1 for e in history if e["event"] == "start")
        reason = self._refuse_reason(history, run_dir, env.job_id)
        if reason:
            if env.rank == 0:
                events.write("stopped", segment=segment, reason=reason, job_id=env.job_id)
            print(f"[taehv] not starting: {reason}", flush=True)
            raise StopRequested(reason)
        ctx = RunContext(run_dir, env, stop, segment, self.backend)
        if env.rank == 0:
            stop.on_give_up = lambda why: ctx.events.write("failure", segment=segment, rank=0, step=ctx.step,
                                                           error=why, job_id=env.job_id,
                                                           host=socket.gethostname())
        try:
            result = self.task(ctx)
        except (RequeueExit, ReportedError):
            raise
        except Exception as err:
            self._on_failure(ctx, err)
            raise TaskFailedError(one_line(err)) from err
        stop.disarm()
        # Finished: a time-limit warning or preemption arriving now has nothing left to save. Python
        # restores the default action (terminate) as it shuts down, and Slurm would record a completed
        # run as FAILED; ignored signals stay ignored through shutdown.
        for signum in signals.WATCHED:
            signal.signal(signum, signal.SIG_IGN)
        if env.rank == 0:
            lock.release()
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
            return (f"requeue limit reached: the job started {len(starts)} times "
                    f"(max_requeues={self.max_requeues})")
        return self._no_progress_reason(history, job_id,
                                        Checkpointer(run_dir / "checkpoints").latest_step() or 0)

    def _no_progress_reason(self, history: list[dict[str, Any]], job_id: str, now: int) -> str | None:
        """Stop when more than `max_requeues_without_progress` segments in a row of this job began at
        step `now` and ended (failure, timeout, a task that could not save) without a later checkpoint;
        a segment that Slurm preempted does not count."""
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
        error = one_line(err)
        ctx.events.write("failure", segment=ctx.segment, rank=ctx.env.rank, step=ctx.step, error=error,
                         job_id=ctx.env.job_id, host=socket.gethostname())
        traceback.print_exc()
        if not (self.requeue_on_failure and ctx.start_step is not None
                and self.backend.restarts_after_failure):
            return  # failed before training started (bad config, data, environment): requeueing cannot help
        claim = ctx.run_dir / f".requeue-claim-{ctx.env.job_id}-{ctx.segment}"
        try:  # exactly one failing rank requeues this segment
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            # another rank requeues: leave quietly, so the job is not ended before it does
            raise RequeueExit(self.backend.requeue_exit_code) from None
        # The same guards a restart would apply, now, so a hopeless job is not requeued just to stop.
        stop_reason = self._refuse_reason(ctx.events.read(), ctx.run_dir, ctx.env.job_id)
        if stop_reason:
            ctx.events.write("stopped", segment=ctx.segment, reason=stop_reason, job_id=ctx.env.job_id)
            print(f"[taehv] not requeueing: {stop_reason}", flush=True)
            raise StopRequested(stop_reason) from err
        saved = Checkpointer(ctx.run_dir / "checkpoints").read_meta()
        lost = round(time.time() - max(saved["saved_at"] if saved else 0.0, ctx.start_time), 1)
        fields = {"segment": ctx.segment, "reason": "failure", "step": saved["step"] if saved else 0,
                  "failed_at_step": ctx.step, "signal_to_saved_s": None, "seconds_lost": lost,
                  "job_id": ctx.env.job_id}
        outcome = self.backend.requeue_after_failure(ctx.env.job_id)
        ctx.events.write(outcome.event, **fields, **outcome.fields)
        if outcome.event == "requeue":
            raise RequeueExit(self.backend.requeue_exit_code) from None
        # requeue_failed: the error stands, the job ends FAILED
