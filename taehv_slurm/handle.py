"""Submit a task and follow it: `submit()` → `JobHandle` (state, logs, metrics, accounting, plots).

Every run gets a private folder under the cluster's `job_dir`:

    <job_dir>/registry.jsonl      one line per submitted run (job id, run folder, configs, sweep values)
    <job_dir>/<run>/submitit/     submitit's pickles, sbatch script, one log per rank (<job>_<rank>_log.out)
    <job_dir>/<run>/checkpoints/  atomic checkpoints (`latest`)
    <job_dir>/<run>/metrics.jsonl per-step metrics written by rank 0
    <job_dir>/<run>/events.jsonl  starts, requeues, failures, stops
    <job_dir>/<run>/tb/           TensorBoard event files

`JobHandle.attach(job_id, job_dir)` re-opens a run submitted from the CLI or an earlier kernel.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import submitit

from .config import ClusterConfig, load_cluster
from .executor import SubmissionError, describe_sbatch_error, make_executor
from .requeue import EventLog, RequeueableTask
from .security import make_private_dir

REGISTRY = "registry.jsonl"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED", "FINISHED", "INTERRUPTED", "DONE"}


class UnknownJobError(LookupError):
    """No run with that job id in the registry."""


def default_run_name(prefix: str) -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"


def submit(task: Callable[..., Any], cluster: ClusterConfig, run_name: str | None = None, *,
           extra_env: Mapping[str, str] | None = None, requeueable: bool = True,
           record: Mapping[str, Any] | None = None) -> JobHandle:
    """Submit `task` (a picklable callable taking a RunContext) to `cluster`; returns its handle.

    requeueable: wrap in RequeueableTask (save on signals, requeue, guards). `record` is stored in the
    job registry beside the (secret-free) cluster config, e.g. the train config and plan.
    """
    return submit_many([task], cluster, [run_name] if run_name else None, extra_env=extra_env,
                       requeueable=requeueable, records=[dict(record or {})])[0]


def submit_many(tasks: Sequence[Callable[..., Any]], cluster: ClusterConfig, run_names: Sequence[str] | None = None,
                *, extra_env: Mapping[str, str] | None = None, requeueable: bool = True,
                records: Sequence[Mapping[str, Any]] | None = None, group_name: str | None = None) -> list[JobHandle]:
    """Submit several tasks at once: on Slurm a job array (one array task per run), each its own run folder."""
    job_dir = make_private_dir(cluster.job_dir, cluster.group)
    if len(tasks) == 1:
        run_dirs = [job_dir / (run_names[0] if run_names else default_run_name(cluster.name))]
        folder = run_dirs[0] / "submitit"
    else:  # a sweep: <job_dir>/<group>/run<i>/ with one submitit folder for the array
        group = make_private_dir(job_dir / (group_name or default_run_name(cluster.name)), cluster.group)
        run_dirs = [group / name for name in (run_names or [f"run{i}" for i in range(len(tasks))])]
        folder = group / "submitit"
    for path in [*run_dirs, folder]:
        make_private_dir(path, cluster.group)
    wrapped = [
        RequeueableTask(t, d, cluster.max_requeues, cluster.max_requeues_without_progress,
                        cluster.requeue_on_failure, cluster.signal_delay_s, cluster.kill_wait_s) if requeueable else t
        for t, d in zip(tasks, run_dirs)
    ]
    executor = make_executor(cluster, folder, extra_env)
    try:
        with secrets_in_environ(cluster):
            jobs = [executor.submit(wrapped[0])] if len(tasks) == 1 else executor.submit_array(wrapped)
    except submitit.core.utils.FailedJobError as err:  # sbatch exited non-zero
        raise SubmissionError(describe_sbatch_error(str(err))) from None
    handles = []
    for job, run_dir, rec, task in zip(jobs, run_dirs, records or [{}] * len(tasks), tasks):
        entry = {
            "job_id": str(job.job_id),
            "run_dir": str(run_dir),
            "folder": str(folder),
            "backend": cluster.backend,
            "task": type(task).__name__,
            "submitted_at": time.time(),
            "nodes": cluster.nodes,
            "world_size": cluster.world_size,
            "cluster": cluster.masked(),
            **dict(rec),
        }
        EventLog(job_dir / REGISTRY).write("submitted", **entry)
        handles.append(JobHandle(job, run_dir, cluster, entry))
    return handles


@contextlib.contextmanager
def secrets_in_environ(cluster: ClusterConfig) -> Iterator[None]:
    """Secret env values reach the job through sbatch's inherited environment — never a file."""
    secret = {k: v for k, v in cluster.env.items() if k in cluster.secret_names()}
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
    return [e for e in EventLog(Path(job_dir) / REGISTRY).read() if e.get("event") == "submitted"]


