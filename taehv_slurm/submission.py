"""Submit tasks: `submit()` / `submit_many()` → `JobHandle`s.

Every run gets a private folder under the cluster's `job_dir` (what it holds: taehv_slurm.common.runfolder),
and a line in the job_dir's registry (taehv_slurm.registry). A sweep is one job array:
`<job_dir>/<group>/submitit/` for the array and `<job_dir>/<group>/<point>/` per run. Nothing is written
before every check passed (picklable, takes the run context, no live job for the run, safe folders), and
secret env values reach the job only through sbatch's environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from taehv_slurm import followup, slurm, snapshot
from taehv_slurm.backends import backend_named, describe_live
from taehv_slurm.common.config import ClusterConfig, ConfigError
from taehv_slurm.common.messages import command
from taehv_slurm.common.runfolder import SUBMITIT, JobDir
from taehv_slurm.common.security import (
    UnsafePathError,
    check_not_shared_writable,
    check_safe_to_load,
    describe_user,
    make_private_dir,
    private_umask,
)
from taehv_slurm.common.submitit_api import FailedJobError
from taehv_slurm.executor import SubmissionError, describe_sbatch_error, make_executor
from taehv_slurm.handle import JobHandle
from taehv_slurm.picklecheck import check_picklable
from taehv_slurm.registry import Registry, record_submission
from taehv_slurm.runs import asked_once
from taehv_slurm.runtime.rank_backend import RankBackend
from taehv_slurm.runtime.requeue import RequeueableTask, check_takes_context
from taehv_slurm.runtime.runlock import lock_holder
from taehv_slurm.runtime.watchdog import WatchdogSettings


class RunBusyError(RuntimeError):
    """The run already has a live job; the message names it and how to follow, cancel or take over."""


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_run_name(name: str) -> None:
    """A run name is one folder under job_dir: letters, digits and . _ - (not starting with . or -)."""
    if not RUN_NAME.fullmatch(name):
        raise ConfigError(f"run name {name!r}: use one folder name of letters, digits and . _ - "
                          "(not starting with . or -), e.g. --name tiny-lr2e-4")


def check_target(cluster: ClusterConfig, run_names: Sequence[str | None]) -> None:
    """Where runs of these names would go, refused in one line before anything is written: each name one
    folder name (None: a name made at submit), job_dir one this user can write in."""
    for name in filter(None, run_names):
        check_run_name(name)
    check_job_dir(cluster.job_dir)


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


def submit_many(tasks: Sequence[Callable[..., Any]], cluster: ClusterConfig,
                run_names: Sequence[str] | None = None,
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
    backend = backend_named(cluster.backend)
    if reason := backend.unavailable_reason():
        raise SubmissionError(reason)
    # how its jobs go on after a preemption: asked of Slurm once, here
    cluster = dataclasses.replace(cluster, requeue=followup.resolve_mode(cluster, backend.asks_a_scheduler))
    backend = backend.for_jobs_of(cluster)
    given = [run_names[0]] if run_names and len(tasks) == 1 else []  # a sweep's runs are named by its values
    check_target(cluster, [*given, group_name])
    base = Path(cluster.job_dir)
    if len(tasks) == 1:
        planned = [base / (run_names[0] if run_names else default_run_name(cluster.name))]
    else:  # a sweep: <job_dir>/<group>/<run>/ with one submitit folder for the array
        group_dir = base / (group_name or default_run_name(cluster.name))
        planned = [group_dir / name for name in (run_names or [f"run{i}" for i in range(len(tasks))])]
    take_over_runs(planned, base, force)
    if requeueable:
        tasks = [requeueable_task(t, d, cluster, backend) for t, d in zip(tasks, planned)]
    jobs, folder, submitted_at = _submit_to_executor(tasks, planned, cluster, extra_env)
    job_dir = Path(cluster.job_dir)
    handles = []
    for job, run_dir, rec, task in zip(jobs, planned, records or [{}] * len(tasks), tasks):
        entry = {
            "job_id": str(job.job_id),
            "run": run_dir.relative_to(base).as_posix(),
            "folder_rel": folder.relative_to(job_dir).as_posix(),
            "run_dir": str(run_dir),
            "folder": str(folder),
            "backend": cluster.backend,
            "task": task_name(task),
            "submitted_at": submitted_at,
            "nodes": cluster.nodes,
            "world_size": cluster.world_size,
            "cluster": cluster.masked(),  # secrets as '***': the registry is a file others may read
            **dict(rec),
        }
        record_submission(job_dir, entry, cluster.group)
        handles.append(JobHandle(job, run_dir, cluster, entry))
    return handles


def _submit_to_executor(tasks: Sequence[Callable[..., Any]], run_dirs: list[Path], cluster: ClusterConfig,
                        extra_env: Mapping[str, str] | None) -> tuple[list[Any], Path, float]:
    """Create the run folders (private) and submit: one job, or a job array whose submitit folder is the
    group's. Returns (submitit jobs, the submitit folder, when). The folders this call creates are removed
    again if the job is not submitted; folders that existed before (a resumed run's) are never touched."""
    base = Path(cluster.job_dir)
    owner = run_dirs[0] if len(tasks) == 1 else run_dirs[0].parent
    created = [p for p in dict.fromkeys((base, owner, *run_dirs)) if not p.exists()]  # outermost first
    copies = JobDir(base).code  # the code copies: one made now goes too (another job's stays)
    copied_before = set(copies.iterdir()) if copies.is_dir() else set()
    try:
        folder = owner / SUBMITIT  # the run's; for a sweep, the array's one folder beside its runs
        for path in dict.fromkeys((base, owner, *run_dirs, folder)):
            make_private_dir(path, cluster.group)
        # what the job's entry point will check: refuse now, not once it runs
        check_safe_to_load(folder, owner)
        extra_env = {**(extra_env or {}), **snapshot.job_env(cluster)}
        executor = make_executor(cluster, folder, extra_env, run_dir=owner)
        # Taken before sbatch: events the job writes are never older than this (see JobHandle.events).
        submitted_at = time.time()
        # Private umask: the pickle and sbatch script, and the logs Slurm creates (it keeps the submitting
        # umask).
        # sbatch's refusal reaches the user once, as our one line: submitit would also print its raw lines.
        with (secrets_in_environ(cluster), private_umask(cluster.group),
              contextlib.redirect_stderr(io.StringIO())):
            jobs = [executor.submit(tasks[0])] if len(tasks) == 1 else executor.submit_array(list(tasks))
    except BaseException as err:
        made = set(copies.iterdir()) - copied_before if copies.is_dir() else set()
        for path in [*reversed(created), *made, *([copies] if made and not copied_before else [])]:
            shutil.rmtree(path, ignore_errors=True)
        if isinstance(err, FailedJobError):  # sbatch exited non-zero
            raise SubmissionError(describe_sbatch_error(str(err))) from None
        raise
    return jobs, folder, submitted_at


def requeueable_task(task: Callable[..., Any], run_dir: str | os.PathLike, cluster: ClusterConfig,
                     backend: RankBackend, requeue_on_failure: bool | None = None) -> RequeueableTask:
    """`task` wrapped for `cluster`: its requeue limits, signal budgets, node exclusion and hang watchdog."""
    watchdog = WatchdogSettings(interval_s=cluster.heartbeat_s, floor_s=cluster.hang_floor_s,
                                factor=cluster.hang_factor, uncalibrated_s=cluster.hang_uncalibrated_s,
                                enabled=cluster.hang_detection)
    on_failure = cluster.requeue_on_failure if requeue_on_failure is None else requeue_on_failure
    return RequeueableTask(task, run_dir, max_requeues=cluster.max_requeues,
                           max_requeues_without_progress=cluster.max_requeues_without_progress,
                           requeue_on_failure=on_failure, signal_delay_s=cluster.signal_delay_s,
                           kill_wait_s=cluster.kill_wait_s, backend=backend,
                           exclude_failed_nodes=cluster.exclude_failed_nodes, watchdog=watchdog)


def task_name(task: Any) -> str:
    """What the registry calls a task: its class's name (the named class for a TaskRef)."""
    inner = getattr(task, "task", task)  # inside a RequeueableTask
    target = getattr(inner, "target", None)
    return target.rpartition(":")[2] if isinstance(target, str) else type(inner).__name__


def check_job_dir(job_dir: str | os.PathLike) -> None:
    """Refuse, in one line and before anything is written, a job_dir this user cannot create or write
    in (probed with a temporary folder in it, or in its nearest existing parent, removed at once)."""
    path = Path(job_dir)
    existing = next(p for p in (path, *path.parents) if p.exists())  # a relative path ends at "."
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".taehv-probe-"))
    except OSError as err:
        where = "" if existing == path else f" (creating it in {existing})"
        raise ConfigError(f"job_dir {job_dir}: cannot write there{where}: {err.strerror or err}; "
                          "set job_dir to a "
                          "folder you can write, on storage every node sees (--set job_dir=DIR)") from None
    if existing == path:  # what make_private_dir refuses, and a registry someone else put there
        check_not_shared_writable(path)
        registry = JobDir(path).registry
        if registry.exists() and registry.stat().st_uid != path.stat().st_uid:
            raise UnsafePathError(f"{registry} belongs to {describe_user(registry.stat().st_uid)}, not to "
                                  "the owner of job_dir (someone else put it there): move it away and check "
                                  "who can write to that folder")


