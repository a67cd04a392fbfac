"""The run folder: its names, readers and writers, in one place.

A run folder (`<job_dir>/<run name>/`; a sweep's runs `<job_dir>/<sweep>/<key=value>/`) is the interface
between the login node, the ranks, the CLI, the notebook and the tools: `RunFolder` names what it holds
and `JobDir` what lies beside the runs. Every reader of a JSON-lines file goes through `EventLog`: `read`
takes the whole file, `window` only its end (read backwards, block by block), or the stretch before a time
found by bisection, so that what a status needs costs the same for a run of a hundred lines and one of a
million. A damaged line (cut short by a kill mid-write, junk bytes, a record without the fields the reader
needs) is skipped with one warning naming the file and the lines, and the rest is read; a file that
belongs to someone other than its folder's owner (planted there) is never read. Every whole-file write
goes through `write_text_atomic` (fsync, rename, fsync the folder). Standard library only: the ranks, the
local controller and the login node all use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from taehv_slurm.common.security import describe_user

# In a run folder:
EVENTS = "events.jsonl"  # what happened, as it happened (taehv_slurm.runtime.context, the driver)
METRICS = "metrics.jsonl"  # rank 0's metrics, one line per logged step (taehv_slurm.trainer.metrics)
ATTEMPTS = "attempts.jsonl"  # each attempt's config, code and versions (taehv_slurm.runtime.provenance)
RANKS = "ranks"  # ranks/<rank>.json: each rank's record (taehv_slurm.runtime.ranks)
CHECKPOINTS = "checkpoints"  # checkpoints/step_<N>/ (taehv_slurm.runtime.checkpoint)
SUBMITIT = "submitit"  # submitit's pickles and the ranks' logs
TRACKERS = "trackers.json"  # the W&B / MLflow run ids a resume continues (taehv_slurm.trainer.trackers)
LOCK = "run.lock"  # one live job per run (taehv_slurm.runtime.runlock)
# In job_dir, beside the run folders:
REGISTRY = "registry.jsonl"  # one line per submitted job (taehv_slurm.registry)
# code/<digest>/: the copies of the checkout jobs import (taehv_slurm.snapshot); in a run folder,
# code/<job>_<restart>.diff: a dirty tree's changes (taehv_slurm.runtime.provenance)
CODE = "code"
BLOCK = 1 << 16  # bytes read at a time from a file's end
# Several hosts write a run's events (the ranks, the local controller): a window read backwards stops this
# many seconds before its start, so that lines a host with a clock behind wrote are still found.
CLOCK_SKEW_S = 600.0


@dataclass(frozen=True)
class RunFolder:
    """One run's folder: the paths of what it holds, and its JSON-lines files as `EventLog`s."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of(cls, inside: str | os.PathLike) -> RunFolder:
        """The run folder of a path in it: the folder itself, its checkpoints/, a step_N folder or its
        state.pt."""
        run = Path(inside)
        run = run.parent if run.name == "state.pt" else run
        run = run.parent if run.name.startswith("step_") else run
        return cls(run.parent if run.name == CHECKPOINTS else run)

    def events(self, group_readable: bool | None = None) -> EventLog:
        return EventLog(self.path / EVENTS, group_readable)

    def metrics(self) -> EventLog:
        return EventLog(self.path / METRICS)

    def attempts(self) -> EventLog:
        return EventLog(self.path / ATTEMPTS)

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def ranks(self) -> Path:
        return self.path / RANKS

    def rank_record(self, rank: int) -> Path:
        return self.path / RANKS / f"{rank}.json"

    @property
    def submitit(self) -> Path:
        return self.path / SUBMITIT

    @property
    def trackers(self) -> Path:
        return self.path / TRACKERS

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def code(self) -> Path:
        """code/<job>_<restart>.diff: the uncommitted changes each attempt ran with."""
        return self.path / CODE

    @property
    def export(self) -> Path:
        """Where an export writes by default (`taehv export`, `export_weights`): `<run>/<run>.safetensors`,
        under job_dir, never beside the user's files (nor in a checkout, where git would show it)."""
        return self.path / f"{self.path.resolve().name}.safetensors"