class JobHandle:
    """A submitted run: its Slurm/local job and its run folder."""

    def __init__(self, job: submitit.Job, run_dir: str | os.PathLike, cluster: ClusterConfig,
                 record: Mapping[str, Any] | None = None) -> None:
        self.job = job
        self.run_dir = Path(run_dir)
        self.cluster = cluster
        self.record = dict(record or {})

    # ------------------------------------------------------------------------------- identity
    @classmethod
    def attach(cls, job_id: str | int, job_dir: str | os.PathLike = "runs") -> JobHandle:
        """Re-open a run submitted elsewhere (CLI, another kernel) from the job registry."""
        records = [r for r in read_registry(job_dir) if r["job_id"] == str(job_id)]
        if not records:
            known = ", ".join(r["job_id"] for r in read_registry(job_dir)[-5:]) or "none"
            raise UnknownJobError(f"no job {job_id} in {Path(job_dir) / REGISTRY} (latest: {known}); "
                                  "check the id or pass the job_dir it was submitted with")
        rec = records[-1]
        cluster = load_cluster(rec["cluster"])
        if rec["backend"] == "slurm":
            job: submitit.Job = submitit.SlurmJob(folder=rec["folder"], job_id=rec["job_id"],
                                                  tasks=list(range(rec["world_size"])))
        else:
            job = submitit.LocalJob(folder=rec["folder"], job_id=rec["job_id"], tasks=list(range(rec["world_size"])))
        return cls(job, rec["run_dir"], cluster, rec)

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def __repr__(self) -> str:
        return f"JobHandle(job_id={self.job_id}, state={self.state}, run_dir={self.run_dir})"

    # ---------------------------------------------------------------------------------- state
    @property
    def state(self) -> str:
        """Slurm's job state (PENDING, RUNNING, REQUEUED, COMPLETED, FAILED, CANCELLED, ...)."""
        if self.cluster.backend == "slurm":
            state = _squeue_state(self.job_id) or _sacct_state(self.job_id)
            if state:
                return state
        return str(self.job.state).upper()

    def done(self) -> bool:
        return self.state.split()[0] in FINAL_STATES

    def wait(self, timeout_s: float | None = None, poll_s: float = 2.0, progress: bool = True) -> str:
        """Block until the job ends; show step progress from the metrics file. Returns the final state."""
        from tqdm.auto import tqdm

        total = self.record.get("plan", {}).get("total_steps")
        bar = tqdm(total=total, desc=f"job {self.job_id}", unit="step", disable=not progress)
        start = time.monotonic()
        try:
            while True:
                state = self.state
                step = self.last_step()
                if step is not None:
                    bar.n = step
                bar.set_postfix_str(state, refresh=True)
                if state.split()[0] in FINAL_STATES:
                    return state
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"job {self.job_id} still {state} after {timeout_s:.0f} s")
                time.sleep(poll_s)
        finally:
            bar.close()

    def result(self) -> Any:
        return self.job.result()

    def results(self) -> list[Any]:
        return self.job.results()

    def cancel(self) -> None:
        self.job.cancel(check=False)

    # ----------------------------------------------------------------------------------- logs
    def log_path(self, rank: int = 0) -> Path:
        return Path(self.record.get("folder") or self.job.paths.folder) / f"{self.job_id}_{rank}_log.out"

    def tail(self, n: int = 20, rank: int = 0) -> str:
        """The last `n` lines of one rank's log."""
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
    def events(self) -> list[dict[str, Any]]:
        return EventLog(self.run_dir / "events.jsonl").read()

    @property
    def requeues(self):  # -> pandas.DataFrame
        import pandas as pd

        rows = [e for e in self.events() if e["event"] == "requeue"]
        return pd.DataFrame(rows, columns=["time", "segment", "reason", "step", "signal_to_saved_s", "seconds_lost"] if not rows else None)

    @property
    def stop_reason(self) -> str | None:
        stopped = [e for e in self.events() if e["event"] == "stopped"]
        return stopped[-1]["reason"] if stopped else None

    def last_step(self) -> int | None:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return None
        with path.open("rb") as f:
            f.seek(0, io.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            for line in reversed(f.read().decode(errors="replace").splitlines()):
                with contextlib.suppress(json.JSONDecodeError, KeyError):
                    return int(json.loads(line)["step"])
        return None

    def metrics(self):  # -> pandas.DataFrame
        """Per-step metrics of rank 0 (step, time, loss, psnr, samples_per_second, lr, gpu_memory_gb, ...)
        plus one row per requeue (event='requeue', with its reason and step)."""
        import pandas as pd

        path = self.run_dir / "metrics.jsonl"
        rows = EventLog(path).read() if path.exists() else []
        frame = pd.DataFrame(rows)
        if not frame.empty and "event" not in frame:
            frame["event"] = "train"
        requeues = self.requeues
        if not requeues.empty:
            frame = pd.concat([frame, requeues.assign(event="requeue")], ignore_index=True)
        if not frame.empty:
            frame = frame.sort_values(["step", "time"], kind="stable").reset_index(drop=True)
        return frame

    def accounting(self):  # -> pandas.DataFrame
        """`sacct` rows of this job and its steps: elapsed, state, nodes, exit code, restarts."""
        return sacct_frame(self.job_id)

    def plot(self, path: str | os.PathLike | None = None):  # -> matplotlib Figure
        """Loss, PSNR and throughput against step; requeues marked as dashed lines."""
        return plot_metrics({self.job_id: self.metrics()}, path)


# ------------------------------------------------------------------------------ Slurm queries


def _squeue_state(job_id: str) -> str | None:
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    states = [s for s in out.split() if s] if out else []
    return states[0] if states else None


def _sacct_state(job_id: str) -> str | None:
    frame = sacct_frame(job_id)
    if frame.empty:
        return None
    rows = frame[frame["JobID"] == job_id]
    return str(rows.iloc[-1]["State"]).split()[0] if not rows.empty else None


SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Elapsed", "NNodes", "NTasks", "NodeList", "Submit", "Start", "End")


def sacct_frame(job_id: str | None = None, fields: Sequence[str] = SACCT_FIELDS):  # -> pandas.DataFrame
    """sacct output as a DataFrame (empty when accounting is unavailable)."""
    import pandas as pd

    cmd = ["sacct", "-P", "-n", "--duplicates", "-o", ",".join(fields)]
    cmd += ["-j", job_id] if job_id else ["-S", "now-7days"]
    out = _run(cmd)
    rows = [line.split("|") for line in (out or "").splitlines() if line.strip()]
    return pd.DataFrame([r for r in rows if len(r) == len(fields)], columns=list(fields))


def _run(cmd: list[str]) -> str | None:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


# ---------------------------------------------------------------------------------- plotting


def plot_metrics(frames: Mapping[str, Any], path: str | os.PathLike | None = None):  # -> Figure
    """One figure of loss, PSNR and samples/s against step for one or more runs."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("loss", "loss", True), ("psnr", "PSNR (dB)", False), ("samples_per_second", "clips/s", False))
    for label, frame in frames.items():
        if frame.empty:
            continue
        train = frame[frame["event"] == "train"] if "event" in frame else frame
        for ax, (column, title, log) in zip(axes, panels):
            if column in train:
                data = train[["step", column]].dropna()
                ax.plot(data["step"], data[column], label=str(label))
                ax.set_title(title)
                ax.set_xlabel("step")
                if log:
                    ax.set_yscale("log")
        if "event" in frame:
            for _, row in frame[frame["event"] == "requeue"].iterrows():
                for ax in axes:
                    ax.axvline(row["step"], color="tab:red", linestyle="--", alpha=0.7)
                axes[0].annotate(f"requeue ({row['reason']})", (row["step"], 1), xycoords=("data", "axes fraction"),
                                 rotation=90, va="top", ha="right", fontsize=8, color="tab:red")
    if len(frames) > 1:
        axes[0].legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def runs_frame(handles: Sequence[JobHandle], columns: Sequence[str] = ()):  # -> pandas.DataFrame
    """One DataFrame of the metrics of several runs, with each run's swept values as columns."""
    import pandas as pd

    parts = []
    for handle in handles:
        frame = handle.metrics()
        sweep = handle.record.get("sweep", {})
        frame = frame.assign(job_id=handle.job_id, **sweep)
        parts.append(frame)
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return frame[[*columns]] if columns else frame

