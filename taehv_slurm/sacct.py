"""Slurm's accounting of jobs after the fact: sacct's records, one per allocation (each run of a requeued
job) and per step, as dicts or a DataFrame. The command itself runs through taehv_slurm.slurm (`run`: a
job's relay inside a job); taehv_slurm.jobstates shares one call's answer for many jobs within the process.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from taehv_slurm.slurm import run

if TYPE_CHECKING:
    import pandas as pd

SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Elapsed", "NNodes", "NTasks", "NodeList", "Submit",
                "Start", "End", "MaxRSS", "AllocTRES")
NO_ACCOUNTING = "accounting storage is disabled"  # in sacct's error (any case) where the cluster keeps none


def last_state(job_id: str, records: Sequence[Mapping[str, Any]]) -> str | None:
    """The state of the job's last allocation record in its accounting (`sacct_records`)."""
    states = [r["State"] for r in records if r["JobID"] == job_id]
    return str(states[-1]).split()[0] if states else None


def sacct_records(job_id: str | None = None, fields: Sequence[str] = SACCT_FIELDS) -> list[dict[str, Any]]:
    """sacct's rows as dicts (none when accounting is unavailable), with `Attempt` and, where Elapsed is
    asked for, `ElapsedSeconds`. `job_id` may list several jobs ('12,13_0'): one call for them all.

    With --duplicates every run of a requeued job is its own allocation record (State REQUEUED for all
    but the last): `Attempt` numbers them; a step carries its allocation's attempt. A run whose allocation
    shrank (`scontrol update NodeList=`) has a record per size, all but the last RESIZING: one attempt.
    """
    return sacct_answer(job_id, fields)[0]


def sacct_answer(job_id: str | None = None, fields: Sequence[str] = SACCT_FIELDS
                 ) -> tuple[list[dict[str, Any]], str | None]:
    """`sacct_records` and sacct's failure in one line: None where it answered, or where the cluster keeps
    no accounting (no records, and nothing failed)."""
    fields = _asked(fields)
    cmd = ["sacct", "-P", "-n", "--duplicates", "-o", ",".join(fields)]
    cmd += ["-j", job_id] if job_id else ["-S", "now-7days"]
    answer = run(cmd, timeout_s=30)
    failure = None if answer.ok or NO_ACCOUNTING in answer.error.lower() else answer.error
    lines = [line.split("|") for line in (answer.output if answer.ok else "").splitlines() if line.strip()]
    records = [dict(zip(fields, values)) for values in lines if len(values) == len(fields)]
    runs: dict[str, int] = {}  # allocation records seen per job id (array tasks are their own jobs)
    resized: set[str] = set()  # jobs whose last allocation record a resize ended: the next one goes on
    for record in records:
        base = record["JobID"].split(".")[0]
        if "." not in record["JobID"]:  # an allocation record: the next attempt of that job
            runs[base] = runs.get(base, -1) + (base not in resized)
            resized.discard(base)
            if record["State"] == "RESIZING":
                resized.add(base)
        record["Attempt"] = runs.get(base, 0)
        if "Elapsed" in record:
            record["ElapsedSeconds"] = elapsed_seconds(record["Elapsed"])
    return records, failure


def sacct_columns(fields: Sequence[str] = SACCT_FIELDS) -> list[str]:
    """The columns of `sacct_records(job_id, fields)`: JobID, State, the others, Attempt[, ElapsedSeconds]."""
    asked = _asked(fields)
    return [*asked, "Attempt", *(["ElapsedSeconds"] if "Elapsed" in asked else [])]


def _asked(fields: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(["JobID", "State", *fields]))


def sacct_frame(job_id: str | None = None, fields: Sequence[str] = SACCT_FIELDS,
                records: Sequence[Mapping[str, Any]] | None = None) -> pd.DataFrame:
    """sacct output as a DataFrame (empty without accounting): `sacct_records`, or the `records` given.
    `attrs['requeues']`: `requeue_count` of `job_id` (of every job without one)."""
    import pandas as pd

    records = sacct_records(job_id, fields) if records is None else records
    frame = pd.DataFrame(records, columns=sacct_columns(fields))
    if not records:
        frame["Attempt"] = frame["Attempt"].astype(float)  # as an empty column of attempts has always been
    frame.attrs["requeues"] = requeue_count(records, job_id)
    return frame


def requeue_count(records: Sequence[Mapping[str, Any]], job_id: str | None = None) -> int:
    """How often Slurm requeued `job_id` (every job without one): its allocations that another attempt
    followed, whatever ended them (REQUEUED, NODE_FAIL, PREEMPTED, ...)."""
    attempts: dict[str, int] = {}
    for r in records:
        if "." not in r["JobID"] and (r["JobID"] == job_id or not job_id):
            attempts[r["JobID"]] = max(attempts.get(r["JobID"], 0), int(r["Attempt"]))
    return sum(attempts.values())


def elapsed_seconds(text: str) -> float:
    """sacct's [D-]HH:MM:SS (or MM:SS.mmm) as seconds."""
    days, _, clock = text.rpartition("-")
    parts = [float(p) for p in re.split(r":", clock) if p]
    seconds = sum(v * 60 ** i for i, v in enumerate(reversed(parts)))
    return seconds + (int(days) * 86400 if days else 0)
