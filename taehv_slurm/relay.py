"""The job's Slurm relay: the Slurm commands a job needs at a fault, run outside any container.

A rank inside a container image (Pyxis/enroot, Apptainer, Charliecloud) usually finds no `scontrol`, no
slurm.conf and no munge socket. So every job's batch script starts this relay on its batch host, outside
the container, before the ranks, and the ranks send it each Slurm command they would have run
(taehv_slurm.slurm.run does, when TAEHV_SLURM_RELAY is set): what Slurm does with the job after a signal,
`scontrol requeue`, `requeuehold` + ExcNodeList + `release`, ending a job step, the run lock holder's state,
a follow-up job's sbatch. The rank decides as before; the command runs here, in the batch script's
allocation, with the batch script's environment and `scontrol`.

One TCP connection per command: a JSON line {token, argv, timeout_s, survive_term} answered by a JSON line
{ok, output, error} (taehv_slurm.slurm.Answer). The token is random and lives only in the job's environment
(readable by its owner alone); only Slurm's client commands are run (`RELAYED`).

It ignores SIGTERM — Slurm's SIGTERM at a preemption or a requeue reaches every process of the job, and the
ranks still need the relay while they save — and ends when the batch script ends the job (USR1 from its
`taehv_exit`), or LINGER seconds after the batch script is gone (a signal ended it: Slurm kills what is
left of the job KillWait after its SIGTERM; the linger outlasts that).

    relay=$(python -m taehv_slurm.relay start FOLDER $$ LINGER) || exit 1; eval "$relay"
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import shutil
import signal
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from taehv_slurm import slurm

RELAYED = frozenset({"scontrol", "squeue", "sacct", "scancel", "sinfo", "sbatch"})
READY_TIMEOUT_S = 30.0
MAX_REQUEST_BYTES = 1 << 20


def resolve(name: str) -> str | None:
    """The Slurm command `name` here: beside the scontrol the job found when it started, else on PATH."""
    binary = slurm.scontrol()
    if name == "scontrol":
        return binary
    beside = os.path.join(os.path.dirname(binary), name) if binary else ""
    return beside if beside and os.access(beside, os.X_OK) else shutil.which(name)


def answer(request: dict[str, Any], token: str) -> slurm.Answer:
    """Run one relayed command: refused unless the token matches and it is one of Slurm's clients."""
    if not hmac.compare_digest(str(request.get("token", "")), token):
        return slurm.Answer(False, error="the Slurm relay refused a request without the job's token")
    argv = [str(a) for a in request.get("argv") or []]
    name = os.path.basename(argv[0]) if argv else ""
    if name not in RELAYED:
        return slurm.Answer(False, error=f"the Slurm relay runs only Slurm's commands, not {name!r}")
    binary = resolve(name)
    if binary is None:
        return slurm.Answer(False, error=f"{name} not found where the batch script runs "
                                         f"({socket.gethostname()}): not installed there, or not on PATH")
    return slurm.run_here([binary, *argv[1:]], timeout_s=float(request.get("timeout_s") or 60),
                          survive_term=bool(request.get("survive_term")), cwd=request.get("cwd"),
                          outside_job=bool(request.get("outside_job")))


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        try:
            request = json.loads(self.rfile.readline(MAX_REQUEST_BYTES))
            reply = answer(request, self.server.token)  # type: ignore[attr-defined]
        except (ValueError, TypeError) as err:
            reply = slurm.Answer(False, error=f"the Slurm relay could not read a request: {err}")
        self.wfile.write(json.dumps(reply.__dict__).encode() + b"\n")


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, token: str) -> None:
        super().__init__(("", 0), Handler)
        self.token = token


def serve(server: Server, batch_pid: int, linger_s: float) -> None:
    """Answer until the batch script says so (USR1), or `linger_s` after it is gone."""
    done = threading.Event()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda *_: done.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gone_at = None
    while not done.wait(1.0):
        if gone_at is None and not alive(batch_pid):
            gone_at = time.monotonic()
        if gone_at is not None and time.monotonic() - gone_at > linger_s:
            break
    server.shutdown()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start(folder: Path, batch_pid: int, linger_s: float) -> str:
    """Start the relay as a process of its own (its output to FOLDER/slurm_relay_<pid>.log) and return the
    shell lines that point the job's ranks at it and stop it when the batch script exits."""
    token = secrets.token_hex(16)
    server = Server(token)  # bound here, so the port is known before the fork
    port = server.server_address[1]
    log = folder / f"slurm_relay_{batch_pid}.log"
    child = os.fork()
    if child == 0:  # the relay: detached from the script's command substitution
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            serve(server, batch_pid, linger_s)
        finally:
            os._exit(0)
    server.server_close()  # the child holds the listening socket
    address = f"{socket.gethostname()}:{port}:{token}"
    # Not an EXIT trap: bash runs that also when a signal ends it — Slurm's SIGTERM at the requeue the job's
    # last steps make through this relay (requeuehold, then the excluded nodes, then release).
    return (f"export {slurm.RELAY_ENV}={address}\n"
            f'taehv_exit() {{ kill -USR1 {child} 2>/dev/null; exit "$1"; }}\n')


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4 or args[0] != "start":
        print("usage: python -m taehv_slurm.relay start FOLDER BATCH_SCRIPT_PID LINGER_S", file=sys.stderr)
        return 2
    os.environ.pop(slurm.RELAY_ENV, None)  # this process runs the commands itself
    # (a batch host without scontrol still starts it: rank 0 reports that, as the job's failure)
    print(start(Path(args[1]), int(args[2]), float(args[3])), end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