def take_over_runs(run_dirs: Sequence[Path], job_dir: Path, force: bool) -> None:
    """Refuse a run whose job is still pending or running (registry) or holds its lock; with force,
    cancel those jobs (they save at the signal) and wait until they have ended."""
    live: list[tuple[Path, str, JobHandle | None]] = []
    registry = Registry.load(job_dir)
    jobs = {run_dir: [JobHandle.attach(job_id, job_dir) for job_id in dict.fromkeys(
        r["job_id"] for r in registry.of_run(run_dir.relative_to(job_dir).as_posix()))]
        for run_dir in run_dirs}
    with asked_once([h for handles in jobs.values() for h in handles]):  # one squeue for them all
        states = {h.job_id: h.state for handles in jobs.values() for h in handles}
    for run_dir in run_dirs:
        ids = [h.job_id for h in jobs[run_dir]]
        for handle in jobs[run_dir]:
            if not slurm.is_final(states[handle.job_id]):
                live.append((run_dir, f"job {handle.job_id} ({states[handle.job_id]})", handle))
        holder = lock_holder(run_dir)
        busy = describe_live(holder) if holder else None
        if busy and str(holder.get("job_id")) not in ids:
            live.append((run_dir, busy, None))
    if not live:
        return
    if not force:
        run_dir, what, handle = live[0]
        follow = f"follow it with `{command('logs')} {handle.job_id} --follow`, " if handle else ""
        raise RunBusyError(f"run {run_dir.relative_to(job_dir)} already has {what}: {follow}cancel it with "
                           f"`{command('cancel')} {handle.job_id if handle else '<job id>'}`, "
                           "or pass --force to cancel "
                           "it (it saves) and take over, or use another --name")
    for run_dir, what, handle in live:
        if handle is None:
            raise RunBusyError(f"run {run_dir.relative_to(job_dir)} is trained by {what}, "
                               "which was not submitted to "
                               f"{job_dir}: cancel it where it was submitted, then submit again")
        handle.cancel()
    for _, _, handle in live:
        if handle is not None:
            handle.wait(progress=False, timeout_s=float(handle.cluster.kill_wait_s) + 300)


@contextlib.contextmanager
def secrets_in_environ(cluster: ClusterConfig) -> Iterator[None]:
    """Secret env values reach the job through sbatch's inherited environment — never a file."""
    # '***' is a masked value (a config read back from the registry): the submitting environment's value
    # stands.
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
