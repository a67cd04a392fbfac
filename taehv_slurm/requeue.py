"""Checkpoint-requeue: a preempted or timed-out job saves on every rank and continues by itself.

The whole flow, and the one call a task makes:

1. `RequeueableTask.__call__` (on every rank) installs handlers for USR2 (Slurm's time-limit warning)
   and SIGTERM (preemption, `scontrol requeue`, `scancel`, or the time limit itself where no warning
   comes), replays signals that arrived while the task was starting, takes the run folder's lock (one
   job per run), and runs the task with its `RunContext` — also the context a task built inside it
   finds (`RunContext.current()`), so it always writes into the run folder.
2. The task calls `ctx.step_boundary(step, save)` at every step boundary. All ranks agree on the stop
   flag with one all-reduce; when a signal reached any rank, every rank calls `save()` at that step,
   then rank 0 settles what happens to the job and records it in `events.jsonl` as it happened:
     - Slurm is requeueing it already (preemption, `scontrol requeue`: its Restarts went up) → `requeue`;
     - the job was cancelled (`scancel`, `jobs.cancel`) → `cancelled`;
     - otherwise (the time-limit warning, SIGTERM at the time limit, a stray SIGTERM) rank 0 asks
       Slurm to requeue it: `requeue` when Slurm accepted, else `requeue_failed` with Slurm's answer,
       and rank 0 exits non-zero with one line naming the cause, the fix and how to resume, so the
       job ends FAILED instead of COMPLETED part-way.
   The local backend's controller plays Slurm's part (`taehv_slurm.local`). Then every rank exits.
3. A task that does not reach a step boundary within the grace cannot save: the watchdog says so in
   one line, records it, and ends the rank; such a restart counts as no progress.

Guards, read from the events at each start: at most `max_requeues` restarts, and a run whose last
restarts all began at the same step stops with a reason (`stopped`). The grace each signal gets
comes from the cluster config (`grace_seconds`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from . import slurm, startup_signals
from .checkpoint import Checkpointer
from .distenv import DistEnv
from .local import LOCAL_REQUEUE_EXIT_CODE
from .local import job_state as local_job_state
from .messages import one_line
from .runlock import RunLock
from .security import make_private_dir

REQUEUE_FAILED_EXIT_CODE = 3  # saved, but the job could not be requeued: the job must end FAILED
SETTLE_MARGIN_S = 3.0  # of a signal's grace, kept for recording the outcome and exiting
_REASON_CODES = {None: 0, "preempted": 1, "timeout": 2}
_CODE_REASONS = {v: k for k, v in _REASON_CODES.items()}
_CURRENT: RunContext | None = None


def grace_seconds(signal_delay_s: float, kill_wait_s: float) -> dict[str, float]:
    """Seconds a rank may take from a signal to its exit, by reason, before the watchdog ends it: the
    time-limit warning leaves `signal_delay_s` (minus a margin for the requeue itself), SIGTERM leaves
    the site's KillWait (minus a margin for the exit)."""
    return {"timeout": max(10.0, signal_delay_s - 10.0), "preempted": max(5.0, kill_wait_s - 5.0)}


class RequeueExit(SystemExit):
    """Raised on every rank after the state is saved: ends the process without a result (submitit
    then leaves the job to its requeue) — never caught as an ordinary exception."""


class StopRequested(RuntimeError):
    """The run must not continue (requeue limits); the message is the reason."""


