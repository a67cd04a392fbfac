"""Each rank's own record in the run folder: who it is, where it runs, how far it got, how it ended.

    <run_dir>/ranks/<rank>.json    {"job_id", "restart", "rank", "world_size", "host", "pid", "started",
                                    "time", "step", "section", "since", "exit_code", "ended", "launch"}

Written when the rank starts, refreshed while it runs (by its watchdog thread, every few seconds: the
main thread only updates the record in memory), and closed with the exit code when the process ends
by any path Python sees. So once a job attempt is over, a rank whose record has no exit code was
ended from outside — a signal, the out-of-memory killer, a lost node — and `killed_ranks` names it.
A record of another attempt (job id, restart count or launch — the job step inside one allocation —
differs) is stale and never read as this one's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from taehv_slurm.common.runfolder import RunFolder, write_text_atomic


def node_name() -> str:
    """The node this process runs on, as Slurm names it (SLURMD_NODENAME), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass
class RankRecord:
    job_id: str
    restart: int
    rank: int
    world_size: int
    host: str
    pid: int
    started: float
    time: float
    step: int | None = None
    section: str = "startup"  # what the main thread does: startup, step, data, validate, save, ...
    since: float = 0.0  # when it entered that section
    exit_code: int | None = None
    ended: float | None = None
    launch: int = 0  # which job step of its allocation (taehv_slurm.runtime.steps)


class RankFile:
    """This rank's record, kept in memory and written to `<run_dir>/ranks/<rank>.json`."""

    def __init__(self, run_dir: str | os.PathLike, job_id: str, restart: int, rank: int,
                 world_size: int, launch: int = 0) -> None:
        now = time.time()
        self.path = RunFolder(run_dir).rank_record(rank)
        self.record = RankRecord(str(job_id), restart, rank, world_size, node_name(), os.getpid(), now, now,
                                 since=now, launch=launch)
        self._lock = threading.Lock()

    def started(self) -> None:
        self.path.parent.mkdir(exist_ok=True)
        self.write()

    def enter(self, section: str, step: int | None = None) -> None:
        """The main thread enters `section` (at `step`); in memory only, the next `write` records it."""
        with self._lock:
            self.record.section, self.record.since = section, time.time()
            if step is not None:
                self.record.step = step

    def write(self) -> None:
        with self._lock:
            self.record.time = time.time()
            text = json.dumps(asdict(self.record)) + "\n"
        # A full or vanished folder must not end the rank: its record is only a witness.
        with contextlib.suppress(OSError):
            write_text_atomic(self.path, text, 0o600)

    def exited(self, code: int) -> None:
        with self._lock:
            self.record.exit_code, self.record.ended = code, time.time()
        self.write()


def read_ranks(run_dir: str | os.PathLike, job_id: str, restart: int, launch: int = 0,
               rank: int | None = None) -> list[dict[str, Any]]:
    """The records of job `job_id`'s attempt `restart`, its job step `launch`, by rank (records of other
    attempts and steps are left out); only `rank`'s where given."""
    folder = RunFolder(run_dir).ranks
    records = []
    paths = [folder / f"{rank}.json"] if rank is not None else sorted(folder.glob("*.json"))
    for path in paths if folder.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (str(record.get("job_id")) == str(job_id) and int(record.get("restart", -1)) == restart
                and int(record.get("launch", 0)) == launch):
            records.append(record)
    return sorted(records, key=lambda r: r["rank"])


def killed_ranks(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks of an ended attempt that never recorded an exit: ended from outside the process."""
    return [r for r in records if r.get("exit_code") is None]


def describe_ranks(records: list[dict[str, Any]]) -> str:
    """'rank 2 on tb2' / 'ranks 0-1,3 on tb1, rank 2 on tb2': ranks grouped by host, runs collapsed."""
    by_host: dict[str, list[int]] = {}
    for record in records:
        by_host.setdefault(record["host"], []).append(int(record["rank"]))
    return ", ".join(f"rank{'s' if len(ranks) > 1 else ''} {_runs(ranks)} on {host}"
                     for host, ranks in by_host.items())


def _runs(numbers: list[int]) -> str:
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