@dataclass(frozen=True)
class JobDir:
    """The folder of a cluster config's `job_dir`: the run folders, the registry of jobs, the code copies."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def run(self, name: str) -> RunFolder:
        return RunFolder(self.path / name)

    @property
    def registry(self) -> Path:
        return self.path / REGISTRY

    @property
    def code(self) -> Path:
        return self.path / CODE


class RunFileWarning(UserWarning):
    """A run file was damaged or not ours; the message names it and what was skipped."""


class EventLog:
    """Append-only JSON lines; each line is one event dict with `event` and `time`.

    A new file is owner-only, or group-readable where the cluster config shares runs with a group:
    `group_readable` says which; None (in a job) reads it from the job's environment (TAEHV_SHARED_GROUP,
    exported by its sbatch script), which the submitting side does not have.
    """

    def __init__(self, path: str | os.PathLike, group_readable: bool | None = None) -> None:
        self.path = Path(path)
        self.group_readable = group_readable

    def write(self, event: str, **fields: Any) -> None:
        """Append one event: `event` and `time` (now) first, then `fields`."""
        self.append({"event": event, "time": time.time(), **fields})

    def append(self, record: Mapping[str, Any], durable: bool = True) -> None:
        """Append `record` as one whole line, as it is (metrics lines have no `event`); `durable`: fsynced
        before this returns."""
        # Strict JSON for every reader: a NaN or infinity is written as null.
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        line = json.dumps(record, default=str, allow_nan=False)
        shared = (self.group_readable if self.group_readable is not None
                  else bool(os.environ.get("TAEHV_SHARED_GROUP")))
        mode = 0o640 if shared else 0o600
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, mode)
        try:
            stat = os.fstat(fd)
            if (planted := _planted(self.path, stat.st_uid)) is not None:
                raise PermissionError(f"not writing to {self.path}: {planted}")
            locked = _lock(fd)
            stat = os.fstat(fd) if locked else stat  # an NFS client learns the file's true end at the lock
            # After a line cut short by a kill, start on a new line: the new event must stay whole.
            cut = stat.st_size > 0 and os.pread(fd, 1, stat.st_size - 1) != b"\n"
            # one write of one line (O_APPEND): appends of other writers never interleave with it
            os.write(fd, (("\n" if cut else "") + line + "\n").encode())
            if durable:
                os.fsync(fd)
        except OSError as err:
            if err.filename is None:  # os.write and os.fsync name no file: a full disk's error says which
                raise OSError(err.errno, err.strerror, str(self.path)) from err
            raise
        finally:
            os.close(fd)  # and the lock with it

    def read(self, required: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Every whole event (with the `required` fields); damaged lines are skipped with one warning."""
        with self._open() as f:
            data = f.read() if f is not None else b""
        events, damaged = [], []
        for number, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            event = parse_line(raw)
            if event is not None and all(k in event for k in required):
                events.append(event)
            else:
                damaged.append(number)
        if damaged:
            warn_damaged(self.path, damaged, len(events), required, stacklevel=3)
        return events

    def window(self, since: float = -math.inf, until: float = math.inf, limit: int | None = None,
               ordered: bool = False) -> list[dict[str, Any]]:
        """The events with `since` <= time < `until` (at most the last `limit` lines of them), oldest first,
        read backwards from the end of the file, never the whole of a long one.

        ordered: the file's lines are in time order (metrics.jsonl, one writer): reading starts where
        `until` falls (found by bisection) and stops at the first line before `since`. Otherwise (events
        from several hosts) it starts at the end and stops at a line CLOCK_SKEW_S before `since`. An
        unfinished last line (being written) is left for the next read; damaged lines are skipped with
        one warning."""
        found: list[dict[str, Any]] = []
        damaged = 0
        with self._open() as f:
            if f is None:
                return []
            end = f.seek(0, os.SEEK_END)
            if ordered and until != math.inf:
                end = _offset_of_time(f, end, until)
            stop = since if ordered else since - CLOCK_SKEW_S
            for raw, whole in _lines_backwards(f, end):
                if not raw.strip():
                    continue
                event = parse_line(raw)
                if event is None:
                    damaged += whole
                    continue
                when = event.get("time", 0)
                if not isinstance(when, int | float):
                    continue
                if when < stop:
                    break
                if since <= when < until:
                    found.append(event)
                    if limit is not None and len(found) >= limit:
                        break
        if damaged:
            warnings.warn(f"{self.path}: skipped {damaged} damaged line(s) near its end (cut short, "
                          f"not JSON); read the other {len(found)}", RunFileWarning, stacklevel=2)
        return found[::-1]

    @contextlib.contextmanager
    def _open(self) -> Iterator[IO[bytes] | None]:
        """The file open for reading, or None where it does not exist or was planted (with a warning)."""
        try:
            f = open(self.path, "rb")  # noqa: SIM115  (closed below, also when the caller raises)
        except FileNotFoundError:
            yield None
            return
        with f:
            if (planted := _planted(self.path, os.fstat(f.fileno()).st_uid)) is not None:
                warnings.warn(f"not reading {self.path}: {planted}", RunFileWarning, stacklevel=3)
                yield None
            else:
                yield f


