"""One object per kind of backend, for everything that depends on where a job runs.

- `SlurmBackend`: sbatch, squeue/sacct, `scontrol requeue`.
- `LocalBackend`: ranks as processes on this machine under our controller (taehv_slurm.runtime.controller),
  which ends jobs in Slurm's states and restarts the ranks when one exits with its requeue code.
- `PlatformBackend`: a container platform (Kubernetes Job, ...) that restarts the node's process itself.
- `DirectBackend`: a task in this very process (submitit's debug executor, or a task called by hand).

The submitting side asks a backend for a job's state, to cancel or requeue it, and whether Slurm can be
used from here; the job's ranks ask the same object (it travels in the job's pickle, inside
`RequeueableTask`) what happens after every rank saved at a signal, whether a crashed job can be
requeued, and whether the job holding a run folder's lock still runs. No other module branches on a
backend's name. Standard library only at import time: the ranks unpickle it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from taehv_slurm import followup, jobstates, sacct, slurm
from taehv_slurm.common.config import ClusterConfig
from taehv_slurm.runtime import controller
from taehv_slurm.runtime.rank_backend import Outcome, RankBackend
from taehv_slurm.runtime.steps import in_step_loop

SETTLE_TIMEOUT_CAP_S = 15.0  # one scontrol question may take at most this (an unreachable controller hangs)


class JobControlError(RuntimeError):
    """A command on a job (scontrol requeue) failed or cannot apply to this backend; the message is
    one line."""


class Backend(RankBackend):
    """What the submitting side asks of a backend; the rank side is `RankBackend`'s. Defaults: a task
    in this process (submitit's debug executor)."""

    runs_here: ClassVar[bool] = True  # the job runs on this machine (config.MACHINE_BACKENDS)
    has_accounting: ClassVar[bool] = False  # sacct knows the job
    writes_sbatch_script: ClassVar[bool] = False
    cancel_on_interrupt: ClassVar[bool] = False  # Ctrl-C while following stops the job (it saves first)
    asks_a_scheduler: ClassVar[bool] = False  # a state is a question to a scheduler: polls slow down

    def unavailable_reason(self) -> str | None:
        """Why jobs cannot be submitted from here, in one line (None: they can)."""
        return None

    def state(self, job_id: str, folder: Path, job: Any = None) -> str:
        """The job's state in Slurm's words (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...)."""
        return str(job.state).upper() if job is not None else "UNKNOWN"

    def watch(self, job_id: str, owner: object) -> None:
        """Ask for this job's state with the others' while `owner` (its JobHandle) lives."""

    def prefetch(self, job_ids: Sequence[str]) -> None:
        """Ask once for the state and accounting of all these jobs (what follows reads the answer)."""

    def cancel(self, job_id: str, folder: Path, job: Any = None) -> None:
        if job is not None:
            job.cancel(check=False)

    def requeue(self, job_id: str) -> None:
        """Preempt the job as a scheduler would: it saves, requeues and resumes."""
        raise JobControlError(f"job {job_id} runs on the {self.name} backend; requeue needs Slurm")

    def job(self, folder: Path, job_id: str, tasks: list[int]) -> Any:
        """A submitit job object for the results of a job submitted earlier."""
        import submitit

        return submitit.LocalJob(folder=folder, job_id=job_id, tasks=tasks)

    def failure(self, job_id: str, folder: Path) -> dict[str, Any]:
        """What the backend itself saw of a failure (the rank that failed first, its error); {} if nothing."""
        return {}

    def lock_holder_live(self, holder: dict[str, Any]) -> str | None:
        return describe_live(holder)

    def for_jobs_of(self, cluster: ClusterConfig) -> Backend:
        """The object that travels in the jobs of `cluster` (with what it needs of the config)."""
        return self


class DirectBackend(Backend):
    """A task in this process: submitit's debug executor (cluster config `backend: debug`)."""


class PlatformBackend(Backend):
    """A container platform that starts one process per node and restarts it when it exits (taehv launch)."""

    name = "platform"
    runs_here = False


class LocalBackend(Backend):
    """Ranks as processes on this machine, under our controller (see taehv_slurm.runtime.controller)."""

    name = "local"
    cancel_on_interrupt = True
    requeue_exit_code = controller.LOCAL_REQUEUE_EXIT_CODE
    restarts_after_failure = True

    def state(self, job_id: str, folder: Path, job: Any = None) -> str:
        return controller.job_state(folder, job_id)["state"]

    def cancel(self, job_id: str, folder: Path, job: Any = None) -> None:
        controller.cancel(folder, job_id)

    def failure(self, job_id: str, folder: Path) -> dict[str, Any]:
        return controller.job_state(folder, job_id)

    def settle(self, job_id: str, restart_count: int, reason: str, deadline: float) -> Outcome:
        if self.state(job_id, Path(os.environ.get("SUBMITIT_FOLDER", ""))) == "CANCELLING":
            return Outcome("cancelled", {"reason": "cancelled"})
        return Outcome("requeue", {"reason": reason, "by": "local controller", "seconds_lost": 0.0})

    def requeue_after_failure(self, job_id: str, exclude: Sequence[str] = ()) -> Outcome:
        # The controller restarts every rank when one exits with its requeue code (one machine: no exclusion).
        return Outcome("requeue", {"by": "local controller"})

    def describe_live(self, holder: dict[str, Any]) -> str | None:
        if holder.get("host") != socket.gethostname():
            return super().describe_live(holder)
        job_id = str(holder.get("job_id", ""))
        state = self.state(job_id, Path(holder.get("folder", "")))
        return f"local job {job_id} ({state})" if state in (*controller.ACTIVE_STATES, "PENDING") else None


class SlurmBackend(Backend):
    """Jobs submitted with sbatch; every question goes through taehv_slurm.slurm.

    requeue: how a job goes on after a preemption, the time limit or a fault — `self` (`scontrol requeue`),
    `follow_up` (its next attempt submitted as a new job, taehv_slurm.followup) or `auto` (self, and a
    follow-up where Slurm refuses the requeue); job_dir: the registry a follow-up job is recorded in."""

    name = "slurm"
    runs_here = False
    has_accounting = True
    writes_sbatch_script = True
    restarts_after_failure = True
    asks_a_scheduler = True

    def __init__(self, requeue: str = "self", job_dir: str | None = None) -> None:
        self.requeue_mode, self.job_dir = requeue, job_dir

    def for_jobs_of(self, cluster: ClusterConfig) -> SlurmBackend:
        return SlurmBackend(cluster.requeue, os.path.abspath(cluster.job_dir))

    def _mode(self) -> str:
        return getattr(self, "requeue_mode", "self")  # a job queued by older code: scontrol requeue

    def unavailable_reason(self) -> str | None:
        return slurm.no_slurm_reason(probe=True)

    def state(self, job_id: str, folder: Path, job: Any = None) -> str:
        return slurm.job_state(job_id) or "UNKNOWN"

    def watch(self, job_id: str, owner: object) -> None:
        jobstates.watch(job_id, owner)

    def prefetch(self, job_ids: Sequence[str]) -> None:
        """One sacct call (every attempt of every job, and the state of those squeue no longer lists), then
        one squeue call."""
        jobstates.accounting(job_ids)
        jobstates.job_states(job_ids)

    def cancel(self, job_id: str, folder: Path, job: Any = None) -> None:
        slurm.run(["scancel", job_id], timeout_s=60)
        jobstates.forget(job_id)

    def requeue(self, job_id: str) -> None:
        answer = slurm.requeue(job_id)
        jobstates.forget(job_id)
        if not answer.ok:
            raise JobControlError(f"scontrol requeue {job_id} failed: {answer.error}")

    def job(self, folder: Path, job_id: str, tasks: list[int]) -> Any:
        import submitit

        return submitit.SlurmJob(folder=folder, job_id=job_id, tasks=tasks)

    def cannot_requeue_reason(self, host: str) -> str | None:
        return slurm.scontrol_missing(host)

    def settle(self, job_id: str, restart_count: int, reason: str, deadline: float) -> Outcome:
        """Slurm's commands get what is left of the signal's grace: an unreachable controller makes
        scontrol wait for tens of seconds, and the watchdog must not end the rank first."""
        import time

        info = slurm.job_info(job_id,
                              timeout_s=max(1.0, min(SETTLE_TIMEOUT_CAP_S, (deadline - time.time()) / 2)))
        if isinstance(info, dict):
            if int(info.get("Restarts") or 0) > restart_count:
                return Outcome("requeue", {"reason": reason, "by": "slurm", "seconds_lost": 0.0})
            if info.get("Reason") == "TimeLimit" or slurm.past_its_end_time(info, time.time()):
                reason = "timeout"  # SIGTERM at the time limit: the warning never came (signal_delay_s)
            elif info.get("JobState") in ("COMPLETING", "CANCELLED"):
                return Outcome("cancelled", {"reason": "cancelled"})
        if reason == "preempted" and in_step_loop() and self._mode() != "follow_up":
            # A SIGTERM that is no job event: the job step alone ends (a peer died, srun ends the rest); the
            # batch script decides what follows. USR2, the time-limit warning, still requeues. Where Slurm
            # never requeues the job, a SIGTERM may be a preemption that ends it (PreemptMode=CANCEL): it goes
            # on as a follow-up job, which starts only if this one does not complete.
            return Outcome("step_ended", {"reason": reason})
        return self._requeue(job_id, {"reason": reason, "seconds_lost": 0.0},
                             timeout_s=max(1.0, deadline - time.time()))

    def _requeue(self, job_id: str, fields: dict[str, Any], timeout_s: float = 60.0,
                 exclude: Sequence[str] = ()) -> Outcome:
        """`scontrol requeue` (mode self, auto), or the next attempt as a follow-up job (follow_up, and auto
        where the cluster refused the requeue; an unreachable controller fails it as in mode self)."""
        refused = None
        if self._mode() != "follow_up":
            answer = slurm.requeue(job_id, timeout_s=timeout_s, survive_term=True)
            if answer.ok:
                return Outcome("requeue", {**fields, "by": "self"})
            if self._mode() == "self" or not slurm.refuses_requeue(answer.error):
                return Outcome("requeue_failed", {**fields, "error": f"scontrol requeue: {answer.error}",
                                                  "fix": slurm.requeue_fix(answer.error)})
            refused = f"scontrol requeue: {answer.error}"
        return followup.submit(job_id, self.job_dir, fields, exclude, refused)

    def allocation_state(self, job_id: str, attempt: int) -> str | None:
        records = sacct.sacct_records(job_id, ("JobID", "State"))
        return sacct.last_state(job_id, [r for r in records if r["Attempt"] == attempt])

    def end_step(self) -> None:
        step = os.environ.get("SLURM_STEP_ID")
        job = os.environ.get("SLURM_JOB_ID")
        if job and step:
            answer = slurm.kill_step(job, step)
            if not answer.ok:
                print(f"[taehv] could not end job step {job}.{step}: {answer.error}", flush=True)

    def seconds_left(self, job_id: str) -> float | None:
        import time

        info = slurm.job_info(job_id, survive_term=True)
        return slurm.seconds_left(info, time.time()) if isinstance(info, dict) else None

    def release_nodes(self, job_id: str, nodes: Sequence[str]) -> dict[str, Any]:
        """Shrink the running job's allocation by `nodes` (`scontrol update JobId= NodeList=`): they go
        back to the cluster instead of sitting idle until the job ends. The batch script's node stays (its
        ranks are not placed there again either). A requeued job asks for its full size again. The restart
        event's fields: `released` and `nodes_held`, or `release_error`."""
        info = slurm.job_info(job_id)
        if not isinstance(info, dict):
            return {"release_error": f"scontrol show job: {info.error}"}
        held = slurm.expand_hosts(info.get("NodeList"))
        drop = [n for n in dict.fromkeys(nodes) if n in held and n != info.get("BatchHost")]
        if not drop:
            return {}
        answer = slurm.shrink_job(job_id, [n for n in held if n not in drop])
        if not answer.ok:
            return {"release_error": f"scontrol update JobId={job_id} NodeList=...: {answer.error}"}
        return {"released": drop, "nodes_held": len(held) - len(drop)}

    def requeue_after_failure(self, job_id: str, exclude: Sequence[str] = ()) -> Outcome:
        if exclude and self._mode() == "follow_up":
            return followup.submit(job_id, self.job_dir, {}, exclude)
        if exclude:
            return self._requeue_excluding(job_id, exclude)
        return self._requeue(job_id, {})

    def _requeue_excluding(self, job_id: str, nodes: Sequence[str]) -> Outcome:
        """Requeue the job so that its next attempt runs elsewhere: held while its ExcNodeList grows by
        `nodes` (Slurm only lets a pending job's list change), then released; the list is read back. Never
        so many that the partition could no longer hold the job (then only the first ones)."""
        info = slurm.job_info(job_id)
        if not isinstance(info, dict):
            return Outcome("requeue_failed", {"error": f"scontrol show job: {info.error}",
                                              "fix": slurm.requeue_fix(info.error)})
        before = slurm.expand_hosts(info.get("ExcNodeList"))
        # the job's full size: a restart that gave nodes back lowered NumNodes, not what a requeue asks for
        size = max(int(info.get("NumNodes") or 1), int(os.environ.get("SLURM_JOB_NUM_NODES") or 1))
        room = slurm.partition_size(info.get("Partition", "")) - size - len(before)
        wanted = [n for n in dict.fromkeys(nodes) if n not in before][: max(0, room)]
        answer = slurm.requeue(job_id, hold=True, survive_term=True)
        if not answer.ok and self._mode() == "auto" and slurm.refuses_requeue(answer.error):
            return followup.submit(job_id, self.job_dir, {}, nodes, f"scontrol requeuehold: {answer.error}")
        if not answer.ok:
            return Outcome("requeue_failed", {"error": f"scontrol requeuehold: {answer.error}",
                                              "fix": slurm.requeue_fix(answer.error)})
        # From here Slurm is ending this job's processes (SIGTERM), this one's children included: the
        # commands that finish the exclusion ignore it too.
        update = (slurm.update_job(job_id, survive_term=True, ExcNodeList=",".join(before + wanted))
                  if wanted else None)
        released = slurm.run_scontrol("release", job_id, survive_term=True)
        after = slurm.job_info(job_id, survive_term=True)
        excluded = slurm.expand_hosts(after.get("ExcNodeList")) if isinstance(after, dict) else []
        fields: dict[str, Any] = {"by": "self", "excluded": excluded, "excluded_now": [n for n in wanted
                                                                                      if n in excluded]}
        if update is not None and not update.ok:
            fields["exclusion_error"] = update.error
        if len(wanted) < len(set(nodes) - set(before)):
            fields["exclusion_capped"] = "the partition must still hold the job"
        if not released.ok:
            fields["release_error"] = f"scontrol release {job_id}: {released.error}"
        return Outcome("requeue", fields)

    def describe_live(self, holder: dict[str, Any]) -> str | None:
        job_id = str(holder.get("job_id", ""))
        answer = slurm.squeue_answer(job_id)
        if answer.ok:
            state = (answer.output.split() or [""])[0]
            return f"job {job_id} ({state})" if state and not slurm.is_final(state) else None
        if "invalid job id" in answer.error.lower():
            return None  # Slurm no longer knows it: long over
        return f"job {job_id} (its state cannot be learned: {answer.error})"


BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (SlurmBackend, LocalBackend, PlatformBackend,
                                                                DirectBackend)}


def backend_named(name: str | None) -> Backend:
    """The backend object for a config's or a record's `backend` name (unknown or missing: direct)."""
    return BACKENDS.get(name or "", DirectBackend)()


def describe_live(holder: dict[str, Any]) -> str | None:
    """'job 123 (RUNNING)' while the job recorded in a run lock may still run, None once it certainly
    ended."""
    if not holder.get("job_id"):
        return None
    return backend_named(holder.get("backend")).describe_live(holder)

