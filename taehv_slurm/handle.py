"""Submit a task and follow it: `submit()` → `JobHandle` (state, logs, metrics, accounting, plots).

Every run gets a private folder under the cluster's `job_dir`:

    <job_dir>/registry.jsonl      one line per submitted run (job id, run folder, configs, sweep values)
    <job_dir>/<run>/submitit/     submitit's pickles, sbatch script, one log per rank (<job>_<rank>_log.out)
    <job_dir>/<run>/checkpoints/  atomic checkpoints (`latest`)
    <job_dir>/<run>/metrics.jsonl per-step metrics written by rank 0
    <job_dir>/<run>/events.jsonl  starts, requeues, failures, stops
    <job_dir>/<run>/tb/           TensorBoard event files

A sweep is one job array: `<job_dir>/<group>/submitit/` for the array and `<job_dir>/<group>/<point>/`
per run. `JobHandle.attach(job_id, job_dir)` re-opens a run submitted from the CLI or an earlier kernel.
Registry paths are stored relative to `job_dir`, so a job_dir can be read from any working directory.

Only pandas/matplotlib/tqdm are imported lazily here (inside the functions that draw or build frames):
importing this module and `python -m jobs.status` stay light.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import submitit

from . import local, slurm
from .config import ClusterConfig, load_cluster
from .executor import SubmissionError, describe_sbatch_error, make_executor
from .picklecheck import check_picklable
from .requeue import EventLog, RequeueableTask, check_takes_context
from .runlock import RunLock, describe_live
from .security import check_safe_to_load, make_private_dir, private_umask

if TYPE_CHECKING:  # only for annotations: importing pandas/matplotlib costs seconds
    import pandas as pd
    from matplotlib.figure import Figure

REGISTRY = "registry.jsonl"
# Columns first in `metrics()`, in this order (others follow as the trainer wrote them).
METRIC_COLUMNS = ("step", "time", "event", "loss", "psnr", "samples_per_second", "lr", "gpu_memory_gb")


class UnknownJobError(LookupError):
    """No run with that job id in the registry."""


class JobControlError(RuntimeError):
    """A Slurm command on a job (scontrol requeue) failed; the message is one line."""


class RunBusyError(RuntimeError):
    """The run already has a live job; the message names it and how to follow, cancel or take over."""


def default_run_name(prefix: str) -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"


def submit(task: Callable[..., Any], cluster: ClusterConfig, run_name: str | None = None, *,
           extra_env: Mapping[str, str] | None = None, requeueable: bool = True,
           record: Mapping[str, Any] | None = None, force: bool = False) -> JobHandle:
    """Submit `task` (a picklable callable taking a RunContext) to `cluster`; returns its handle.

    requeueable: wrap in RequeueableTask (save on signals, requeue, guards); the task must take the
    run context (`def task(ctx)`) and call `ctx.step_boundary(step, save)` at each step. `record` is
    stored in the job registry beside the (secret-free) cluster config, e.g. the train config and
    plan. A run name whose job is still pending or running is refused; force=True cancels that job
    (it saves at the signal), waits for it to end, then submits.
    """
    return submit_many([task], cluster, [run_name] if run_name else None, extra_env=extra_env,
                       requeueable=requeueable, records=[dict(record or {})], force=force)[0]


def submit_many(tasks: Sequence[Callable[..., Any]], cluster: ClusterConfig, run_names: Sequence[str] | None = None,
                *, extra_env: Mapping[str, str] | None = None, requeueable: bool = True,
                records: Sequence[Mapping[str, Any]] | None = None, group_name: str | None = None,
                force: bool = False) -> list[JobHandle]:
    """Submit several tasks at once: on Slurm a job array (one array task per run), each its own run folder.

    run_names name the run folders (inside the group folder for several tasks); records (one per task)
    go into the registry, e.g. {"sweep": {"optim.lr": 1e-4}} — `runs_frame` turns those into columns.
    """
    if not tasks:
        raise ValueError("submit_many: no tasks to submit")
    if run_names is not None and len(run_names) != len(tasks):
        raise ValueError(f"submit_many: {len(tasks)} tasks but {len(run_names)} run names")
    for task in tasks:  # before any folder exists: a failure leaves nothing behind
        check_picklable(task)
        if requeueable:
            check_takes_context(task)
    base = Path(cluster.job_dir)
    if len(tasks) == 1:
        planned = [base / (run_names[0] if run_names else default_run_name(cluster.name))]
    else:  # a sweep: <job_dir>/<group>/<run>/ with one submitit folder for the array
        group_dir = base / (group_name or default_run_name(cluster.name))
        planned = [group_dir / name for name in (run_names or [f"run{i}" for i in range(len(tasks))])]
    take_over_runs(planned, base, force)
    job_dir = make_private_dir(cluster.job_dir, cluster.group)
    if len(tasks) == 1:
        run_dirs = [job_dir / planned[0].relative_to(base)]
        folder = run_dirs[0] / "submitit"
        owner = run_dirs[0]
    else:
        group = make_private_dir(job_dir / planned[0].parent.relative_to(base), cluster.group)
        run_dirs = [group / p.name for p in planned]
        owner = group
        folder = group / "submitit"
    for path in [*run_dirs, folder]:
        make_private_dir(path, cluster.group)
    check_safe_to_load(folder, owner)  # what the job's entry point will check: refuse now, not once it runs
    wrapped = [
        RequeueableTask(t, d, cluster.max_requeues, cluster.max_requeues_without_progress,
                        cluster.requeue_on_failure, cluster.signal_delay_s, cluster.kill_wait_s) if requeueable else t
        for t, d in zip(tasks, run_dirs)
    ]
    executor = make_executor(cluster, folder, extra_env, run_dir=owner)
    # Taken before sbatch: events the job writes are never older than this (see JobHandle.events).
    submitted_at = time.time()
    try:
        # Private umask: the pickle and sbatch script, and the logs Slurm creates (it keeps the submitting umask).
        with secrets_in_environ(cluster), private_umask(cluster.group):
            jobs = [executor.submit(wrapped[0])] if len(tasks) == 1 else executor.submit_array(wrapped)
    except submitit.core.utils.FailedJobError as err:  # sbatch exited non-zero
        raise SubmissionError(describe_sbatch_error(str(err))) from None
    handles = []
    for job, run_dir, rec, task in zip(jobs, run_dirs, records or [{}] * len(tasks), tasks):
        entry = {
            "job_id": str(job.job_id),
            "run": run_dir.relative_to(job_dir).as_posix(),
            "folder_rel": folder.relative_to(job_dir).as_posix(),
            "run_dir": str(run_dir),
            "folder": str(folder),
            "backend": cluster.backend,
            "task": type(task).__name__,
            "submitted_at": submitted_at,
            "nodes": cluster.nodes,
            "world_size": cluster.world_size,
            "cluster": cluster.masked(),  # secrets as '***': the registry is a file others may read
            **dict(rec),
        }
        EventLog(job_dir / REGISTRY).write("submitted", **entry)
        handles.append(JobHandle(job, run_dir, cluster, entry))
    return handles


def take_over_runs(run_dirs: Sequence[Path], job_dir: Path, force: bool) -> None:
    """Refuse a run whose job is still pending or running (registry) or holds its lock; with force,
    cancel those jobs (they save at the signal) and wait until they have ended."""
    live: list[tuple[Path, str, JobHandle | None]] = []
    registry = read_registry(job_dir) if (job_dir / REGISTRY).exists() else []
    for run_dir in run_dirs:
        name = run_dir.relative_to(job_dir).as_posix()
        ids = dict.fromkeys(r["job_id"] for r in registry if _record_run(r) == name)
        for job_id in ids:
            handle = JobHandle.attach(job_id, job_dir)
            state = handle.state
            if not slurm.is_final(state):
                live.append((run_dir, f"job {job_id} ({state})", handle))
        holder = RunLock(run_dir, "", "").holder()
        busy = describe_live(holder) if holder else None
        if busy and str(holder.get("job_id")) not in ids:
            live.append((run_dir, busy, None))
    if not live:
        return
    if not force:
        run_dir, what, handle = live[0]
        follow = f"follow it with `python -m jobs.logs {handle.job_id} --follow`, " if handle else ""
        raise RunBusyError(f"run {run_dir.relative_to(job_dir)} already has {what}: {follow}cancel it with "
                           f"`python -m jobs.cancel {handle.job_id if handle else '<job id>'}`, or pass --force to cancel "
                           "it (it saves) and take over, or use another --name")
    for run_dir, what, handle in live:
        if handle is None:
            raise RunBusyError(f"run {run_dir.relative_to(job_dir)} is trained by {what}, which was not submitted to "
                               f"{job_dir}: cancel it where it was submitted, then submit again")
        handle.cancel()
    for _, _, handle in live:
        if handle is not None:
            handle.wait(progress=False, timeout_s=float(handle.cluster.kill_wait_s) + 300)


@contextlib.contextmanager
def secrets_in_environ(cluster: ClusterConfig) -> Iterator[None]:
    """Secret env values reach the job through sbatch's inherited environment — never a file."""
    # '***' is a masked value (a config read back from the registry): the submitting environment's value stands.
    secret = {k: v for k, v in cluster.env.items() if k in cluster.secret_names() and v != "***"}
    saved = {k: os.environ.get(k) for k in secret}
    os.environ.update(secret)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_registry(job_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every submission recorded in `<job_dir>/registry.jsonl`, oldest first."""
    return [e for e in EventLog(Path(job_dir) / REGISTRY).read() if e.get("event") == "submitted"]


def registry_frame(job_dir: str | os.PathLike) -> pd.DataFrame:
    """The registry as a table: one row per submitted run (job id, run, when, shape, task, swept values)."""
    import pandas as pd

    rows = []
    for rec in read_registry(job_dir):
        rows.append({"job_id": rec["job_id"], "run": _record_run(rec),
                     "submitted": pd.Timestamp(rec.get("submitted_at", 0), unit="s"),
                     "backend": rec.get("backend"), "nodes": rec.get("nodes"), "world_size": rec.get("world_size"),
                     "task": rec.get("task"), "steps": (rec.get("plan") or {}).get("total_steps"),
                     **(rec.get("sweep") or {})})
    return pd.DataFrame(rows)


def _record_run(rec: Mapping[str, Any]) -> str:
    return rec.get("run") or Path(rec["run_dir"]).name


class JobHandle:
    """A submitted run: its Slurm/local job and its run folder."""

    def __init__(self, job: submitit.Job, run_dir: str | os.PathLike, cluster: ClusterConfig,
                 record: Mapping[str, Any] | None = None, job_dir: str | os.PathLike | None = None) -> None:
        self.job = job
        self.run_dir = Path(run_dir)
        self.cluster = cluster
        self.record = dict(record or {})
        self.job_dir = Path(job_dir if job_dir is not None else cluster.job_dir)

    # ------------------------------------------------------------------------------- identity
    @classmethod
    def attach(cls, job_id: str | int, job_dir: str | os.PathLike = "runs") -> JobHandle:
        """Re-open a run submitted elsewhere (CLI, another kernel) from the job registry."""
        job_id = str(job_id).strip()
        registry = read_registry(job_dir)
        records = [r for r in registry if r["job_id"] == job_id]
        if not records:
            where = Path(job_dir) / REGISTRY
            if not registry:
                raise UnknownJobError(f"no job {job_id}: {where} lists no runs; pass the job_dir the job was "
                                      "submitted with (--job-dir or TAEHV_JOB_DIR)")
            known = ", ".join(r["job_id"] for r in registry[-5:])
            raise UnknownJobError(f"no job {job_id} in {where} (latest: {known}); check the id or pass the "
                                  "job_dir it was submitted with")
        rec = records[-1]
        base = Path(job_dir)
        # Paths relative to job_dir where recorded (registry readable from any working directory).
        run_dir = base / rec["run"] if "run" in rec else Path(rec["run_dir"])
        folder = base / rec["folder_rel"] if "folder_rel" in rec else Path(rec["folder"])
        cluster = load_cluster(rec["cluster"])
        tasks = list(range(int(rec["world_size"])))
        if rec["backend"] == "slurm":
            job: submitit.Job = submitit.SlurmJob(folder=folder, job_id=rec["job_id"], tasks=tasks)
        else:
            job = submitit.LocalJob(folder=folder, job_id=rec["job_id"], tasks=tasks)
        return cls(job, run_dir, cluster, {**rec, "folder": str(folder)}, job_dir=base)

    @staticmethod
    def registry(job_dir: str | os.PathLike = "runs") -> pd.DataFrame:
        """Every run submitted to `job_dir` (see `registry_frame`)."""
        return registry_frame(job_dir)

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def name(self) -> str:
        """The run folder relative to job_dir (e.g. 'tiny-demo' or 'lr-sweep/lr=0.0001')."""
        return _record_run(self.record) if self.record else self.run_dir.name

    @property
    def sweep(self) -> dict[str, Any]:
        """The swept values of this run ({} for a single run)."""
        return dict(self.record.get("sweep") or {})

    @property
    def total_steps(self) -> int | None:
        steps = (self.record.get("plan") or {}).get("total_steps") or (self.record.get("train") or {}).get("steps")
        return int(steps) if steps else None

    def __repr__(self) -> str:
        return f"JobHandle(job_id={self.job_id}, run={self.name!r}, state={self.state})"

    # ---------------------------------------------------------------------------------- state
    @property
    def state(self) -> str:
        """The job's state, Slurm's names on every backend (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...)."""
        if self.cluster.backend == "slurm":
            return slurm.job_state(self.job_id) or "UNKNOWN"
        if self.cluster.backend == "local":
            return local.job_state(self.folder, self.job_id)["state"]
        return str(self.job.state).upper()

    @property
    def folder(self) -> Path:
        """The submitit folder (pickles, rank logs)."""
        return Path(self.record.get("folder") or self.job.paths.folder)

    def done(self) -> bool:
        return slurm.is_final(self.state)

    def wait(self, timeout_s: float | None = None, poll_s: float = 2.0, progress: bool = True,
             until_step: int | None = None) -> str:
        """Block until the job ends (or, with `until_step`, until the run logged that step); returns the state.

        The progress display is a bar updated in place in a notebook, tqdm in a terminal, and one plain
        line per change otherwise (logs, CI).
        """
        display = _Progress(f"job {self.job_id}", self.total_steps, enabled=progress)
        start = time.monotonic()
        try:
            while True:
                state = self.state
                step = self.last_step()
                display.update(state, step, len(self.requeues))
                if slurm.is_final(state) or (until_step is not None and (step or 0) >= until_step):
                    return state
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"job {self.job_id} still {state} at step {step} after {timeout_s:.0f} s")
                time.sleep(poll_s)
        finally:
            display.close()

    def result(self) -> Any:
        return self.job.result()

    def results(self) -> list[Any]:
        return self.job.results()

    def cancel(self) -> None:
        """Cancel the job. Its ranks get SIGTERM first, so the run saves its step before it ends (the
        task records `cancelled`); submitting the run name again resumes from there."""
        if self.cluster.backend == "local":
            local.cancel(self.folder, self.job_id)
        else:
            self.job.cancel(check=False)

    def requeue(self) -> None:
        """Preempt the job as the scheduler would (`scontrol requeue`): it saves, requeues and resumes."""
        if self.cluster.backend != "slurm":
            raise JobControlError(f"job {self.job_id} runs on the {self.cluster.backend} backend; requeue needs Slurm")
        answer = slurm.requeue(self.job_id)
        if not answer.ok:
            raise JobControlError(f"scontrol requeue {self.job_id} failed: {answer.error}")

    # ----------------------------------------------------------------------------------- logs
    def log_path(self, rank: int = 0) -> Path:
        return self.folder / f"{self.job_id}_{rank}_log.out"

    def follow(self, rank: int = 0, out: TextIO | None = None, position: int = 0, poll_s: float = 1.0,
               hide_tracebacks: bool = False) -> str:
        """Print the rank's log from byte `position` as it grows until the job ends; returns the final state
        (see `LogFollower`)."""
        return LogFollower(self, rank, position, hide_tracebacks).run(out, poll_s)

    def tail(self, n: int = 20, rank: int = 0) -> str:
        """The last `n` lines of one rank's log (every requeued run appends to the same file)."""
        path = self.log_path(rank)
        if not path.exists():
            return ""
        with path.open("rb") as f:
            f.seek(0, io.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    # ------------------------------------------------------------------------------- metrics
    def events(self, run_wide: bool = False) -> list[dict[str, Any]]:
        """This job's events from the run's events.jsonl (all jobs of the run folder with run_wide).

        A run folder can hold several jobs (a run resubmitted under its name resumes it); a job's events
        are those written between its submission and the next submission to the same folder.
        """
        events = EventLog(self.run_dir / "events.jsonl").read()
        if run_wide or "submitted_at" not in self.record:
            return events
        begin, end = self._time_window()
        return [e for e in events if begin <= e.get("time", 0) < end]

    def _time_window(self) -> tuple[float, float]:
        begin = float(self.record["submitted_at"])
        later = [float(r["submitted_at"]) for r in read_registry(self.job_dir)
                 if _record_run(r) == self.name and r["job_id"] != self.job_id and float(r["submitted_at"]) > begin]
        return begin, min(later, default=math.inf)

    def interruptions(self, run_wide: bool = False) -> list[dict[str, Any]]:
        """The run's requeues as they happened (Slurm or the local controller accepted each one)."""
        return [e for e in self.events(run_wide) if e["event"] == "requeue"]

    @property
    def requeues(self) -> pd.DataFrame:
        """One row per requeue of this job (time, segment, reason, step, signal_to_saved_s, seconds_lost)."""
        import pandas as pd

        columns = ["time", "segment", "reason", "step", "signal_to_saved_s", "seconds_lost"]
        frame = pd.DataFrame(self.interruptions())
        for column in columns:
            if column not in frame:
                frame[column] = pd.Series(dtype=float if column != "reason" else object)
        frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
        return frame[[*columns, *[c for c in frame.columns if c not in columns and c != "event"]]]

    @property
    def requeue_count(self) -> int:
        """How often Slurm requeued the job: its REQUEUED records in sacct (Slurm 22.05's sacct has no
        Restarts field); the events file's count where there is no accounting."""
        if self.cluster.backend == "slurm":
            frame = self.accounting()
            if not frame.empty:
                return int(frame.attrs.get("requeues", 0))
        return len(self.requeues)

    @property
    def stop_reason(self) -> str | None:
        """Why the requeue guards stopped the run (requeue limit, no progress), if they did."""
        stopped = [e for e in self.events() if e["event"] == "stopped"]
        return stopped[-1]["reason"] if stopped else None

    @property
    def error(self) -> str | None:
        """Why this job failed, in one line: a rank's error ('RuntimeError: ...'), a requeue Slurm refused,
        or what the local controller saw; None when nothing failed."""
        for event in reversed(self.events()):
            if event["event"] == "failure":
                return event["error"]
            if event["event"] == "requeue_failed":
                return f"saved step {event['step']} but could not requeue: {event['error']}; {event.get('fix', '')}".rstrip("; ")
        if self.cluster.backend == "local":
            return local.job_state(self.folder, self.job_id).get("error") or None
        return None

    def last_step(self) -> int | None:
        """The last step rank 0 logged (reads only the end of metrics.jsonl)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return None
        with path.open("rb") as f:
            f.seek(0, io.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            for line in reversed(f.read().decode(errors="replace").splitlines()):
                with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError, ValueError):
                    return int(json.loads(line)["step"])
        return None

    def metrics(self) -> pd.DataFrame:
        """The run's metrics, one row per logged step and event, sorted by step:

        event='train': step, time, loss, psnr, samples_per_second, lr, gpu_memory_gb, latent_loss, ...
        event='val': val_loss, val_psnr, ... at validation steps
        event='requeue': the step the run was saved at and resumed from, with its reason
        `time` is a UTC pandas Timestamp; `elapsed_s` counts seconds from the first row.
        """
        return metrics_frame(self.run_dir, self.interruptions(run_wide=True))

    def accounting(self, settle_s: float = 10.0) -> pd.DataFrame:
        """`sacct --duplicates` rows of this job and its steps, one allocation row per run attempt.

        Adds `Attempt` (0 for the first run, +1 per requeue; steps carry their allocation's attempt) and
        `ElapsedSeconds`; `frame.attrs['requeues']` is the number of REQUEUED allocation records.
        slurmdbd records a job's end a moment after squeue shows it: for up to `settle_s` seconds this
        waits until the accounting agrees that an ended job ended.
        """
        frame = slurm.sacct_frame(self.job_id)
        deadline = time.monotonic() + settle_s
        while self._accounting_behind(frame) and time.monotonic() < deadline:
            time.sleep(0.5)
            frame = slurm.sacct_frame(self.job_id)
        return frame

    def _accounting_behind(self, frame: pd.DataFrame) -> bool:
        alloc = frame[frame["JobID"] == self.job_id]["State"] if not frame.empty else []
        if not len(alloc) or slurm.is_final(str(alloc.iloc[-1])):
            return False  # no accounting here (or no record at all), or it has the end already
        return slurm.is_final(slurm.squeue_state(self.job_id) or "PENDING")

    def summary(self) -> dict[str, Any]:
        """One status row: id, run, state, step/total, requeues, swept values, and why it stopped or failed."""
        step, total = self.last_step(), self.total_steps
        state = self.state
        note = self.stop_reason or (self.error if not slurm.is_success(state) else None) or ""
        requeues = self.requeues
        if not requeues.empty:
            note = note or "requeued at step " + ", ".join(str(int(s)) for s in requeues["step"])
        return {"job_id": self.job_id, "run": self.name, "state": state,
                "nodes": self.record.get("nodes"), "ranks": self.record.get("world_size"),
                "step": f"{step if step is not None else '-'}/{total or '?'}", "requeues": len(requeues),
                "submitted": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.record.get("submitted_at", 0))),
                **self.sweep, "note": note}

    def plot(self, path: str | os.PathLike | None = None, title: str | None = None) -> Figure:
        """Loss, PSNR and throughput against step; requeues marked as dashed lines."""
        nodes, ranks = self.record.get("nodes"), self.record.get("world_size")
        shape = f" · {nodes} node(s) × {ranks // nodes} ranks" if nodes and ranks else ""
        label = title or f"job {self.job_id} · run {self.name}{shape}"
        return plot_metrics({label: self.metrics()}, path, title=label)


# ------------------------------------------------------------------------------- metric frames


def metrics_frame(run_dir: str | os.PathLike, requeues: Sequence[Mapping[str, Any]] = ()) -> pd.DataFrame:
    """metrics.jsonl of a run folder (+ requeue rows) as a DataFrame; see `JobHandle.metrics`."""
    import pandas as pd

    path = Path(run_dir) / "metrics.jsonl"
    rows = [dict(r, event="val" if any(k.startswith("val_") for k in r) else "train")
            for r in (EventLog(path).read() if path.exists() else [])]
    rows += [{k: v for k, v in e.items() if k not in ("event", "failed_at_step")} | {"event": "requeue"}
             for e in requeues]
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=list(METRIC_COLUMNS))
    for column in METRIC_COLUMNS:
        if column not in frame:
            frame[column] = pd.Series(dtype=float)
    frame = frame.sort_values(["step", "time"], kind="stable").reset_index(drop=True)
    frame["step"] = frame["step"].astype(int)
    frame["elapsed_s"] = frame["time"] - frame["time"].min()
    frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
    return frame[[*METRIC_COLUMNS, *[c for c in frame.columns if c not in METRIC_COLUMNS]]]


def runs_frame(handles: Sequence[JobHandle | str], columns: Sequence[str] = (), *,
               job_dir: str | os.PathLike | None = None, final: bool = False) -> pd.DataFrame:
    """The metrics of several runs in one DataFrame, with job_id, run and each run's swept values as columns.

    handles: JobHandles, or job ids with `job_dir`. final=True keeps one row per run: its last train row
    (with the last validation values beside it) — a sweep's results table.
    """
    import pandas as pd

    parts = []
    for item in handles:
        handle = item if isinstance(item, JobHandle) else JobHandle.attach(item, job_dir or "runs")
        frame = handle.metrics()
        if final:
            frame = _final_row(frame)
        parts.append(frame.assign(job_id=handle.job_id, run=handle.name, **handle.sweep))
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    front = [c for c in ("job_id", "run") if c in frame]
    swept = [k for h in handles if isinstance(h, JobHandle) for k in h.sweep]
    order = list(dict.fromkeys([*front, *swept, *frame.columns]))
    frame = frame[order]
    return frame[[*columns]] if columns else frame


def _final_row(frame: pd.DataFrame) -> pd.DataFrame:
    import pandas as pd

    train = frame[frame["event"] == "train"]
    if train.empty:
        return train
    row = train.iloc[[-1]].reset_index(drop=True).dropna(axis=1, how="all")
    val = frame[frame["event"] == "val"]
    if not val.empty:
        last = val.iloc[-1]
        extra = {k: last[k] for k in val.columns if k.startswith("val_")}
        row = row.assign(**extra, val_step=int(last["step"]))
    row["requeues"] = int((frame["event"] == "requeue").sum())
    return pd.DataFrame(row)


class LogFollower:
    """Prints a rank's log as it grows until the job ends; `position` is where it has read to, so a
    caller interrupted (Ctrl-C) can go on from there. A requeued job appends each run to the same log,
    so following keeps going across requeues. hide_tracebacks: each traceback becomes one line naming
    the log that holds it (for a caller that prints the error once at the end)."""

    def __init__(self, handle: JobHandle, rank: int = 0, position: int = 0, hide_tracebacks: bool = False) -> None:
        self.handle, self.path, self.position = handle, handle.log_path(rank), position
        self.filter = _TracebackFilter(self.path) if hide_tracebacks else None

    def run(self, out: TextIO | None = None, poll_s: float = 1.0) -> str:
        out = out or sys.stdout
        while True:
            state = self.handle.state  # read before the file: a job that just ended has written its last line
            if self.path.exists():
                with self.path.open("rb") as f:
                    if f.seek(0, 2) < self.position:  # truncated or replaced (never by Slurm's append mode)
                        self.position = 0
                    f.seek(self.position)
                    chunk = f.read()
                    self.position = f.tell()
                text = chunk.decode(errors="replace")
                text = self.filter.feed(text) if self.filter else text
                if text:
                    out.write(text)
                    out.flush()
            if slurm.is_final(state):
                return state
            time.sleep(poll_s)


class _TracebackFilter:
    """Log text with each Python traceback (chained ones too) replaced by one line that says where it is."""

    CHAINED = ("During handling of the above exception", "The above exception was the direct cause")

    def __init__(self, path: Path) -> None:
        self.marker = f"[traceback hidden: the full text is in {path}]"
        self.pending = ""  # an incomplete last line
        self.inside = False
        self.last = ""

    def feed(self, text: str) -> str:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        kept = []
        for line in lines:
            if line.startswith("Traceback (most recent call last):") or line.startswith(self.CHAINED):
                if not self.inside and self.last != self.marker:
                    kept.append(self.marker)
                    self.last = self.marker
                self.inside = True
            elif self.inside and (line.startswith((" ", "\t")) or not line.strip()):
                continue
            elif self.inside:
                self.inside = False  # the exception's own line ends the traceback (printed once by the caller)
            elif "Submitted job triggered an exception" in line:
                continue  # submitit's own note of the same failure (once per handler)
            elif line.strip() or self.last != self.marker:  # no blank line between chained tracebacks
                kept.append(line)
                self.last = line
        return "".join(line + "\n" for line in kept)


# ------------------------------------------------------------------------------------ progress


def _in_notebook() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class _Progress:
    """wait()'s display: an HTML bar replaced in place in a notebook (no ipywidgets needed), tqdm in a
    terminal, else one plain line per state change and at most one per `every_s` for steps."""

    def __init__(self, label: str, total: int | None, enabled: bool = True, every_s: float = 10.0) -> None:
        self.label, self.total, self.enabled, self.every_s = label, total, enabled, every_s
        self.mode = "off" if not enabled else "notebook" if _in_notebook() else "tty" if sys.stderr.isatty() else "lines"
        self.began = time.monotonic()
        self.last: tuple[str, int | None, int] | None = None
        self.last_line = 0.0
        self.handle: Any = None
        self.bar: Any = None
        if self.mode == "tty":
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="step")

    def text(self, state: str, step: int | None, requeues: int) -> str:
        of = f"/{self.total}" if self.total else ""
        again = f" · requeued {requeues}×" if requeues else ""
        return f"{self.label}: {state} · step {step if step is not None else '-'}{of}{again} · {time.monotonic() - self.began:.0f} s"

    def update(self, state: str, step: int | None, requeues: int) -> None:
        now = (state, step, requeues)
        if self.mode == "off" or now == self.last:
            return
        text = self.text(state, step, requeues)
        if self.mode == "notebook":
            from IPython.display import display

            fraction = min(1.0, (step or 0) / self.total) if self.total else 0.0
            html = (f'<div style="font-family:monospace"><progress value="{fraction:.3f}" max="1" '
                    f'style="width:18em;vertical-align:middle"></progress> {_html_escape(text)}</div>')
            data = {"text/plain": text, "text/html": html}
            if self.handle is None:
                self.handle = display(data, raw=True, display_id=True)
            else:
                self.handle.update(data, raw=True)
        elif self.mode == "tty":
            self.bar.n = step or 0
            self.bar.set_postfix_str(f"{state}{f', requeued {requeues}×' if requeues else ''}", refresh=True)
        else:
            state_changed = self.last is None or self.last[0] != state or self.last[2] != requeues
            if state_changed or time.monotonic() - self.last_line >= self.every_s:
                print(text, flush=True)
                self.last_line = time.monotonic()
            else:
                return  # keep self.last so the next step change is compared with what was printed
        self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _html_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---------------------------------------------------------------------------------- plotting


def plot_metrics(frames: Mapping[str, pd.DataFrame], path: str | os.PathLike | None = None,
                 title: str | None = None) -> Figure:
    """One figure of loss, PSNR and samples/s against step for one or more runs (label → metrics frame).

    Training values are lines, validation values circles, requeues dashed vertical lines (red for one
    run, else in the run's colour); one legend below the panels.
    """
    import matplotlib

    if path is not None and "matplotlib.pyplot" not in sys.modules and not _in_notebook():
        matplotlib.use("Agg")  # saving from a script or CI: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    panels = (("loss", "val_loss", "loss"), ("psnr", "val_psnr", "PSNR (dB)"),
              ("samples_per_second", None, "throughput (clips/s)"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    single = len(frames) == 1
    legend: dict[str, Line2D] = {}  # runs first, then the marker kinds
    kinds: dict[str, Line2D] = {}
    for i, (label, frame) in enumerate(frames.items()):
        color = colors[i % len(colors)]
        if frame.empty:
            continue
        train = frame[frame["event"] == "train"]
        val = frame[frame["event"] == "val"]
        for ax, (column, val_column, _) in zip(axes, panels):
            if column in train and train[column].notna().any():
                data = train[["step", column]].dropna()
                ax.plot(data["step"], data[column], color=color, linewidth=1.5)
            if val_column and val_column in val and val[val_column].notna().any():
                data = val[["step", val_column]].dropna()
                ax.plot(data["step"], data[val_column], "o", color=color, markersize=7, markerfacecolor="white",
                        markeredgewidth=1.5)
        legend["train" if single else str(label)] = Line2D([], [], color=color, linewidth=1.5)
        if "val_loss" in val or "val_psnr" in val:
            kinds["validation"] = Line2D([], [], marker="o", linestyle="", markerfacecolor="white",
                                          markeredgewidth=1.5, color=color if single else "0.3")
        mark = "tab:red" if single else color
        requeues = frame[frame["event"] == "requeue"]
        for step in requeues["step"]:
            for ax in axes:
                ax.axvline(step, color=mark, linestyle="--", linewidth=1.2, alpha=0.9)
        if not requeues.empty:
            reasons = requeues["reason"] if "reason" in requeues else ["?"] * len(requeues)
            what = ", ".join(f"{r} at step {int(s)}" for r, s in zip(reasons, requeues["step"]))
            kinds[f"requeue ({what})" if single else "requeue"] = Line2D(
                [], [], color=mark if single else "0.3", linestyle="--", linewidth=1.2)
    for ax, (_, _, name) in zip(axes, panels):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    legend.update(kinds)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07 if legend else 0, 1, 1))
    if legend:
        fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), frameon=False, fontsize=9)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