def warn_damaged(path: Path, numbers: Sequence[int], kept: int, required: Sequence[str] = (),
                 stacklevel: int = 2) -> None:
    """One warning for the damaged lines (`numbers`, 1-based) skipped in `path`, and how many were read."""
    shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
    needs = f", or without {'/'.join(required)}" if required else ""
    warnings.warn(f"{path}: skipped {len(numbers)} damaged line(s) (line {shown}: cut short, "
                  f"not JSON{needs}); read the other {kept}", RunFileWarning, stacklevel=stacklevel + 1)


def parse_line(raw: bytes) -> dict[str, Any] | None:
    """One JSON line as a dict, None where it is not one (cut short, junk)."""
    try:
        event = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return event if isinstance(event, dict) else None


def _lines_backwards(f: IO[bytes], end: int) -> Iterator[tuple[bytes, bool]]:
    """The lines of `f` before byte `end`, last first, each with whether it is whole (ended by a newline:
    an unfinished last line is not)."""
    position, pending, whole = end, b"", False
    while position > 0:
        start = max(0, position - BLOCK)
        f.seek(start)
        lines = (f.read(position - start) + pending).split(b"\n")
        position, pending = start, lines[0]  # may begin in the block before
        for line in reversed(lines[1:]):
            yield line, whole
            whole = True
    yield pending, whole


def _offset_of_time(f: IO[bytes], size: int, when: float) -> int:
    """Where the first line with time >= `when` starts in a time-ordered file (else `size`), found by
    bisection: a few small reads whatever the file's length. Lines without a time are stepped over."""
    low, high = 0, size  # a line starting at `low` is before `when`, or low is 0; `high` is a line's start
    while high - low > BLOCK:
        probe = _line_after(f, (low + high) // 2, high)
        if probe is None:
            break  # one line longer than the span: read from `high`
        start, time_ = probe
        if time_ >= when:
            high = start
        else:
            low = start
    return high


def _line_after(f: IO[bytes], offset: int, limit: int) -> tuple[int, float] | None:
    """(start, time) of the first line with a time that starts after byte `offset` and before `limit`."""
    f.seek(offset)
    f.readline()  # the rest of the line `offset` falls in
    while (start := f.tell()) < limit:
        event = parse_line(f.readline())
        if event is not None and isinstance(event.get("time"), int | float):
            return start, float(event["time"])
    return None


def _lock(fd: int) -> bool:
    """Hold a POSIX lock on the whole file while a line is appended, where the filesystem has locks: on
    NFS, O_APPEND alone does not keep the writers of several hosts apart (each appends at the end it
    cached), a lock does (the client revalidates the file under it). Lustre appends atomically by
    itself and may be mounted without locks (then this returns False and O_APPEND is enough)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
    except OSError:  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks on this mount
        return False
    return True


def _planted(path: Path, owner: int) -> str | None:
    """Why a run file must not be trusted: it belongs to another user than its folder's owner."""
    folder_owner = os.stat(path.parent).st_uid
    if owner == folder_owner:
        return None
    return (f"it belongs to {describe_user(owner)}, not to {describe_user(folder_owner)} who owns the folder "
            "(someone else put it there); move it away and check who can write to that folder")



def write_text_atomic(path: Path, text: str, mode: int = 0o666) -> None:
    """Replace `path` with `text` at once: readers see the old text or the new one, never a part.

    A temporary file in the same folder (created with `mode`, less the umask) is fsynced and renamed
    over `path`, then the folder is fsynced; on any error the temporary file is removed.
    """
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the folder entry itself is fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

