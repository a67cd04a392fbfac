"""Checkpoint-requeue: a preempted or timed-out job saves on every rank and continues by itself.

`RequeueableTask.__call__` (on every rank) installs handlers for USR2 (Slurm's time-limit warning) and
SIGTERM (preemption, `scontrol requeue`, `scancel`, or the time limit itself where no warning comes),
replays signals that arrived while the task was starting (taehv_slurm.runtime.signals), takes the run
folder's lock (one job per run), applies the guards, and runs the task with its `RunContext`
(taehv_slurm.runtime.context: the save at a signal and what happens to the job after it).

The guards (taehv_slurm.runtime.guards), read from the events at each start and before any restart or
requeue: the requeue limit, no progress, and a failure that repeats. A task's `FatalTaskError` (a diverged
run) never restarts. Each rank keeps its record in the run folder (taehv_slurm.runtime.ranks), and once
every rank has ended, `after_ranks` — run where the ranks were started from (the sbatch script after srun,
or the local controller) — names the ranks that were killed from outside. Where the sbatch script restarts
the ranks inside the allocation (taehv_slurm.runtime.steps), a rank that crashes or finds a
hang records it and ends the job step, and `after_ranks` decides what follows (taehv_slurm.runtime.restart);
elsewhere a rank that crashes mid-training requeues the job where the backend can (once per restart, by an
exclusive claim file), a hang's verdict requeues it without the culprit's node, and `after_ranks` requeues
without the killed ranks' nodes. The grace each signal gets comes from the cluster config (`grace_seconds`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from taehv_slurm.common.messages import one_line
from taehv_slurm.common.runfolder import EventLog, RunFolder
from taehv_slurm.common.security import make_private_dir
from taehv_slurm.runtime import collector, signals
from taehv_slurm.runtime.checkpoint import Checkpointer
from taehv_slurm.runtime.context import FatalTaskError, RequeueExit, RunContext, StopFlag, grace_seconds
from taehv_slurm.runtime.distenv import DistEnv, attempt_of_environ
from taehv_slurm.runtime.guards import Guards, is_communication_error, leaves_its_node_out
from taehv_slurm.runtime.rank_backend import RankBackend
from taehv_slurm.runtime.ranks import RankFile, describe_ranks, killed_ranks, node_name, read_ranks
from taehv_slurm.runtime.runlock import RunLock
from taehv_slurm.runtime.steps import FOLLOW_UP_EXIT_CODE, handed_over, in_step_loop, launch_number
from taehv_slurm.runtime.tasks import TaskRef
from taehv_slurm.runtime.watchdog import Verdict, Watchdog, WatchdogSettings

SIGNAL_NOTES = {signal.SIGKILL: " (often the kernel's out-of-memory killer, or a node being taken away)",
                signal.SIGBUS: " (a hardware or memory-mapping error on that node)"}


class ReportedError(RuntimeError):
    """A failure this rank already reported (its event recorded, one line or the traceback printed): the
    entry point exits 1 without printing it again."""


class TaskFailedError(ReportedError):
    """The task raised; the failure is recorded in the run's events and its traceback is in the rank's log."""


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

    run_dir holds the run's events, the lock, the ranks' records and `checkpoints/` (the task saves there;
    the guards read it). backend: where the job runs (taehv_slurm.backends; `submit()` passes it).
    exclude_failed_nodes: a node whose rank was killed, hung, or hit a hardware error is left out of the
    job's next attempts, where the backend can (Slurm's ExcNodeList). watchdog: how every rank's watchdog
    tells a hang from a slow step (taehv_slurm.runtime.watchdog).
    """

    def __init__(self, task: Callable[[RunContext], Any], run_dir: str | os.PathLike, *,
                 max_requeues: int = 20, max_requeues_without_progress: int = 2,
                 requeue_on_failure: bool = True, signal_delay_s: int = 120, kill_wait_s: int = 30,
                 backend: RankBackend | None = None, exclude_failed_nodes: bool = True,
                 watchdog: WatchdogSettings | None = None) -> None:
        check_takes_context(task)
        self.task = task
        self.backend = backend or RankBackend()
        self.run_dir = str(run_dir)
        self.guards = Guards(max_requeues, max_requeues_without_progress)
        self.requeue_on_failure = requeue_on_failure
        self.exclude_failed_nodes = exclude_failed_nodes
        self.watchdog = watchdog or WatchdogSettings()
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
        record = RankFile(run_dir, env.job_id, env.restart_count, env.rank, env.world_size, launch_number())
        watchdog = Watchdog(run_dir, record, self.watchdog, on_hang=lambda verdict, bundle: None)
        watchdog.start()
        try:
            return self._run(run_dir, env, stop, watchdog)
        except RequeueExit as leaving:
            watchdog.stop(int(leaving.code or 0))
            raise
        except BaseException:
            watchdog.stop(1)
            raise

    def _run(self, run_dir: Path, env: DistEnv, stop: StopFlag, watchdog: Watchdog) -> Any:
        events = RunFolder(run_dir).events()
        missing = self.backend.cannot_requeue_reason(socket.gethostname()) if env.rank == 0 else None
        if missing:
            events.write("failure", segment=None, rank=0, step=None,
                         error=f"RequeueImpossibleError: {missing}",
                         job_id=env.job_id, host=node_name())
            print(f"[taehv] {missing}", flush=True)
            raise RequeueImpossibleError(missing)
        lock = RunLock(run_dir, env.job_id, self.backend)
        if env.rank == 0:
            lock.acquire()  # refuses when another live job trains this folder
        # read before any rank of this segment writes (rank 0 writes after rendezvous)
        history = events.read()
        if env.rank == 0 and (noted := self._note_unrecorded_requeue(events, history, env, run_dir)):
            history.append(noted)
        segment = sum(1 for e in history if e["event"] == "start")
        reason = self.guards.refuse_reason(history, env.job_id, self._saved_step(run_dir))
        if reason:
            if env.rank == 0:
                events.write("stopped", segment=segment, reason=reason, job_id=env.job_id)
            print(f"[taehv] not starting: {reason}", flush=True)
            raise StopRequested(reason)
        # hang_detection off: no thread, and the main thread marks no sections (the A/B of its cost)
        ctx = RunContext(run_dir, env, stop, segment, self.backend,
                         watchdog if self.watchdog.enabled else None)
        watchdog.on_hang = functools.partial(self._on_hang, ctx)
        if env.rank == 0:
            stop.on_give_up = lambda why: ctx.events.write("failure", segment=segment, rank=0, step=ctx.step,
                                                           error=why, job_id=env.job_id, host=node_name())
        if not isinstance(self.task, TaskRef):  # ours say when their start is over: `ctx.started`
            collector.resume()  # a user's own callable
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
        watchdog.stop(0)
        if env.rank == 0:
            lock.release()
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        # Reached only when submitit's own handler sees the signal before __call__ installed ours:
        # nothing has trained yet, so requeueing the same task loses nothing.
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    @staticmethod
    def _saved_step(run_dir: Path) -> int:
        return Checkpointer(RunFolder(run_dir).checkpoints).latest_step() or 0

    def stop_reason(self, events: EventLog, run_dir: Path, job_id: str, segment: int | None) -> str | None:
        """The guards a restart or requeue would apply (so a hopeless job is not restarted just to stop):
        why the run must not go on (the `stopped` event recorded), else None."""
        reason = self.guards.refuse_reason(events.read(), job_id, self._saved_step(run_dir))
        if reason:
            events.write("stopped", segment=segment, reason=reason, job_id=job_id)
            print(f"[taehv] not requeueing: {reason}", flush=True)
        return reason

    def _note_unrecorded_requeue(self, events: EventLog, history: list[dict[str, Any]], env: DistEnv,
                                 run_dir: Path) -> dict[str, Any] | None:
        """Where Slurm requeued this job while nothing could record it (its node failed, and the batch script
        with it: NODE_FAIL), record it now, as the end of the attempt it ended, with the state Slurm's
        accounting gives that allocation (`reason`: NODE_FAIL → node_fail; `unrecorded` without one).
        Returns the record written, None where nothing was missed."""
        missed = unrecorded_requeue(history, env.job_id, env.restart_count)
        if missed is None:
            return None
        state = self.backend.allocation_state(env.job_id, env.restart_count - 1)
        step = self._saved_step(run_dir)
        record = {"event": "requeue", "time": missed["time"], "segment": missed["segment"],
                  "reason": (state or "unrecorded").lower(), "step": step, "failed_at_step": None,
                  "signal_to_saved_s": None, "seconds_lost": None, "job_id": env.job_id, "by": "slurm",
                  "noted_at_start": True}
        events.append(record)
        print(f"[taehv] Slurm requeued job {env.job_id} ({state or 'its accounting does not say why'}) while "
              f"nothing could record it: resuming from step {step}", flush=True)
        return record

    def _on_lasting_failure(self, ctx: RunContext, error: str) -> None:
        """A failure no restart mends (a full disk, a read-only run folder), met by this rank alone: recorded
        as the run's end, and the step ended so that the other ranks do not wait for it in a collective. Where
        not even that line can be written, it still reaches the rank's log."""
        ends_step = self.restarts_here()
        try:
            ctx.events.write("failure", segment=ctx.segment, rank=ctx.env.rank, step=ctx.step, error=error,
                             fatal=True, job_id=ctx.env.job_id, host=node_name(),
                             **({"ends_step": True} if ends_step else {}))
        except OSError as unwritten:
            error += f" (not recorded in {ctx.events.path}: {unwritten.strerror})"
        _say(f"[taehv] rank {ctx.env.rank}: {error}")
        if ends_step:
            self.backend.end_step()

    def _on_failure(self, ctx: RunContext, err: Exception) -> None:
        error = one_line(err)
        if isinstance(err, FatalTaskError):  # the same on every rank: rank 0 records it, in one line
            if ctx.env.rank == 0:
                ctx.events.write("failure", segment=ctx.segment, rank=0, step=ctx.step, error=error,
                                 fatal=True, job_id=ctx.env.job_id, host=node_name())
            print(f"[taehv] rank {ctx.env.rank}: {error}", flush=True)
            return
        checkpoints = Checkpointer(RunFolder(ctx.run_dir).checkpoints)  # where the job folder is
        if (lasting := checkpoints.lasting_failure(err)) is not None:
            self._on_lasting_failure(ctx, lasting)
            return
        settled = [e for e in ctx.events.read() if e.get("job_id") == ctx.env.job_id
                   and e.get("segment") == ctx.segment
                   and (e["event"] in ("requeue", "hang", "cancelled") or e.get("fatal"))]
        if settled:  # the job is already being restarted or ended: this failure is its echo (a lost peer)
            print(f"[taehv] rank {ctx.env.rank}: {error} (after the job's {settled[-1]['event']}: leaving)",
                  flush=True)
            if settled[-1].get("fatal"):
                return  # a peer's failure ended the run: nothing to requeue
            raise RequeueExit(self.backend.requeue_exit_code) from None
        restartable = (self.requeue_on_failure and ctx.start_step is not None
                       and self.backend.restarts_after_failure)
        # Where the batch script restarts the ranks, this rank ends the job step at once, unless its error is
        # the echo of a peer that died (a lost connection): then the peer's own end names the cause.
        ends_step = restartable and self.restarts_here() and not is_communication_error(error)
        marks = {"ends_step": True} if ends_step else {}
        if checkpoints.on_a_nodes_disk(err):
            marks["node_fault"] = True
        ctx.events.write("failure", segment=ctx.segment, rank=ctx.env.rank, step=ctx.step, error=error,
                         job_id=ctx.env.job_id, host=node_name(), **marks)
        traceback.print_exc()
        if not restartable:
            return  # failed before training started (bad config, data, environment): requeueing cannot help
        if self.restarts_here():
            if ends_step:
                sys.stdout.flush()
                self.backend.end_step()
            return  # the batch script decides what follows (taehv_slurm.runtime.steps)
        claim = ctx.run_dir / f".requeue-claim-{ctx.env.job_id}-{ctx.segment}"
        try:  # exactly one failing rank requeues this segment
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            # another rank requeues: leave quietly, so the job is not ended before it does
            raise RequeueExit(self.backend.requeue_exit_code) from None
        its_node = self.exclude_failed_nodes and leaves_its_node_out({**marks, "error": error})
        exclude = [node_name()] if its_node else []
        event = self._requeue_or_stop(ctx.events, ctx.run_dir, ctx.env.job_id, ctx.segment, "failure",
                                      ctx.step, exclude, since=ctx.start_time)
        if event == "stopped":
            raise StopRequested([e for e in ctx.events.read() if e["event"] == "stopped"][-1]["reason"])
        if event == "requeue":
            raise RequeueExit(self.backend.requeue_exit_code)
        # requeue_failed: the error stands, the job ends FAILED

    def _requeue_or_stop(self, events: EventLog, run_dir: Path, job_id: str, segment: int | None, reason: str,
                         failed_at: int | None, exclude: list[str], since: float) -> str:
        """After a failure: the guards a restart would apply (so a hopeless job is not requeued just to stop),
        then the backend's requeue (without the `exclude` nodes). Returns the event recorded."""
        if self.stop_reason(events, run_dir, job_id, segment):
            return "stopped"
        saved = Checkpointer(RunFolder(run_dir).checkpoints).read_meta()
        lost = round(time.time() - max(saved["saved_at"] if saved else 0.0, since), 1)
        fields = {"segment": segment, "reason": reason, "step": saved["step"] if saved else 0,
                  "failed_at_step": failed_at, "signal_to_saved_s": None, "seconds_lost": lost,
                  "job_id": job_id}
        outcome = self.backend.requeue_after_failure(job_id, exclude)
        events.write(outcome.event, **fields, **outcome.fields)
        return outcome.event

    def _on_hang(self, ctx: RunContext, verdict: Verdict, bundle: Path) -> None:
        """On the watchdog thread of the rank that found a hang: record the verdict, restart the job without
        the culprits' nodes (where the backend can), and end this rank (its main thread is stuck)."""
        step = min((int(r["step"] or 0) for r in verdict.culprits), default=ctx.step)
        here = self.restarts_here()
        ctx.events.write("hang", segment=ctx.segment, step=step, ranks=[r["rank"] for r in verdict.culprits],
                         hosts=verdict.hosts, section=verdict.section, detail=verdict.line(),
                         bundle=str(bundle), job_id=ctx.env.job_id, **({"ends_step": True} if here else {}))
        print(f"[taehv] {verdict.line()}; stacks and verdict: {bundle}", flush=True)
        if here:  # the batch script restarts the ranks without the culprits' nodes: end every rank now
            sys.stdout.flush()
            self.backend.end_step()
            os._exit(1)
        exclude = verdict.hosts if self.exclude_failed_nodes else []
        try:
            event = self._requeue_or_stop(ctx.events, ctx.run_dir, ctx.env.job_id, ctx.segment, "hang", step,
                                          exclude, since=ctx.start_time)
        except BaseException as err:  # the rank must end whatever happens here
            print(f"[taehv] could not requeue after the hang: {one_line(err)}", flush=True)
            event = "requeue_failed"
        sys.stdout.flush()
        os._exit(self.backend.requeue_exit_code if event == "requeue" else 1)

    def restarts_here(self) -> bool:
        """After a fault, the batch script starts the ranks again inside the allocation: it loops (the
        cluster's restart_in_allocation; jobs queued by older code loop only where they named a placement)."""
        return in_step_loop()

    # ------------------------------------------------------------------------------ after the ranks
    def after_ranks(self, status: int, last_error: str = "") -> int:
        """`_after_ranks`, except that a run folder the batch script cannot write (the disk full, ...) ends
        the job with one line, not a restart or a requeue that would meet it again."""
        try:
            return self._after_ranks(status, last_error)
        except OSError as err:
            if (line := Checkpointer(RunFolder(self.run_dir).checkpoints).lasting_failure(err)) is None:
                raise
            _say(f"error: {line}")
            return status or 1

    def _after_ranks(self, status: int, last_error: str = "") -> int:
        """Where the ranks were started from, once all ended with `status` (srun's: non-zero when one
        failed, 128 + N when one was killed by signal N): record what the ranks could not — ranks ended
        from outside, a job that died before its task began — and requeue the job off the dead ranks'
        nodes when that can help. `last_error`: the last error line of rank 0's log. Returns `status`, or the
        backend's requeue code when it requeued and the backend restarts ranks by their exit code. Where the
        batch script restarts the ranks inside the allocation, taehv_slurm.runtime.restart decides instead
        (and may return RESTART_EXIT_CODE)."""
        if self.restarts_here():
            from taehv_slurm.runtime.restart import after_step

            return after_step(self, status, last_error)
        if status == 0:
            return 0
        run_dir, (job_id, restart) = Path(self.run_dir), attempt_of_environ()
        events = RunFolder(run_dir).events()
        history, records = events.read(), read_ranks(run_dir, job_id, restart)
        began = min((r["started"] for r in records), default=time.time())
        this_attempt = [e for e in history if e.get("job_id") == job_id and e.get("time", 0) >= began]
        if handed_over(this_attempt):
            return FOLLOW_UP_EXIT_CODE
        if any(e["event"] in ("requeue", "requeue_failed", "cancelled", "stopped", "failure", "hang")
               for e in this_attempt):
            return status  # the ranks said what happened themselves
        starts = [e for e in this_attempt if e["event"] == "start"]
        segment = starts[-1]["segment"] if starts else None
        killed = killed_ranks(records)
        if not killed:  # no rank record, or every rank exited by itself: it died before it could say why
            error = last_error or f"the ranks ended with exit code {status} before the task started"
            events.write("failure", segment=segment, rank=None, step=None, job_id=job_id, error=error)
            return status
        name, detail, step = self.describe_killed(killed, status)
        signum = status - 128 if status > 128 else None
        hosts = sorted({r["host"] for r in killed})
        events.write("killed", segment=segment, ranks=[r["rank"] for r in killed], hosts=hosts, signal=signum,
                     signal_name=name, step=step, detail=detail, job_id=job_id)
        print(f"error: {detail}", flush=True)
        if starts and self.requeue_on_failure and self.backend.restarts_after_failure:
            exclude = hosts if self.exclude_failed_nodes else []
            event = self._requeue_or_stop(events, run_dir, job_id, segment, "killed", step, exclude,
                                          since=began)
            if event == "requeue" and handed_over(events.read()[-1:]):
                return FOLLOW_UP_EXIT_CODE
            if event == "requeue" and self.backend.requeue_exit_code:  # a controller restarts by exit code
                return self.backend.requeue_exit_code
        return status

    @staticmethod
    def describe_killed(killed: list[dict[str, Any]], status: int) -> tuple[str, str, int | None]:
        """(signal name, one line naming the killed ranks, the step) from their records and srun's status."""
        signum = status - 128 if status > 128 else None
        name = signal.Signals(signum).name if signum in signal.valid_signals() else f"exit code {status}"
        step = max((int(r["step"]) for r in killed if r.get("step") is not None), default=None)
        detail = (f"{describe_ranks(killed)} {'were' if len(killed) > 1 else 'was'} killed by {name}"
                  f"{SIGNAL_NOTES.get(signum, '')}" + (f" at step {step}" if step is not None else ""))
        return name, detail, step


def unrecorded_requeue(history: list[dict[str, Any]], job_id: str,
                       restart_count: int) -> dict[str, Any] | None:
    """Where this job's restart count went up since its last start and no requeue was recorded after that
    start (Slurm requeued the job while its batch script could not say so): that attempt's segment and its
    last recorded time; else None."""
    starts = [i for i, e in enumerate(history) if e["event"] == "start" and e.get("job_id") == job_id]
    if not starts or int(history[starts[-1]].get("restart_count") or 0) >= restart_count:
        return None
    since = history[starts[-1]:]
    if any(e["event"] == "requeue" for e in since):
        return None
    return {"segment": since[0]["segment"], "time": max(e["time"] for e in since)}


def _say(line: str) -> None:
    """Print one line to the job's log, which may be on the disk that is full: then the line is lost, not the
    exit status."""
    with contextlib.suppress(OSError):
        print(line, flush=True)
