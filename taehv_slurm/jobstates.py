"""The states and accounting of many jobs from one question to Slurm, shared by the whole process.

Slurm asks tools not to run squeue in loops, and sites rate-limit those that do. Here the state of every
job a process asks about comes from one squeue call for all of them (`squeue_states`), and one sacct call
for those squeue no longer lists (`sacct_records` of a list of jobs): `job_states` asks for the jobs named
and every other job the process watches (`watch`: each JobHandle on Slurm) whose answer has aged, and the
answers serve every question for STATE_MAX_AGE_S, or for a whole command inside `held_answers`. An order
given to a job (cancel, requeue) drops what was known of it (`forget`): the next question asks again.
Loops that poll wait longer while nothing changes (`Backoff`, up to $TAEHV_POLL_MAX_S, 30 s): a sweep of
twenty jobs followed for two minutes costs about ten squeue calls, where one call per job every 2 s cost
1,200. Where the controller does not answer squeue (down, restarting, overloaded), every job asked about
is answered from accounting, and `controller_silence` says so in one line for the commands to print;
`accounting_silence` likewise where sacct fails. The commands themselves are taehv_slurm.slurm's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from taehv_slurm import sacct, slurm

STATE_MAX_AGE_S = 0.5  # an answer serves every question about the job within this long
POLL_MAX_ENV = "TAEHV_POLL_MAX_S"  # the longest wait between two polls of jobs that do not change
POLL_MAX_S = 30.0
IDS_PER_CALL = 1000  # job ids per squeue or sacct call (its command line stays short)


class _Answers:
    """Slurm's latest answers, with the monotonic time each came: squeue's state of a job (None: not
    listed) and sacct's records of it."""

    def __init__(self) -> None:
        self.queue: dict[str, tuple[float, str | None]] = {}
        self.accounting: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self.watched: dict[str, weakref.WeakSet] = {}
        self.held_since: float | None = None
        self.unanswered: str | None = None  # squeue's error at its latest call; None: it answered
        self.unaccounted: str | None = None  # sacct's, likewise
        self.lock = threading.RLock()

    def fresh(self, table: Mapping[str, tuple[float, Any]], job_id: str, max_age_s: float) -> bool:
        if job_id not in table or max_age_s <= 0:  # 0: a fresh answer is needed, held or not
            return False
        when = table[job_id][0]
        return ((self.held_since is not None and when >= self.held_since)
                or time.monotonic() - when <= max_age_s)

    def stale(self, table: Mapping[str, tuple[float, Any]], job_ids: Sequence[str], max_age_s: float,
              also: Sequence[str] = ()) -> list[str]:
        """The jobs of `job_ids` whose answer has aged; where any has, those of `also` too."""
        stale = [j for j in job_ids if not self.fresh(table, j, max_age_s)]
        if not stale:
            return []
        return [j for j in dict.fromkeys([*stale, *also]) if not self.fresh(table, j, max_age_s)]

    def watching(self) -> list[str]:
        """The watched jobs that may still change: not those squeue no longer lists and whose accounting
        says they ended (asked again only when asked for)."""
        for job_id in [j for j, owners in self.watched.items() if not owners]:
            del self.watched[job_id]
        return [j for j in self.watched if not self.ended(j)]

    def ended(self, job_id: str) -> bool:
        if job_id not in self.queue or self.queue[job_id][1] is not None or job_id not in self.accounting:
            return False
        return slurm.is_final(sacct.last_state(job_id, self.accounting[job_id][1]) or "?")


_ANSWERS = _Answers()


def watch(job_id: str, owner: object) -> None:
    """Ask for `job_id`'s state whenever another job's is asked for, while `owner` (a JobHandle) lives."""
    with _ANSWERS.lock:
        _ANSWERS.watched.setdefault(job_id, weakref.WeakSet()).add(owner)


def forget(*job_ids: str) -> None:
    """Drop what is known of these jobs (an order was given to them): the next question asks Slurm."""
    with _ANSWERS.lock:
        for job_id in job_ids:
            _ANSWERS.queue.pop(job_id, None)
            _ANSWERS.accounting.pop(job_id, None)


@contextlib.contextmanager
def held_answers() -> Iterator[None]:
    """Inside the block, an answer Slurm gave during it serves every later question: one command's view
    (`taehv status` over many runs asks once)."""
    with _ANSWERS.lock:
        outer = _ANSWERS.held_since
        _ANSWERS.held_since = time.monotonic() if outer is None else outer
    try:
        yield
    finally:
        with _ANSWERS.lock:
            _ANSWERS.held_since = outer


def job_states(job_ids: Sequence[str], max_age_s: float = STATE_MAX_AGE_S) -> dict[str, str | None]:
    """Each job's state: squeue's while it lists the job, else the last state of its accounting (None where
    neither knows it). One squeue call for every job asked and every watched one whose answer has aged
    (`max_age_s`), and at most one sacct call, for those squeue does not list."""
    with _ANSWERS.lock:
        listed = queue_states(job_ids, max_age_s)
        gone = [j for j in job_ids if listed[j] is None]
        others = [j for j in _ANSWERS.watching() if _ANSWERS.queue.get(j, (0.0, "?"))[1] is None]
        if ask := _ANSWERS.stale(_ANSWERS.accounting, gone, max_age_s, also=others):
            _ask_sacct(ask)
        return {j: listed[j] or sacct.last_state(j, _ANSWERS.accounting[j][1]) for j in job_ids}


