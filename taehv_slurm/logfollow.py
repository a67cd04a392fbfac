"""Following a rank's log as it grows, across the job's requeues, with or without its tracebacks."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

from taehv_slurm import jobstates, slurm

if TYPE_CHECKING:
    from taehv_slurm.handle import JobHandle


class LogFollower:
    """Prints a rank's log as it grows until the job ends; `position` is where it has read to, so a
    caller interrupted (Ctrl-C) can go on from there. A requeued job appends each run to the same log,
    so following keeps going across requeues. hide_tracebacks: no tracebacks and no submitit notes, for
    a caller that prints the error once at the end, naming the log that holds the full text. The log is
    read at every step; the job's state is asked again after `poll_s`, later while neither it nor the log
    changes (`JobHandle.wait`'s rhythm). Where the Slurm controller stops answering, and again where it
    answers, a note says so on stderr: the log goes on, the job's state is its accounting's meanwhile."""

    def __init__(self, handle: JobHandle, rank: int = 0, position: int = 0,
                 hide_tracebacks: bool = False, poll_s: float = 1.0) -> None:
        self.handle, self.path, self.position = handle, handle.log_path(rank), position
        self.filter = _TracebackFilter() if hide_tracebacks else None
        self.backoff, self.state, self.due = handle.backoff(poll_s), "", 0.0
        self.silence = jobstates.SilenceWatch()

    def run(self, out: TextIO | None = None, poll_s: float = 1.0) -> str:
        out = out or sys.stdout
        while not slurm.is_final(state := self.step(out)):
            time.sleep(poll_s)
        return state

    def step(self, out: TextIO) -> str:
        """Print what the log gained since the last call; returns the job's state, read before the file
        (a job that just ended has written its last line)."""
        if time.monotonic() >= self.due:
            state, self.state = self.state, self.handle.state
            self.due = time.monotonic() + self.backoff.after(state != self.state)
            self.silence.tell()
        if self.path.exists():
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.position:  # truncated or replaced (never by Slurm's append mode)
                    self.position = 0
                f.seek(self.position)
                chunk = f.read()
                self.position = f.tell()
            text = chunk.decode(errors="replace")
            text = self.filter.feed(text) if self.filter else text
            if chunk:  # the job moves: its state is asked again soon
                self.due = min(self.due, time.monotonic() + self.backoff.after(True))
            if text:
                out.write(text)
                out.flush()
        return self.state


class _TracebackFilter:
    """Log text without Python tracebacks (chained ones too) and without submitit's own notes (its INFO
    lines, "Submitted job triggered an exception"): the caller prints the error once, with the log's path."""

    CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
    SUBMITIT_NOTES = ("submitit INFO (", "submitit DEBUG (")

    def __init__(self) -> None:
        self.pending = ""  # an incomplete last line
        self.inside = False

    def feed(self, text: str) -> str:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        kept = []
        for line in lines:
            if line.startswith("Traceback (most recent call last):") or line.startswith(self.CHAINED):
                self.inside = True
            elif self.inside and (line.startswith((" ", "\t")) or not line.strip()):
                continue
            elif self.inside:
                # the exception's own line ends the traceback (printed once by the caller)
                self.inside = False
            elif line.startswith(self.SUBMITIT_NOTES) or "Submitted job triggered an exception" in line:
                continue
            else:
                kept.append(line)
        return "".join(line + "\n" for line in kept)
