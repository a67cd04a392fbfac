"""The run folder's small files: append-only JSON lines (events, registry, metrics) and atomic text.

Every reader of a JSON-lines file goes through `EventLog.read`: a damaged line (cut short by a kill
mid-write, junk bytes, a record without the fields the reader needs) is skipped with one warning naming
the file and the lines, and the rest is read; a file that belongs to someone other than its folder's
owner (planted there) is never read. Standard library only: the ranks, the local controller and the
login node all use it.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from taehv_slurm.security import describe_user


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
        # Strict JSON for every reader: a NaN or infinity is written as null.
        fields = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()}
        line = json.dumps({"event": event, "time": time.time(), **fields}, default=str, allow_nan=False)
        shared = (self.group_readable if self.group_readable is not None
                  else bool(os.environ.get("TAEHV_SHARED_GROUP")))
        mode = 0o640 if shared else 0o600
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, mode)
        try:
            stat = os.fstat(fd)
            if (planted := _planted(self.path, stat.st_uid)) is not None:
                raise PermissionError(f"not writing to {self.path}: {planted}")
            # After a line cut short by a kill, start on a new line: the new event must stay whole.
            cut = stat.st_size > 0 and os.pread(fd, 1, stat.st_size - 1) != b"\n"
            # one write of one line: appends never interleave
            os.write(fd, (("\n" if cut else "") + line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, required: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Every whole event (with the `required` fields); damaged lines are skipped with one warning."""
        try:
            with open(self.path, "rb") as f:
                if (planted := _planted(self.path, os.fstat(f.fileno()).st_uid)) is not None:
                    warnings.warn(f"not reading {self.path}: {planted}", RunFileWarning, stacklevel=2)
                    return []
                data = f.read()
        except FileNotFoundError:
            return []
        events, damaged = [], []
        for number, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                event = json.loads(raw.decode())
            except (UnicodeDecodeError, json.JSONDecodeError):
                event = None
            if isinstance(event, dict) and all(k in event for k in required):
                events.append(event)
            else:
                damaged.append(number)
        if damaged:
            shown = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
            needs = f", or without {'/'.join(required)}" if required else ""
            warnings.warn(f"{self.path}: skipped {len(damaged)} damaged line(s) (line {shown}: cut short, "
                          f"not JSON{needs}); read the other {len(events)}", RunFileWarning, stacklevel=2)
        return events


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
