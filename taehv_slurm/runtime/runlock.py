"""One live job per run folder.

Two jobs training one folder would both resume from the same step and write the same checkpoints and
metrics. `submit()` refuses a run whose job is still pending or running; this lock is the second line,
for jobs started any other way (another job_dir's registry, `make_executor` by hand): rank 0 of a job
takes the run's lock, `RunFolder.lock` (created exclusively) before training, and a job finds the lock
free, held by itself (a requeued run of the same job), or held by a job that has ended (then it takes it
over). A lock held by a live job — or by a job whose state cannot be learned — is refused in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any

from taehv_slurm.common.messages import command
from taehv_slurm.common.runfolder import RunFolder
from taehv_slurm.runtime.rank_backend import RankBackend


class RunLockedError(RuntimeError):
    """Another live job trains this run folder; the message names it and what to do."""


class RunLock:
    """The lock of one run folder, taken by rank 0 of job `job_id`; `backend` learns whether a holder
    lives."""

    def __init__(self, run_dir: str | os.PathLike, job_id: str, backend: RankBackend) -> None:
        self.path = RunFolder(run_dir).lock
        self.job_id, self.backend = str(job_id), backend

    def acquire(self) -> None:
        record = json.dumps({"job_id": self.job_id, "backend": self.backend.name,
                             "host": socket.gethostname(), "pid": os.getpid(),
                             "folder": os.environ.get("SUBMITIT_FOLDER", ""), "time": time.time()})
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                holder = self.holder()
                if holder is not None and str(holder.get("job_id")) != self.job_id:
                    busy = self.backend.lock_holder_live(holder)
                    if busy:
                        raise RunLockedError(f"run folder {self.path.parent} is trained by {busy}: "
                                             "two jobs must never train "
                                             "one folder; follow or cancel that job "
                                             f"({command('logs')} / {command('cancel')} "
                                             f"{holder.get('job_id')}), "
                                             "or use another run name") from None
                with contextlib.suppress(FileNotFoundError):  # ours from an earlier run, or its job ended
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(record + "\n")
            return
        raise RunLockedError(f"could not take {self.path}: other jobs keep taking it; "
                             "check which jobs use this run folder")

    def release(self) -> None:
        holder = self.holder()
        if holder is not None and str(holder.get("job_id")) == self.job_id:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def holder(self) -> dict[str, Any] | None:
        return lock_holder(self.path.parent)


def lock_holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The record of the job holding `run_dir`'s lock; None when free, {} when unreadable (counts as
    ended)."""
    try:
        return json.loads(RunFolder(run_dir).lock.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, OSError):
        return {}  # unreadable: no job can be named, so it counts as ended
