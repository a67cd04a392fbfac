"""The run folder's small files: append-only JSON lines (events, registry, metrics) and atomic text.

Every reader of a JSON-lines file goes through `EventLog.read`, so a line cut short by a kill
mid-write is skipped rather than failing the reader. Standard library only: the ranks, the local
controller and the login node all use it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any


class EventLog:
    """Append-only JSON lines; each line is one event dict with `event` and `time`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "time": time.time(), **fields}, default=str)
        # Owner-only, or group-readable where the cluster config shares runs with a group.
        mode = 0o640 if os.environ.get("TAEHV_SHARED_GROUP") else 0o600
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
        try:
            os.write(fd, (line + "\n").encode())  # one write of one line: appends do not interleave
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill mid-write: skip it
                continue
        return events


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
