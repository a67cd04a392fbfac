"""The local backend's controller: a job's ranks as processes on this machine, ending in Slurm's states.

The controller (`python -m taehv_slurm.runtime.controller FOLDER`, one per job, started by
`taehv_slurm.executor.LocalExecutor`; its pid and start second make the job id) runs the ranks under a
`Supervisor` and
behaves as Slurm does, so a run behaves the same here as on a cluster:

- a rank that raises ends the job FAILED (the others are stopped at once) and the controller exits 1;
- SIGTERM to the controller (`taehv cancel`, `JobHandle.cancel`, or Ctrl-C in `taehv submit --local`)
  is a cancel: every rank saves at its next step boundary, then the job ends CANCELLED and the same
  `--name` resumes it;
- a rank that saved and asked to be requeued (exit code LOCAL_REQUEUE_EXIT_CODE) restarts the job;
- the time limit: USR2 `signal_delay_s` before it (the ranks save and requeue), SIGTERM at it.

The controller and its ranks run in their own session: closing the terminal or pressing Ctrl-C does
not kill them unsaved. What happened is written to `<folder>/<job_id>_local.json` (state, restarts,
exit codes, the failure), which `job_state` reads — from any process, not only the one that submitted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from taehv_slurm.common.runfolder import write_text_atomic
from taehv_slurm.common.submitit_api import JobPaths
from taehv_slurm.runtime.supervisor import RankCommand, Supervisor

LOCAL_REQUEUE_EXIT_CODE = 144  # a rank saved and asks for a restart (submitit's local requeue code)
ACTIVE_STATES = ("RUNNING", "CANCELLING")


# ------------------------------------------------------------------------------------------ state


def state_path(folder: str | os.PathLike, job_id: str) -> Path:
    return Path(folder) / f"{job_id}_local.json"


def local_job_id(pid: int, started: str) -> str:
    """'48213-sj2k9d': the controller's pid and its start second in base 36. The pid alone wraps and is
    reused, and a reused id would shadow an older job of the same run folder."""
    return f"{pid}-{started}"


def start_mark(now: float | None = None) -> str:
    """The start second in base 36 (6 digits until 2039, 7 after: ids never repeat)."""
    n, digits = int(time.time() if now is None else now), ""
    while n:
        n, r = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
    return digits or "0"


def controller_pid(job_id: str) -> int:
    """The controller's pid in a local job id (ids of older versions are the bare pid)."""
    return int(str(job_id).split("-", 1)[0])