def queue_states(job_ids: Sequence[str], max_age_s: float = STATE_MAX_AGE_S) -> dict[str, str | None]:
    """squeue's state of each job (None: not listed), from one call for every job asked and every watched
    one whose answer has aged."""
    with _ANSWERS.lock:
        if ask := _ANSWERS.stale(_ANSWERS.queue, job_ids, max_age_s, also=_ANSWERS.watching()):
            for chunk in _chunks(ask):
                listed = slurm.squeue_states(chunk)
                now = time.monotonic()
                if isinstance(listed, slurm.Answer):  # none listed: their accounting answers instead
                    _ANSWERS.unanswered, listed = listed.error, {}
                else:
                    _ANSWERS.unanswered = None
                _ANSWERS.queue.update({j: (now, listed.get(j)) for j in chunk})
        return {j: _ANSWERS.queue[j][1] for j in job_ids}


def controller_silence() -> str | None:
    """One line where the latest squeue call failed (the controller down, restarting or overloaded; munge
    out of reach), None where it answered: the states since then are Slurm's accounting, which the
    controller keeps up to date and which lags while it is out of reach."""
    if (error := _ANSWERS.unanswered) is None:
        return None
    return (f"squeue failed ({error}): job states come from Slurm's accounting (sacct) until it answers, and "
            "may lag (UNKNOWN where there is none); `scontrol ping` says whether the controller is up")


def accounting_silence() -> str | None:
    """One line where the latest sacct call failed (slurmdbd down or out of reach), None where it answered
    or the cluster keeps no accounting."""
    if (error := _ANSWERS.unaccounted) is None:
        return None
    error = error.removeprefix("sacct: error: ")
    return (f"sacct failed ({error}): Slurm's accounting does not answer, so a job squeue no longer lists "
            "shows UNKNOWN, and allocated time and queue waits come from the run's own files; "
            "`sacctmgr show cluster` answers once slurmdbd is up again")


class SilenceWatch:
    """For a loop that polls: the line to print when squeue or sacct stops answering, and when it answers
    again, each once per change."""

    def __init__(self) -> None:
        self.silent = {"squeue": False, "sacct": False}

    def changes(self) -> list[str]:
        lines = []
        for name, note in (("squeue", controller_silence()), ("sacct", accounting_silence())):
            was, self.silent[name] = self.silent[name], note is not None
            if note is not None and not was:
                lines.append(note)
            elif was and note is None:
                lines.append(f"{name} answers again")
        return lines

    def tell(self) -> None:
        """`changes()`' lines as notes on stderr (stdout stays the command's output)."""
        for note in self.changes():
            print(f"note: {note}", file=sys.stderr, flush=True)


def accounting(job_ids: Sequence[str], max_age_s: float = STATE_MAX_AGE_S) -> dict[str, list[dict[str, Any]]]:
    """`sacct.sacct_records` of each job, from one sacct call for every job asked and every watched one
    whose accounting has aged (max_age_s=0: asked again now)."""
    with _ANSWERS.lock:
        if ask := _ANSWERS.stale(_ANSWERS.accounting, job_ids, max_age_s, also=_ANSWERS.watching()):
            _ask_sacct(ask)
        return {j: _ANSWERS.accounting[j][1] for j in job_ids}


def _ask_sacct(job_ids: Sequence[str]) -> None:
    for chunk in _chunks(job_ids):
        records: dict[str, list[dict[str, Any]]] = {j: [] for j in chunk}
        answered, _ANSWERS.unaccounted = sacct.sacct_answer(",".join(chunk))
        for record in answered:
            records.setdefault(record["JobID"].split(".")[0], []).append(record)
        now = time.monotonic()
        _ANSWERS.accounting.update({j: (now, records[j]) for j in chunk})


def _chunks(job_ids: Sequence[str]) -> Iterator[list[str]]:
    return (list(job_ids[i:i + IDS_PER_CALL]) for i in range(0, len(job_ids), IDS_PER_CALL))


def poll_max_s() -> float:
    """The longest wait between polls of jobs that do not change: $TAEHV_POLL_MAX_S, else 30 s."""
    try:
        return max(0.1, float(os.environ.get(POLL_MAX_ENV) or POLL_MAX_S))
    except ValueError:
        return POLL_MAX_S


class Backoff:
    """How long a polling loop waits: `first_s`, 1.5 times longer after each poll where nothing changed, up
    to `max_s` (None: `poll_max_s()`), and `first_s` again after a change."""

    def __init__(self, first_s: float, max_s: float | None = None) -> None:
        self.first_s = first_s
        self.max_s = max(first_s, poll_max_s() if max_s is None else max_s)
        self.interval = first_s

    def after(self, changed: bool) -> float:
        """The wait before the next poll, given whether the last one saw a change."""
        self.interval = self.first_s if changed else min(self.max_s, self.interval * 1.5)
        return self.interval
