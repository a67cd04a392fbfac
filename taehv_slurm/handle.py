"""`JobHandle`: one submitted run — its job's state, logs, events, metrics and accounting, and control
(wait, cancel, requeue). A small object over the modules that know each part: its backend object
(taehv_slurm.backends: state and control), taehv_slurm.slurm (accounting), the run folder's events
(taehv_slurm.common.runfolder), the registry (re-opening a run by job id) and taehv_slurm.reports
(DataFrames, plots, progress display); taehv_slurm.logfollow streams a rank's log.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from taehv_slurm import jobstates, sacct, slurm
from taehv_slurm.backends import backend_named
from taehv_slurm.common.config import ClusterConfig, load_cluster
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.goodput import attempt_rows, frame_of, run_totals
from taehv_slurm.registry import Registry, run_name
from taehv_slurm.reports import describe_requeue, describe_restart, slow_rank_note
from taehv_slurm.runtime.provenance import commit_label, read_attempts

if TYPE_CHECKING:  # only for annotations: importing pandas/matplotlib costs seconds
    import pandas as pd
    import submitit
    from matplotlib.figure import Figure

# What a status reads of a run's metrics, from the file's end: the last lines of each attempt (its pace, for
# ETTR) and of the run (the slow-rank note), at most this many each — the same for a run of any length.
STATUS_LOG_LINES = 1000


class JobHandle:
    """A submitted run: its Slurm/local job and its run folder."""

    def __init__(self, job: submitit.Job, run_dir: str | os.PathLike, cluster: ClusterConfig,
                 record: Mapping[str, Any] | None = None, job_dir: str | os.PathLike | None = None) -> None:
        self.job = job
        self.run_dir = Path(run_dir)
        self.cluster = cluster
        self.record = dict(record or {})
        self.job_dir = Path(job_dir if job_dir is not None else cluster.job_dir)
        self.backend = backend_named(cluster.backend)
        self.backend.watch(self.job_id, self)  # its state is asked with every other handle's
        self._events_read: tuple[Any, list[dict[str, Any]]] | None = None  # (file and window, its events)
        self._registry: Registry | None = None

    # ------------------------------------------------------------------------------- identity
    @classmethod
    def attach(cls, job_id: str | int, job_dir: str | os.PathLike = "runs") -> JobHandle:
        """Re-open a run submitted elsewhere (CLI, another kernel) from the job registry, by its job id or
        by its run name (then its newest job)."""
        rec = Registry.load(job_dir).find(str(job_id).strip())
        base = Path(job_dir)
        # Paths relative to job_dir where recorded (registry readable from any working directory).
        run_dir = base / rec["run"] if "run" in rec else Path(rec["run_dir"])
        folder = base / rec["folder_rel"] if "folder_rel" in rec else Path(rec["folder"])
        cluster = load_cluster(rec["cluster"])
        job = backend_named(rec["backend"]).job(folder, rec["job_id"], list(range(int(rec["world_size"]))))
        return cls(job, run_dir, cluster, {**rec, "folder": str(folder)}, job_dir=base)

    @staticmethod
    def registry(job_dir: str | os.PathLike = "runs") -> pd.DataFrame:
        """Every run submitted to `job_dir` (see `taehv_slurm.reports.registry_frame`)."""
        from taehv_slurm.reports import registry_frame

        return registry_frame(job_dir)

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def name(self) -> str:
        """The run folder relative to job_dir (e.g. 'tiny-demo' or 'lr-sweep/lr=0.0001')."""
        return run_name(self.record) if self.record else self.run_dir.name

    @property
    def sweep(self) -> dict[str, Any]:
        """The swept values of this run ({} for a single run)."""
        return dict(self.record.get("sweep") or {})

    @property
    def total_steps(self) -> int | None:
        steps = ((self.record.get("plan") or {}).get("total_steps")
                 or (self.record.get("train") or {}).get("steps"))
        return int(steps) if steps else None

    def __repr__(self) -> str:
        return f"JobHandle(job_id={self.job_id}, run={self.name!r}, state={self.state})"

    # ---------------------------------------------------------------------------------- state
    @property
    def state(self) -> str:
        """The job's state, Slurm's names on every backend (PENDING, RUNNING, COMPLETED, FAILED,
        CANCELLED, ...): its latest follow-up job's, where it has one (taehv_slurm.followup)."""
        current = self.current_job_id
        return self.backend.state(current, self.folder, self.job if current == self.job_id else None)

    def chain(self) -> list[str]:
        """This job with the jobs it follows and its follow-up jobs: one run's attempts, oldest first."""
        self._registry = self._registry.refresh() if self._registry else Registry.load(self.job_dir)
        return self._registry.chain(self.job_id)

    @property
    def current_job_id(self) -> str:
        """The job that trains the run now, or last did: this one, or its latest follow-up."""
        return self.chain()[-1]

    @property
    def folder(self) -> Path:
        """The submitit folder (pickles, rank logs)."""
        return Path(self.record.get("folder") or self.job.paths.folder)

    def done(self) -> bool:
        return slurm.is_final(self.state)

    def wait(self, timeout_s: float | None = None, poll_s: float = 2.0, progress: bool = True,
             until_step: int | None = None, max_poll_s: float | None = None) -> str:
        """Block until the job ends (or, with `until_step`, until the run logged that step); returns the
        state.

        It looks every `poll_s` seconds while the job changes (state, step, requeues), and 1.5 times
        longer after each look that found nothing new, up to `max_poll_s` (default $TAEHV_POLL_MAX_S, 30 s)
        on Slurm; a job's state is asked with every other handle's (one squeue call for them all).
        The progress display is a bar updated in place in a notebook, tqdm in a terminal, and one plain
        line per change otherwise (logs, CI). Where the Slurm controller stops answering, it waits on the
        job's accounting, with a note on stderr (and another once the controller answers again); where
        sacct fails, likewise.
        """
        from taehv_slurm.reports import Progress

        display = Progress(f"job {self.job_id}", self.total_steps, enabled=progress)
        backoff = self.backoff(poll_s, max_poll_s)
        start, seen, silence = time.monotonic(), None, jobstates.SilenceWatch()
        try:
            while True:
                state = self.state
                silence.tell()
                step = self.last_step()
                now = (state, step, len(self.interruptions()))
                display.update(*now)
                if slurm.is_final(state) or (until_step is not None and (step or 0) >= until_step):
                    return state
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"job {self.job_id} still {state} at step {step} after "
                                       f"{timeout_s:.0f} s")
                time.sleep(backoff.after(now != seen))
                seen = now
        finally:
            display.close()

    def backoff(self, poll_s: float, max_poll_s: float | None = None) -> jobstates.Backoff:
        """A loop's rhythm: slower while nothing changes where a state is a question to a scheduler."""
        return jobstates.Backoff(poll_s, max_poll_s if self.backend.asks_a_scheduler else poll_s)

    def result(self) -> Any:
        return self.job.result()

    def results(self) -> list[Any]:
        return self.job.results()

    def cancel(self) -> None:
        """Cancel the job. Its ranks get SIGTERM first, so the run saves its step before it ends (the
        task records `cancelled`); submitting the run name again resumes from there."""
        current = self.current_job_id
        self.backend.cancel(current, self.folder, self.job if current == self.job_id else None)

    def requeue(self) -> None:
        """Preempt the job as the scheduler would (`scontrol requeue`): it saves, requeues and resumes."""
        self.backend.requeue(self.job_id)

    # ----------------------------------------------------------------------------------- logs
    def log_path(self, rank: int = 0) -> Path:
        return self.folder / f"{self.job_id}_{rank}_log.out"

    def follow(self, rank: int = 0, out: TextIO | None = None, position: int = 0, poll_s: float = 1.0,
               hide_tracebacks: bool = False) -> str:
        """Print the rank's log from byte `position` as it grows until the job ends; returns the final state
        (see `taehv_slurm.logfollow.LogFollower`)."""
        from taehv_slurm.logfollow import LogFollower

        return LogFollower(self, rank, position, hide_tracebacks, poll_s).run(out, poll_s)

    def tail(self, n: int = 20, rank: int = 0) -> str:
        """The last `n` lines of one rank's log (every requeued run appends to the same file)."""
        return self.log_tail(n, rank)[0]

    def log_tail(self, n: int, rank: int = 0) -> tuple[str, int]:
        """(the last `n` lines of the rank's log, the byte offset they end at): following from that offset
        shows nothing twice and skips nothing."""
        path = self.log_path(rank)
        if not path.exists():
            return "", 0
        with path.open("rb") as f:
            size = f.seek(0, io.SEEK_END)
            f.seek(max(0, size - 256 * 1024))
            data = f.read(size - f.tell())
        return "\n".join(data.decode(errors="replace").splitlines()[-n:]), size

    # ------------------------------------------------------------------------------- metrics
    def events(self, run_wide: bool = False) -> list[dict[str, Any]]:
        """This job's events from the run's events (all jobs of the run folder with run_wide).

        A run folder can hold several jobs (a run resubmitted under its name resumes it); a job's events
        are those written between its submission and the next submission to the same folder.
        """
        log = RunFolder(self.run_dir).events()
        if run_wide or "submitted_at" not in self.record:
            return log.read()
        # Read from the end of the file back to the job's start, and again only once the file changed.
        key = (_stamp(log.path), self._time_window())
        if self._events_read is None or self._events_read[0] != key:
            begin, end = key[1]
            self._events_read = key, log.window(since=begin, until=end)
        return list(self._events_read[1])

    def _time_window(self) -> tuple[float, float]:
        """From this job's submission (its chain's first job's) to the next submission of the run."""
        chain = self.chain()
        records = self._registry.of_run(self.name)
        begin = min((float(r["submitted_at"]) for r in records if r["job_id"] in chain),
                    default=float(self.record["submitted_at"]))
        later = [float(r["submitted_at"]) for r in records
                 if r["job_id"] not in chain and float(r["submitted_at"]) > begin]
        return begin, min(later, default=math.inf)

    def interruptions(self, run_wide: bool = False) -> list[dict[str, Any]]:
        """The run's requeues as they happened (Slurm or the local controller accepted each one)."""
        return [e for e in self.events(run_wide) if e["event"] == "requeue"]

    def restarts(self, run_wide: bool = False) -> list[dict[str, Any]]:
        """The restarts of the ranks inside the job's allocation (taehv_slurm.runtime.restart), each with
        `seconds_to_first_step`: from the fault found to the restarted ranks' first step (None until then)."""
        events = self.events(run_wide)
        firsts = {e.get("segment"): e["time"] for e in events if e["event"] == "first_step"}
        return [{**e, "seconds_to_first_step": (round(firsts[e["segment"] + 1] - e["fault_time"], 1)
                                                if e.get("segment") is not None and e["segment"] + 1 in firsts
                                                else None)}
                for e in events if e["event"] == "restart"]

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
        """How often Slurm requeued the job: its allocations in sacct that another attempt followed
        (`sacct.requeue_count`; Slurm 22.05's sacct has no Restarts field); the events file's count where
        there is no accounting."""
        if self.backend.has_accounting:
            frame = self.accounting()
            if not frame.empty:
                return int(frame.attrs.get("requeues", 0))
        return len(self.interruptions())

    @property
    def stop_reason(self) -> str | None:
        """Why the requeue guards stopped the run (requeue limit, no progress), if they did."""
        stopped = [e for e in self.events() if e["event"] == "stopped"]
        return stopped[-1]["reason"] if stopped else None

    @property
    def error(self) -> str | None:
        """Why this job failed, in one line: a rank's error ('RuntimeError: ...'), a requeue Slurm refused,
        or what the local controller saw; None when nothing failed."""
        return self._failure()[1]

    @property
    def failed_rank(self) -> int | None:
        """The rank whose failure is `error` (its log holds the traceback); None when nothing failed."""
        return self._failure()[0]

    def _failure(self) -> tuple[int | None, str | None]:
        events = self.events()
        fatal = [e for e in events if e["event"] == "failure" and e.get("fatal")]
        if fatal:  # a stop the task chose (a diverged run): its own one line
            return fatal[-1].get("rank"), fatal[-1]["error"]
        controller = self.backend.failure(self.job_id, self.folder)
        if (first := controller.get("failed_rank")) is not None:
            # The rank that failed first holds the cause; the others' errors ("connection closed by peer")
            # are its consequence. Without an error of its own (killed, os._exit): the killed record when
            # it names that rank alone (host, signal, step), else the controller's line.
            own = [e["error"] for e in events if e["event"] == "failure" and e.get("rank") == first]
            killed = [e["detail"] for e in events if e["event"] == "killed" and e.get("ranks") == [first]]
            return first, (own or killed or [controller.get("error")])[-1] or None
        for event in reversed(events):
            if event["event"] == "failure":
                return event.get("rank"), event["error"]
            if event["event"] == "killed":
                return (event.get("ranks") or [None])[0], event["detail"]
            if event["event"] == "requeue_failed":
                fix = event.get("fix", "")
                return event.get("rank"), (f"saved step {event['step']} but could not requeue: "
                                           f"{event['error']}; {fix}").rstrip("; ")
        if controller.get("error"):
            return None, controller["error"]
        from taehv_slurm.runtime.checkpoint import Checkpointer

        # nothing recorded: a run folder that cannot be written now says why the job failed
        if (no_room := Checkpointer(RunFolder(self.run_dir).checkpoints).no_room()) is None:
            return None, None
        state = self.state
        return None, no_room if slurm.is_final(state) and not slurm.is_success(state) else None

    def last_step(self) -> int | None:
        """The last step rank 0 logged in this job (a run resubmitted under its name holds later jobs'
        rows too: an older job's step is its own), read from the end of the run's metrics (for an older job,
        from where its successor began)."""
        end = self._time_window()[1] if "submitted_at" in self.record else math.inf
        for row in reversed(RunFolder(self.run_dir).metrics().window(until=end, limit=8, ordered=True)):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                return int(row["step"])
        return None

    def metrics(self) -> pd.DataFrame:
        """The run's metrics, one row per logged step and event, sorted by step:

        event='train': step, time, loss, psnr, samples_per_second, lr, gpu_memory_gb, latent_loss, ...
        event='val': val_loss, val_psnr, ... at validation steps
        event='requeue': the step the run was saved at and resumed from, with its reason
        `time` is a UTC pandas Timestamp; `elapsed_s` counts seconds from the first row.
        """
        from taehv_slurm.reports import metrics_frame

        return metrics_frame(self.run_dir, self.interruptions(run_wide=True))

    def accounting(self, settle_s: float = 10.0) -> pd.DataFrame:
        """`sacct --duplicates` rows of this job and its steps, one allocation row per run attempt.

        Adds `Attempt` (0 for the first run, +1 per requeue; steps carry their allocation's attempt) and
        `ElapsedSeconds`; `frame.attrs['requeues']` counts the allocations another attempt followed.
        slurmdbd records a job's end a moment after squeue shows it: for up to `settle_s` seconds this
        waits until the accounting agrees that an ended job ended.
        """
        return sacct.sacct_frame(self.job_id, records=self._accounting_records(settle_s))

    def _accounting_records(self, settle_s: float = 10.0) -> list[dict[str, Any]]:
        """`accounting()` as sacct's records (`sacct.sacct_records`), without pandas: the process's
        answer (taehv_slurm.jobstates), asked again while it lags behind squeue."""
        chain = self.chain()  # every job of the run's attempts
        records = [r for j in chain for r in jobstates.accounting(chain)[j]]
        deadline = time.monotonic() + settle_s
        while self._accounting_behind(records) and time.monotonic() < deadline:
            time.sleep(0.5)
            answers = jobstates.accounting(chain, max_age_s=0)
            records = [r for j in chain for r in answers[j]]
        return records

    def _accounting_behind(self, records: list[dict[str, Any]]) -> bool:
        state = sacct.last_state(self.current_job_id, records)
        if state is None or slurm.is_final(state):
            return False  # no accounting here (or no record at all), or it has the end already
        current = self.current_job_id
        return slurm.is_final(jobstates.queue_states([current])[current] or "PENDING")

    def goodput(self) -> pd.DataFrame:
        """One row per attempt of this job: allocated node-seconds (sacct's, where the site keeps
        accounting), time to first step, steps kept and productive node-seconds, work lost to each
        interruption, time in saves, and ETTR = productive / allocated (taehv_slurm.goodput); the totals
        are in `frame.attrs`."""
        return frame_of(self._goodput_rows())

    def _goodput_rows(self, recent: bool = False) -> list[dict[str, Any]]:
        """`goodput()`'s rows as plain dicts (taehv_slurm.goodput.attempt_rows), without pandas. recent:
        each attempt's pace from its last STATUS_LOG_LINES log lines (a status), not from all of them."""
        from taehv_slurm.runtime.checkpoint import Checkpointer

        events = self.events()
        rows = [r for r in (self._recent_rows(events) if recent else RunFolder(self.run_dir).metrics().read())
                if "loss" in r]
        accounting = self._accounting_records() if self.backend.has_accounting else []
        final = Checkpointer(RunFolder(self.run_dir).checkpoints).latest_step()
        spares = int((self.record.get("cluster") or {}).get("spare_nodes") or 0)  # held, idle unless needed
        nodes = int(self.record.get("nodes") or 1)
        ranks_per_node = max(1, int(self.record.get("world_size") or nodes) // nodes)
        return attempt_rows(events, rows, nodes + spares, final, accounting, ranks_per_node)

    def _recent_rows(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The last STATUS_LOG_LINES metrics lines of each attempt (from one start event to the next)."""
        log = RunFolder(self.run_dir).metrics()
        began = [float(e.get("began") or e["time"]) for e in events if e["event"] == "start"]
        return [row for since, until in zip(began, [*began[1:], math.inf])
                for row in log.window(since, until, limit=STATUS_LOG_LINES, ordered=True)]

    def config_history(self) -> pd.DataFrame:
        """One row per attempt of this run (every job of its run folder): job id, restart, step it started
        at, hosts, git commit and whether the tree was dirty (the diff is saved beside), versions, what
        changed since the attempt before, and the training config flattened to columns ("optim.lr")."""
        from taehv_slurm.reports import attempts_frame

        return attempts_frame(read_attempts(self.run_dir))

    def summary(self) -> dict[str, Any]:
        """One status row: id, run, state, step/total, requeues, swept values, and why it stopped or
        failed; the note also names a rank named slow that cost the run ≥ SLOW_RANK_NOTE_SHARE of its step
        time in its last STATUS_LOG_LINES log lines (taehv_slurm.reports.slow_rank_note). Its files are
        read from their ends (the events from the job's start, the metrics' last lines of each
        attempt: ETTR's pace): the same cost for a run of a hundred steps and one of a million."""
        # goodput first: its sacct answer also gives the state of a job squeue no longer lists
        totals = run_totals(self._goodput_rows(recent=True)) if "train" in self.record else {}
        step, total = self.last_step(), self.total_steps
        state = self.state
        note = self.stop_reason or (self.error if not slurm.is_success(state) else None) or ""
        requeues, restarts = self.interruptions(), self.restarts()
        unreleased = requeues[-1].get("release_error") if requeues and state == "PENDING" else None
        if unreleased:  # requeued held to move it off a node, and the release failed: it waits for a person
            note = f"held since its requeue ({unreleased}): run `scontrol release {self.job_id}`"
        elif (requeues or restarts) and not note:
            killed = {e.get("segment"): e["detail"] for e in self.events() if e["event"] == "killed"}
            note = "; ".join([*(describe_requeue(e, killed.get(e.get("segment"))) for e in requeues),
                              *map(describe_restart, restarts)])
        recent = RunFolder(self.run_dir).metrics().window(limit=STATUS_LOG_LINES, ordered=True)
        if slow := slow_rank_note(recent):
            note = f"{note}; {slow}" if note else slow
        node_h = round(totals["allocated_node_s"] / 3600, 4) if totals else None
        return {"job_id": self.job_id, "run": self.name, "state": state,
                "nodes": self.record.get("nodes"), "ranks": self.record.get("world_size"),
                "step": step, "steps": total, "requeues": len(requeues), "restarts": len(restarts),
                "commit": commit_label(read_attempts(self.run_dir)), "ettr": totals.get("ettr"),
                "allocated_node_h": node_h,
                "submitted": time.strftime("%Y-%m-%d %H:%M:%S",
                                           time.localtime(self.record.get("submitted_at", 0))),
                **self.sweep, "note": note}

    def plot(self, path: str | os.PathLike | None = None, title: str | None = None) -> Figure:
        """Loss, PSNR and throughput against step; requeues marked as dashed lines."""
        nodes, ranks = self.record.get("nodes"), self.record.get("world_size")
        shape = f" · {nodes} node(s) × {ranks // nodes} ranks" if nodes and ranks else ""
        label = title or f"job {self.job_id} · run {self.name}{shape}"
        from taehv_slurm.reports import plot_metrics

        return plot_metrics({label: self.metrics()}, path, title=label)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells a file changed (inode, size, modification time); None where it does not exist."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns
