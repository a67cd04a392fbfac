"""The job registry: `JobDir.registry`, one line per submitted run.

Each line holds the job id, the run folder and submitit folder (relative to job_dir, so a job_dir can
be read from any working directory), the backend, the shape, the secret-free cluster config and what
the submitter recorded (train config, plan, swept values). `JobHandle.attach` re-opens a run from it.

A lab's job_dir holds thousands of runs (a few kB a line), so the file is read once per process and
indexed, not parsed again for each question: `Registry.load` keeps one index per job_dir (read again
only when the file changed, and then only its new lines when it just grew), each line's job id and
run name taken from the head `record_submission` writes, its record parsed only when asked for. Lines
of another shape (an older registry, a line written by hand) are parsed whole. Appends stay safe with
writers on several hosts (taehv_slurm.common.runfolder.EventLog.write).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from taehv_slurm.common.runfolder import EventLog, JobDir, parse_line, warn_damaged

REQUIRED = ("job_id", "run_dir", "folder")
# The head of every line `record_submission` writes (json.dumps: event, time, then the entry's job_id, run,
# and for a follow-up job the job it follows: taehv_slurm.followup).
_HEAD = re.compile(rb'\{"event": "submitted", "time": [-0-9.eE+]+, '
                   rb'"job_id": "([^"\\]*)", "run": "([^"\\]+)", (?:"follows": "([^"\\]*)", )?')


class UnknownJobError(LookupError):
    """No run with that job id in the registry; the message says where it looked and what to pass."""


class _Line(NamedTuple):
    number: int  # 1-based, for warnings
    offset: int
    length: int
    job_id: str
    run: str
    follows: str | None  # the job whose follow-up this one is


class Registry:
    """One job_dir's registry, indexed by job id and run name; records parsed when first asked for."""

    _loaded: dict[str, Registry] = {}
    _lock = threading.RLock()

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reset()

    def _reset(self) -> None:
        self.lines: list[_Line] = []  # the submissions, in file order
        self.by_id: dict[str, list[int]] = {}  # job id → its lines' indices
        self.by_run: dict[str, list[int]] = {}  # run name → its lines' indices
        self.followed_by: dict[str, str] = {}  # job id → its follow-up job's id (taehv_slurm.followup)
        self.records: dict[int, dict[str, Any]] = {}  # parsed so far (index → record)
        self.damaged: set[int] = set()  # indices of lines that turned out damaged
        self.end = 0  # bytes indexed: the end of the last whole line
        self.count = 0  # whole lines seen, submissions or not
        self.stamp: tuple[int, int, int] | None = None  # (inode, size, mtime) when read
        self.tail = b""  # the last bytes indexed: a file rewritten in place is read again whole

    @classmethod
    def load(cls, job_dir: str | os.PathLike) -> Registry:
        """The registry of `job_dir`, as it is now: kept for the process, its file read again only where it
        changed (only what was appended, where it grew). A missing file is an empty registry."""
        path = JobDir(job_dir).registry
        with cls._lock:
            registry = cls._loaded.setdefault(os.path.abspath(path), Registry(path))
            registry.path = path  # as the caller names it, for messages
        return registry.refresh()

    def refresh(self) -> Registry:
        """The registry as its file is now (one stat where it did not change)."""
        with self._lock:
            try:
                stat = os.stat(self.path)
            except FileNotFoundError:
                self._reset()
                return self
            stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if stamp != self.stamp:
                self._read(stamp)
            return self

    def _read(self, stamp: tuple[int, int, int]) -> None:
        """Index what changed: only the new lines where the file just grew, else all of it."""
        grew = self.stamp is not None and stamp[0] == self.stamp[0] and stamp[1] >= self.end
        if grew and self._still_begins_with_what_was_read():
            self._drop_unfinished()
        else:
            self._reset()
        self._index_from(self.end)
        self.stamp = stamp

    def _still_begins_with_what_was_read(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(self.end - len(self.tail))
            return f.read(len(self.tail)) == self.tail

    def _drop_unfinished(self) -> None:
        """Forget a last line indexed before its writer had ended it: it is read again."""
        while self.lines and self.lines[-1].offset >= self.end:
            line = self.lines.pop()
            index = len(self.lines)
            self.by_id[line.job_id].pop()
            self.by_run[line.run].pop()
            self.records.pop(index, None)
            self.damaged.discard(index)

    def _index_from(self, start: int) -> None:
        """Index the lines from byte `start` on. An unfinished last line (its writer may not be done) is
        indexed only where it is a whole record already, and read again next time."""
        damaged: list[int] = []
        with EventLog(self.path)._open() as f:
            if f is None:
                return
            f.seek(start)
            offset = start
            for raw in f:
                whole = raw.endswith(b"\n")
                if whole:
                    self.count += 1
                if not raw.isspace() and not self._add(raw, offset, whole) and whole:
                    damaged.append(self.count)
                offset += len(raw)
                if whole:
                    self.end, self.tail = offset, raw[-64:]
        if damaged:
            warn_damaged(self.path, damaged, len(self.lines), REQUIRED)

    def _add(self, raw: bytes, offset: int, whole: bool) -> bool:
        """Index one line; False where it is damaged (not JSON, or a submission without its fields)."""
        head = _HEAD.match(raw)
        record = None
        if head is None or not raw.endswith(b"}\n"):  # a cut line's head may be whole: parse it all
            record = _parse(raw)
            if record is None or (record.get("event") == "submitted" and
                                  not all(k in record for k in REQUIRED)):
                return False
            if record.get("event") != "submitted":
                return True  # not a submission: not ours to read
            job_id, run, follows = str(record["job_id"]), run_name(record), record.get("follows")
        else:
            job_id, run = head.group(1).decode(), head.group(2).decode()
            follows = head.group(3).decode() if head.group(3) else None
        index = len(self.lines)
        self.lines.append(_Line(self.count + (not whole), offset, len(raw), job_id, run, follows))
        self.by_id.setdefault(job_id, []).append(index)
        self.by_run.setdefault(run, []).append(index)
        if follows:
            self.followed_by[follows] = job_id
        if record is not None:
            self.records[index] = record
        return True

    # ------------------------------------------------------------------------------------ reading
    def record(self, index: int) -> dict[str, Any] | None:
        """The record of line `index` (parsed once), None where the line turns out damaged."""
        if index in self.records or index in self.damaged:
            return self.records.get(index)
        line = self.lines[index]
        with open(self.path, "rb") as f:
            f.seek(line.offset)
            record = _parse(f.read(line.length))
        if record is None or not all(k in record for k in REQUIRED) or str(record["job_id"]) != line.job_id:
            self.damaged.add(index)
            warn_damaged(self.path, [line.number], len(self.lines) - len(self.damaged), REQUIRED)
            return None
        self.records[index] = record
        return record

    def all(self) -> list[dict[str, Any]]:
        """Every submission, oldest first."""
        return [r for i in range(len(self.lines)) if (r := self.record(i)) is not None]

    def job_ids(self) -> list[str]:
        """Every job id once, in the order they were first submitted — a chain of follow-up jobs once, as its
        latest job."""
        return list(dict.fromkeys(line.job_id for line in self.lines if line.job_id not in self.followed_by))

    def chain(self, job_id: str) -> list[str]:
        """The jobs that are one submission's attempts with `job_id` (the jobs it follows, it, and its
        follow-ups), oldest first; [job_id] for a job without follow-ups."""
        members = [job_id]
        while (lines := self.by_id.get(members[0])) and (before := self.lines[lines[-1]].follows):
            members.insert(0, before)
        while (after := self.followed_by.get(members[-1])) and after not in members:
            members.append(after)
        return members

    def of_run(self, name: str) -> list[dict[str, Any]]:
        """The submissions of the run folder `name` (every job of it), oldest first."""
        return [r for i in self.by_run.get(name, []) if (r := self.record(i)) is not None]

    def find(self, key: str) -> dict[str, Any]:
        """The record of job `key`, or else the newest job of the run named `key`; UnknownJobError in one
        line when there is neither."""
        for indices in (self.by_id.get(key, []), self.by_run.get(key, [])):
            for index in reversed(indices):
                if (record := self.record(index)) is not None:
                    return record
        if not self.lines:
            raise UnknownJobError(f"no job {key}: {self.path} lists no runs; "
                                  "pass the job_dir the job was submitted with "
                                  "(--job-dir or TAEHV_JOB_DIR)")
        known = ", ".join(f"{line.job_id} ({line.run})" for line in self.lines[-5:])
        raise UnknownJobError(f"no job or run {key} in {self.path} (latest: {known}); "
                              "check the id or run name, or pass "
                              "the job_dir it was submitted with")


def _parse(raw: bytes) -> dict[str, Any] | None:
    """A registry line as a dict (orjson: 3× the standard library's pace; what only the standard library
    reads, such as NaN, through it), None where it is not one."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return parse_line(raw)
    return record if isinstance(record, dict) else None


def read_registry(job_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every submission recorded in the job_dir's registry, oldest first."""
    return Registry.load(job_dir).all()


def record_submission(job_dir: str | os.PathLike, entry: Mapping[str, Any], group: str | None = None) -> None:
    """Append one submission; a new registry is readable by `group` (the cluster config's) like the runs."""
    EventLog(JobDir(job_dir).registry, group_readable=group is not None).write("submitted", **entry)


def run_name(record: Mapping[str, Any]) -> str:
    """The run folder relative to job_dir (e.g. 'tiny-demo' or 'lr-sweep/lr=0.0001')."""
    return record.get("run") or Path(record["run_dir"]).name


def find_record(job_id: str, job_dir: str | os.PathLike) -> dict[str, Any]:
    """The record of job `job_id`, or else the newest job of the run named `job_id` (e.g. 'run1' or
    'lr-sweep/lr=0.0001'); UnknownJobError in one line when there is neither."""
    return Registry.load(job_dir).find(job_id)
