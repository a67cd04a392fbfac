"""What a job's ranks ask of the system that runs them, as one object handed to them.

`RankBackend` is the interface and the behaviour of a task in this very process (nothing requeues it).
The submitting side's backends (taehv_slurm.backends: Slurm, local, platform) extend it and travel in
the job's pickle inside `RequeueableTask`, so rank-side code never branches on a backend's name and
never imports the submitting side.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Outcome:
    """What happened to the job after every rank saved at a signal or a rank crashed: the event to record
    (requeue, cancelled, requeue_failed, exited_for_restart, step_ended) and its fields."""

    event: str
    fields: dict[str, Any]


class RankBackend:
    """A task in this process: nothing restarts it, so a signal ends it after the save."""

    name: ClassVar[str] = "debug"
    requeue_exit_code: ClassVar[int] = 0  # a rank's exit code once its job will be restarted
    restarts_after_failure: ClassVar[bool] = False  # a crashed rank can requeue the job

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def cannot_requeue_reason(self, host: str) -> str | None:
        """Why this job could never requeue itself from `host` (one line with the fix), or None."""
        return None

    def settle(self, job_id: str, restart_count: int, reason: str, deadline: float) -> Outcome:
        """After every rank saved at a signal (rank 0, before `deadline`): what happens to the job."""
        return Outcome("exited_for_restart", {"reason": reason})

    def requeue_after_failure(self, job_id: str, exclude: Sequence[str] = ()) -> Outcome:
        """A rank crashed mid-training: requeue the job (without the `exclude` nodes where the backend can
        leave nodes out), or say why not (requeue_failed)."""
        return Outcome("requeue_failed", {"error": f"the {self.name} backend cannot requeue a job",
                                          "fix": "submit the run again with the same name to resume"})

    def end_step(self) -> None:
        """End this rank's job step at once, every rank of it (a hang or a failure found here, where the job
        starts its ranks again by itself): nothing to do where the ranks are not a job step."""

    def allocation_state(self, job_id: str, attempt: int) -> str | None:
        """How the scheduler's accounting says the job's allocation `attempt` (0: its first run) ended (e.g.
        NODE_FAIL); None where there is none."""
        return None

    def seconds_left(self, job_id: str) -> float | None:
        """Seconds until the job's time limit, None when unknown or unlimited."""
        return None

    def release_nodes(self, job_id: str, nodes: Sequence[str]) -> dict[str, Any]:
        """Give `nodes` of the running job's allocation back (nodes a restart left out): the restart
        event's fields, `released` or `release_error`; nothing where the backend holds no allocation."""
        return {}

    def lock_holder_live(self, holder: dict[str, Any]) -> str | None:
        """'job 123 (RUNNING)' while the job recorded in a run lock (of any backend) may still run, else
        None."""
        return self.describe_live(holder) if holder.get("job_id") else None

    def describe_live(self, holder: dict[str, Any]) -> str | None:
        """'process 123 (debug)' while the job that wrote this run-lock record may still run, else None."""
        if holder.get("host") != socket.gethostname():
            return (f"{holder.get('backend')} job {holder.get('job_id')} on {holder.get('host')} "
                    "(not this machine, "
                    "so its state cannot be learned)")
        pid = int(holder.get("pid") or 0)
        if pid <= 0:
            return None
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError, ValueError):
            return None
        return f"process {pid} ({holder.get('backend')})"