class RequeueImpossibleError(RuntimeError):
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
            f"task {name}{signature} cannot be called with its run context, so it could never save at a signal: "
            f"define it as `def {name.split('.')[-1]}(ctx)` and call `ctx.step_boundary(step, save)` at each step "
            "(see taehv_slurm.requeue), or submit it with requeueable=False"
        ) from None


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

    def deadline(self) -> float:
        """When the watchdog ends this rank: the signal's arrival plus its grace."""
        return (self.signal_time or time.time()) + self._grace_s[self.reason or "preempted"]

    def _give_up(self) -> None:
        grace = self._grace_s[self.reason or "preempted"]
        if self.saved_step is not None:
            why = (f"saved step {self.saved_step}, but the requeue was not settled within {grace:.0f} s of the signal; "
                   "exiting (the saved step is kept)")
        elif self.polled:
            why = (f"could not save and exit within {grace:.0f} s of the signal (a peer may have died); exiting "
                   "without saving (the last checkpoint is intact)")
        else:
            why = (f"the task never called ctx.step_boundary (or ctx.should_stop) in the {grace:.0f} s after the "
                   "signal: it cannot save at a signal, so the work since its last own checkpoint is lost; call "
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
    """What a task needs from the requeue machinery; passed to the task (and `RunContext.current()`)."""

    def __init__(self, run_dir: Path, env: DistEnv, stop: StopFlag, segment: int, backend: str) -> None:
        self.run_dir = run_dir
        self.env = env
        self.stop = stop
        self.segment = segment
        self.backend = backend
        self.events = EventLog(run_dir / "events.jsonl")
        self._agreement = _FlagAgreement()
        self.start_step: int | None = None
        self.start_time = time.time()
        self.step = 0

    @classmethod
    def current(cls) -> RunContext | None:
        """The context of the task running under RequeueableTask in this process, if any."""
        return _CURRENT

    @classmethod
    def standalone(cls, run_dir: str | os.PathLike) -> RunContext:
        """A context for a task called directly (no submitit): no signal handling, same files."""
        return cls(make_private_dir(run_dir), DistEnv.from_environ(), StopFlag(grace_seconds(70, 30)), 0, "direct")

    def started(self, step: int, **info: Any) -> None:
        """Call once the state is loaded (all ranks): marks the segment's start step."""
        self.start_step = self.step = step
        self.start_time = time.time()
        if self.env.rank == 0:
            self.events.write("start", segment=self.segment, step=step, job_id=self.env.job_id,
                              restart_count=self.env.restart_count, world_size=self.env.world_size,
                              host=socket.gethostname(), **info)

    def step_boundary(self, step: int, save: Callable[[], int | None], device: Any = None) -> None:
        """Call at every step boundary (all ranks; `device`: where the collective runs, e.g. the GPU).

        Returns at once unless a signal reached any rank; then every rank calls `save()` for `step`
        (it may return the step it actually saved), rank 0 settles and records what happens to the
        job, and every rank exits (RequeueExit)."""
        self.step = step
        reason = self.should_stop(device)
        if reason:
            saved = save()
            self.requeue_after_save(step if saved is None else saved, reason)

    def should_stop(self, device: Any = None) -> str | None:
        """Collective: the stop reason if a signal reached any rank, else None (`step_boundary` uses it)."""
        self.stop.polled = True
        return _CODE_REASONS[self._agreement.exchange(_REASON_CODES[self.stop.reason], device)]

    def requeue_after_save(self, step: int, reason: str) -> None:
        """After every rank saved `step`: rank 0 settles and records what happens to the job; all ranks exit."""
        saved_at = time.time()
        self.stop.saved_step = step
        code = 0
        if self.env.rank == 0:
            since = self.stop.signal_time or saved_at
            fields = {"segment": self.segment, "step": step, "signal_to_saved_s": round(saved_at - since, 3),
                      "job_id": self.env.job_id}
            event, fields = self._settle(reason, fields)
            self.events.write(event, **fields)
            code = self._exit_code(event)
            if event == "requeue_failed":
                print(f"error: saved step {step}, but job {self.env.job_id} could not be requeued: {fields['error']}; "
                      f"{fields['fix']}; resume with `python -m jobs.submit --name {self.run_dir.name}` and the same "
                      "flags", file=sys.stderr, flush=True)
            else:
                outcome = {"requeue": f"requeued ({fields['reason']}, by {fields.get('by')})",
                           "cancelled": "the job was cancelled: submit the run name again to resume",
                           "exited_for_restart": f"exiting ({fields['reason']}) for the platform to restart"}[event]
                print(f"[taehv] rank 0: saved step {step}; {outcome}", flush=True)
        else:
            print(f"[taehv] rank {self.env.rank}: saved step {step}, exiting ({reason})", flush=True)
        self.stop.exit_code = code
        raise RequeueExit(code)

    def finished(self, step: int) -> None:
        self.stop.disarm()
        if self.env.rank == 0:
            self.events.write("finished", segment=self.segment, step=step, job_id=self.env.job_id)

    # ------------------------------------------------------------------------------------------
    def _settle(self, reason: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """(event, fields) for what happened to the job after the save at a signal (rank 0).

        Slurm's commands get what is left of the signal's grace (less a margin for writing the event and
        exiting): an unreachable controller makes scontrol wait for tens of seconds, and the watchdog
        must not end the rank before the outcome is recorded."""
        deadline = self.stop.deadline() - SETTLE_MARGIN_S
        if self.backend == "local":
            state = local_job_state(os.environ.get("SUBMITIT_FOLDER", ""), self.env.job_id)["state"]
            if state == "CANCELLING":
                return "cancelled", {**fields, "reason": "cancelled"}
            return "requeue", {**fields, "reason": reason, "by": "local controller", "seconds_lost": 0.0}
        if self.backend != "slurm":  # a platform restarts the process itself; nothing here can requeue it
            return "exited_for_restart", {**fields, "reason": reason}
        info = slurm.job_info(self.env.job_id, timeout_s=max(1.0, min(15.0, (deadline - time.time()) / 2)))
        if isinstance(info, dict):
            if int(info.get("Restarts") or 0) > self.env.restart_count:
                return "requeue", {**fields, "reason": reason, "by": "slurm", "seconds_lost": 0.0}
            if info.get("Reason") == "TimeLimit":
                reason = "timeout"  # SIGTERM at the time limit: the warning never came (signal_delay_s)
            elif info.get("JobState") in ("COMPLETING", "CANCELLED"):
                return "cancelled", {**fields, "reason": "cancelled"}
        answer = slurm.requeue(self.env.job_id, timeout_s=max(1.0, deadline - time.time()))
        if answer.ok:
            return "requeue", {**fields, "reason": reason, "by": "self", "seconds_lost": 0.0}
        return "requeue_failed", {**fields, "reason": reason, "error": f"scontrol requeue: {answer.error}",
                                  "fix": slurm.requeue_fix(answer.error)}

    def _exit_code(self, event: str) -> int:
        if event == "requeue_failed":
            return REQUEUE_FAILED_EXIT_CODE
        # The local controller restarts the ranks only when one exits with its requeue code. On Slurm every
        # rank exits 0: srun's --kill-on-bad-exit must not cut a slower rank's save short.
        return LOCAL_REQUEUE_EXIT_CODE if event == "requeue" and self.backend == "local" else 0


class RequeueableTask(submitit.helpers.Checkpointable):
    """Wrap a task `task(ctx: RunContext)` so it saves and requeues on signals (see the module docstring).

    run_dir holds `events.jsonl`, the lock and `checkpoints/` (the task saves there; the guards read it).
    """

    def __init__(self, task: Callable[[RunContext], Any], run_dir: str | os.PathLike, max_requeues: int = 20,
                 max_requeues_without_progress: int = 2, requeue_on_failure: bool = True,
                 signal_delay_s: int = 120, kill_wait_s: int = 30) -> None:
        check_takes_context(task)
        self.task = task
        self.run_dir = str(run_dir)
        self.max_requeues = max_requeues
        self.max_requeues_without_progress = max_requeues_without_progress
        self.requeue_on_failure = requeue_on_failure
        self.grace_s = grace_seconds(signal_delay_s, kill_wait_s)

    def __call__(self) -> Any:
        global _CURRENT
        stop = StopFlag(self.grace_s)
        for signum in startup_signals.WATCHED:
            signal.signal(signum, stop.handle)
        for signum, at in startup_signals.take():
            stop.record(signum, at)
        run_dir = make_private_dir(self.run_dir, os.environ.get("TAEHV_SHARED_GROUP") or None)  # launched directly too
        env = DistEnv.from_environ()
        backend = os.environ.get("SUBMITIT_EXECUTOR", "debug")
        events = EventLog(run_dir / "events.jsonl")
        missing = slurm.scontrol_missing(socket.gethostname()) if env.rank == 0 and backend == "slurm" else None
        if missing:
            events.write("failure", segment=None, rank=0, step=None, error=f"RequeueImpossibleError: {missing}",
                         job_id=env.job_id, host=socket.gethostname())
            raise RequeueImpossibleError(missing)
        lock = RunLock(run_dir, env.job_id, backend)
        if env.rank == 0:
            lock.acquire()  # refuses when another live job trains this folder
        history = events.read()  # read before any rank of this segment writes (rank 0 writes after rendezvous)
        segment = sum(1 for e in history if e["event"] == "start")
        reason = self._refuse_reason(history, run_dir, env.job_id)
        if reason:
            if env.rank == 0:
                events.write("stopped", segment=segment, reason=reason, job_id=env.job_id)
            print(f"[taehv] not starting: {reason}", flush=True)
            raise StopRequested(reason)
        ctx = RunContext(run_dir, env, stop, segment, backend)
        if env.rank == 0:
            stop.on_give_up = lambda why: ctx.events.write("failure", segment=segment, rank=0, step=ctx.step,
                                                           error=why, job_id=env.job_id, host=socket.gethostname())
        _CURRENT = ctx
        try:
            result = self.task(ctx)
        except RequeueExit:
            raise
        except Exception as err:
            self._on_failure(ctx, err)
            raise
        finally:
            _CURRENT = None
        stop.disarm()
        # Finished: a time-limit warning or preemption arriving now has nothing left to save. Python
        # restores the default action (terminate) as it shuts down, and Slurm would record a completed
        # run as FAILED; ignored signals stay ignored through shutdown.
        for signum in startup_signals.WATCHED:
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
            return f"requeue limit reached: the job started {len(starts)} times (max_requeues={self.max_requeues})"
        return self._no_progress_reason(history, job_id, Checkpointer(run_dir / "checkpoints").latest_step() or 0)

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
        err.taehv_reported = True  # type: ignore[attr-defined]  # the entry point does not print it again
        if not (self.requeue_on_failure and ctx.start_step is not None and ctx.backend in ("slurm", "local")):
            return  # failed before training started (bad config, data, environment): requeueing cannot help
        claim = ctx.run_dir / f".requeue-claim-{ctx.env.job_id}-{ctx.segment}"
        try:  # exactly one failing rank requeues this segment
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:  # another rank requeues: leave quietly, so the job is not ended before it does
            raise RequeueExit(LOCAL_REQUEUE_EXIT_CODE if ctx.backend == "local" else 0) from None
        # The same guards a restart would apply, now, so a hopeless job is not requeued just to stop.
        stop_reason = self._refuse_reason(ctx.events.read(), ctx.run_dir, ctx.env.job_id)
        if stop_reason:
            ctx.events.write("stopped", segment=ctx.segment, reason=stop_reason, job_id=ctx.env.job_id)
            print(f"[taehv] not requeueing: {stop_reason}", flush=True)
            raise StopRequested(stop_reason) from err
        saved = Checkpointer(ctx.run_dir / "checkpoints").read_meta()
        lost = round(time.time() - max(saved["saved_at"] if saved else 0.0, ctx.start_time), 1)
        fields = {"segment": ctx.segment, "reason": "failure", "step": saved["step"] if saved else 0,
                  "failed_at_step": ctx.step, "signal_to_saved_s": None, "seconds_lost": lost, "job_id": ctx.env.job_id}
        if ctx.backend == "local":  # the controller restarts every rank when one exits with its requeue code
            ctx.events.write("requeue", **fields, by="local controller")
            raise RequeueExit(LOCAL_REQUEUE_EXIT_CODE) from None
        answer = slurm.requeue(ctx.env.job_id)
        if not answer.ok:
            ctx.events.write("requeue_failed", **fields, error=f"scontrol requeue: {answer.error}",
                             fix=slurm.requeue_fix(answer.error))
            return  # the error stands: the job ends FAILED
        ctx.events.write("requeue", **fields, by="self")
        raise RequeueExit(0) from None