def job_state(folder: str | os.PathLike, job_id: str) -> dict[str, Any]:
    """{"state": RUNNING | CANCELLING | COMPLETED | FAILED | CANCELLED | TIMEOUT | PENDING, ...} of a local
    job.

    A controller that is gone while its file still says RUNNING died without a word (killed with
    SIGKILL, the machine rebooted): that job is FAILED.
    """
    try:
        info = json.loads(state_path(folder, job_id).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        info = {"state": "PENDING"}  # the controller has not written its first state yet
        if not _controller_alive(folder, job_id):
            return {"state": "FAILED",
                    "error": f"the local controller of job {job_id} is gone and left no state"}
    if info["state"] in (*ACTIVE_STATES, "PENDING") and not _controller_alive(folder, job_id):
        return {**info, "state": "FAILED",
                "error": f"the local controller of job {job_id} died while the job ran"}
    return info


def cancel(folder: str | os.PathLike, job_id: str) -> bool:
    """Ask a running local job to save and end CANCELLED (SIGTERM to its controller); False if it was not
    running."""
    if job_state(folder, job_id)["state"] not in (*ACTIVE_STATES, "PENDING"):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(controller_pid(job_id), signal.SIGTERM)
        return True
    return False


def _controller_alive(folder: str | os.PathLike, job_id: str) -> bool:
    """The pid is alive AND is the controller of this folder (pids are reused). Right after the start it
    may still be the shell that runs the setup lines and then execs the controller: same pid, same words."""
    try:
        cmdline = Path(f"/proc/{controller_pid(job_id)}/cmdline").read_bytes().replace(b"\0", b" ")
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return False
    return b"taehv_slurm.runtime.controller" in cmdline and str(folder).encode() in cmdline


# ------------------------------------------------------------------------------------- controller


class Controller:
    """Runs in the controller process: start the ranks, restart them on a requeue, record the outcome."""

    def __init__(self, folder: Path, environ: dict[str, str]) -> None:
        self.folder = folder
        self.job_id = local_job_id(os.getpid(), environ["TAEHV_LOCAL_STARTED"])
        self.ntasks = int(environ["SUBMITIT_LOCAL_NTASKS"])
        self.command = shlex.split(environ["SUBMITIT_LOCAL_COMMAND"])
        self.timeout_s = float(environ["SUBMITIT_LOCAL_TIMEOUT_S"])
        self.signal_delay_s = float(environ["SUBMITIT_LOCAL_SIGNAL_DELAY_S"])
        self.max_restarts = int(environ.get("TAEHV_LOCAL_MAX_RESTARTS", "20"))
        self.environ = environ
        self.restarts = 0
        self.cancelled = False
        self.supervisor = Supervisor(float(environ.get("TAEHV_LOCAL_GRACE_S", "30")),
                                     requeue_code=LOCAL_REQUEUE_EXIT_CODE, say=self.say,
                                     on_stop=self.mark_cancelled)
        self._log: Any = None

    def say(self, text: str) -> None:
        line = f"[taehv local job {self.job_id}] {text}\n"
        (self._log or sys.stdout).write(line)
        (self._log or sys.stdout).flush()

    def write_state(self, state: str, **extra: Any) -> None:
        info = {"state": state, "job_id": self.job_id, "restarts": self.restarts, "time": time.time(),
                **extra}
        write_text_atomic(state_path(self.folder, self.job_id), json.dumps(info) + "\n", 0o600)

    def mark_cancelled(self, _signum: int = signal.SIGTERM, _frame: Any = None) -> None:
        """A SIGTERM/SIGINT from outside: recorded before the ranks hear of it, so they know it is a
        cancel."""
        if not self.cancelled:
            self.cancelled = True
            self.write_state("CANCELLING")

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):  # between two runs of the ranks (the supervisor's own
            signal.signal(sig, self.mark_cancelled)  # handlers take over while they run)
        self.write_state("RUNNING")
        while True:
            outcome = self._run_once()
            restart = outcome.requeue and outcome.failed is None and not self.cancelled
            if outcome.failed is not None and not self.cancelled:  # as the sbatch script does after srun
                restart = self._after_ranks(outcome) == LOCAL_REQUEUE_EXIT_CODE
            if restart and self.restarts < self.max_restarts:
                self.restarts += 1
                self.write_state("RUNNING")
                continue
            break
        labels = [f"rank {i}" for i in range(self.ntasks)]
        codes = outcome.exit_codes
        if self.cancelled:
            state = "CANCELLED"
        elif (outcome.failed is not None or any(c not in (0, LOCAL_REQUEUE_EXIT_CODE) for c in codes)
              or outcome.killed):
            state = "FAILED"
        elif outcome.timed_out or outcome.requeue:
            state = "TIMEOUT" if outcome.timed_out else "FAILED"  # a requeue past max_restarts
        else:
            state = "COMPLETED"
        error = outcome.describe_failure(labels) or (f"ranks exited with codes {codes}" if state == "FAILED"
                                                     else "")
        self.write_state(state, exit_codes=codes, error=error, failed_rank=outcome.failed)
        self.say(f"ended {state}" + (f": {error}" if error else ""))
        return 0 if state == "COMPLETED" else 1

    def _after_ranks(self, outcome: Any) -> int:
        """The entry point once more, with the first failed rank's status (128 + N for signal N), to record
        what the ranks could not; its exit code is the requeue code when it requeued the job."""
        code = outcome.exit_codes[outcome.failed]
        status = 128 - code if code is not None and code < 0 else (code or 1)
        module = self.command.index("taehv_slurm.runtime.entry") + 1
        argv = [*self.command[:module], "--after", str(status), *self.command[module:]]
        environ = {**self.environ, "SUBMITIT_LOCAL_LOCALID": "0", "SUBMITIT_LOCAL_GLOBALID": "0",
                   "SUBMITIT_LOCAL_JOB_ID": self.job_id, "TAEHV_RESTART_COUNT": str(self.restarts)}
        with JobPaths(self.folder, self.job_id, 0).stdout.open("a") as log:
            return subprocess.run(argv, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL).returncode

    def _run_once(self):
        paths = [JobPaths(self.folder, self.job_id, k) for k in range(self.ntasks)]
        logs = [p.stdout.open("a", buffering=1) for p in paths]
        self._log = logs[0]
        try:
            commands = [RankCommand(self.command, {**self.environ, "SUBMITIT_LOCAL_LOCALID": str(k),
                                                   "SUBMITIT_LOCAL_GLOBALID": str(k),
                                                   "SUBMITIT_LOCAL_JOB_ID": self.job_id,
                                                   "TAEHV_RESTART_COUNT": str(self.restarts)},
                                    stdout=logs[k], label=f"rank {k}") for k in range(self.ntasks)]
            deadlines = [(self.timeout_s - self.signal_delay_s, signal.SIGUSR2),
                         (self.timeout_s, signal.SIGTERM)]
            if self.cancelled:  # cancelled while the ranks were restarting
                return self.supervisor.outcome
            return self.supervisor.run(commands, deadlines)
        finally:
            self._log = None
            for log in logs:
                log.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m taehv_slurm.runtime.controller SUBMITIT_FOLDER", file=sys.stderr)
        return 2
    return Controller(Path(args[0]), dict(os.environ)).run()


if __name__ == "__main__":
    sys.exit(main())
